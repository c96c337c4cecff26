"""Replay one capturable piece from CUDA graphs, one graph per capture size.

Every runner here is asked once per (n, size) for the callable the stitch calls
(`PieceRunner.at(n, size)`): n is the call's size along the capture dimension, size the
size N its graphs run at, chosen by the graph's runtime before any piece runs (the
capture size n is padded to, n itself for a graph run at exact sizes, or None: no graph,
n above the largest capture size or past the exact-size limit). Nothing is shared or
set between calls: the sizes are bound into what `at` returns.

Contract of `CudaGraphPiece.run(n, size, *args)`:
  - N None: run the compiled piece directly, inputs in their traced layout.
  - otherwise the graph of size N is captured on first use; once the session takes no
    new graphs (after a capture under a memory budget), a size without a graph runs the
    compiled piece directly, as for N None.
  - inputs that are parameters or buffers are captured by address (never copied);
    an input whose address and strides equal the captured ones (the output of the
    previous piece's graph, or a registered persistent buffer such as a pipeline
    stage's intermediate buffer; see `buffers.LiveBuffers`) is used in place; any other
    input is copied into the captured buffer, whose padding rows are zeroed
    (`buffers.fill_all`).
  - outputs are the graph's static buffers narrowed to n rows: they stay valid until
    the next replay of the same graph.
  - no input or output is a CPU tensor (the split rule's cpu_tensor): a capture that
    would hold one fails with `capture.HostTensorError`.
  - a capture that fails raises `PieceCaptureFailed` (the piece, its arguments, the
    padded arguments it was captured with, and the cause). The piece does not recover
    itself: the runtime that called it catches that, has the piece split again at the
    node to blame (`recovery.PieceRecovery`) and swaps its runner (`runtime.GraphRuntime`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import sympy
import torch

from .buffers import (StaticBuffer, TracedLayout, copy_rows, empty_like_strided, fill_all, narrow_all,
                      padded_shape)
from .capture import CaptureSession, Mode, weak_alias
from ..errors import CaptureError
from ..passes import address, example_value, show_address, written_inputs
from .replay_plan import CapturedGraph
from .runtime import PieceCaptureFailed, PieceRunner
from ..stats import RunCounts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PieceLayout:
    """Where the capture dimension appears in a piece's inputs and outputs."""

    input_dims: tuple[tuple[int, ...], ...]  # per input: dims equal to the capture symbol
    size_inputs: tuple[int, ...]  # SymInt inputs equal to the capture symbol
    by_address: tuple[bool, ...]  # per input: parameter/buffer, captured by address
    output_dims: tuple[tuple[int, ...], ...]
    written: tuple[int, ...] = ()  # inputs the piece writes into (a buffer's running statistic)


def piece_layout(spec, symbol: sympy.Symbol | None, static_inputs: frozenset[str]) -> PieceLayout | str:
    """The layout, or a sentence saying why the piece cannot be padded.

    symbol None: the piece is never padded (a static graph, or one run at exact sizes);
    no dimension is then resized and every SymInt input is passed as it comes."""
    input_dims, size_inputs, by_address = [], [], []
    for i, node in enumerate(spec.inputs):
        value = example_value(node)
        by_address.append(node.op == "placeholder" and node.name in static_inputs)
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            if symbol is not None and expr == symbol:
                size_inputs.append(i)
            elif symbol is not None and symbol in expr.free_symbols:
                return f"input {i} is the size {expr}, not the capture dimension itself"
        dims = _dims_of(value, symbol)
        if isinstance(dims, str):
            return f"input {i}: {dims}"
        input_dims.append(dims)
    output_dims = []
    for k, node in enumerate(spec.outputs):
        dims = _dims_of(example_value(node), symbol)
        if isinstance(dims, str):
            return f"output {k}: {dims}"
        output_dims.append(dims)
    return PieceLayout(tuple(input_dims), tuple(size_inputs), tuple(by_address), tuple(output_dims),
                       written_inputs(spec.graph))


def _dims_of(value, symbol) -> tuple[int, ...] | str:
    if not isinstance(value, torch.Tensor) or symbol is None:
        return ()
    dims = []
    for d, size in enumerate(value.shape):
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if expr == symbol:
            dims.append(d)
        elif expr is not None and symbol in expr.free_symbols:
            return f"shape {tuple(value.shape)} has {expr}, which padding cannot handle"
    return tuple(dims)


@dataclasses.dataclass
class _Graph:
    """One captured size: the graph and non-owning aliases of its static tensors."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[tuple[int, StaticBuffer], ...]  # (input, its buffer): tensor inputs not parameters or buffers
    addresses: list  # per input: (data_ptr, stride) at capture, None for non-tensors
    outputs: tuple[torch.Tensor, ...]


class _TracedPiece(PieceRunner):
    """A compiled piece whose inputs are handed over in the layout it was traced with."""

    def __init__(self, name, fn, traced: TracedLayout):
        super().__init__(name, fn)
        self.traced = traced

    def counts(self) -> RunCounts:
        """Inputs copied into the traced layout (calls without graphs)."""
        return RunCounts(layout_copies=self.traced.copies)

    def compiled_at(self, n: int) -> Callable:
        """The compiled piece itself, run without graphs or padding on calls of n rows."""
        if not self.traced.checked:
            return self.fn  # nothing to conform: the piece's own function, no wrapper
        return functools.partial(_conformed, self.fn, self.traced, n)

    def at(self, n: int, size: int | None) -> Callable:
        return self.compiled_at(n)


def _conformed(fn: Callable, traced: TracedLayout, n: int, *args):
    return fn(*traced.conform(args, n))


class CudaGraphPiece(_TracedPiece):
    """A compiled piece replayed from one CUDA graph per size of its graph's calls.

    traced: the traced strides of the inputs; input buffers are allocated in them.
    """

    replays_graphs = True

    def __init__(self, name, fn, layout: PieceLayout, session: CaptureSession, traced: TracedLayout):
        super().__init__(name, fn, traced)
        self.layout = layout
        self.session = session
        self.graphs: dict[int, _Graph] = {}
        self._warmed: set[int] = set()  # sizes that had an ahead-of-time warm-up run
        self._copy_inputs = tuple(
            i for i, by_addr in enumerate(layout.by_address) if not by_addr and i not in layout.size_inputs
        )
        session.register(self)

    def at(self, n: int, size: int | None) -> Callable:
        if size is None:
            return self.compiled_at(n)
        return functools.partial(self.run, n, size)

    def clear(self) -> None:
        self.graphs.clear()
        self.session.graphs_changed()

    def captured_graph(self, size: int) -> CapturedGraph | None:
        """This piece's graph of `size` as a replay plan binds it, or None (not captured)."""
        entry = self.graphs.get(size)
        if entry is None:
            return None
        return CapturedGraph(entry.graph.replay, entry.inputs, entry.outputs, self.layout.output_dims)

    def run(self, n: int, size: int, *args):
        entry = self.graphs.get(size)
        if entry is None and self.session.mode is Mode.LAZY and not self.session.lazy_capture:
            return self.fn(*self.traced.conform(args, n))  # no graph, and none may be added now
        if entry is None or self.session.mode is not Mode.LAZY:
            return self._first_call(args, n, size, entry)
        return self._replay(entry, args, n, size)

    # -- replay (hot path) -------------------------------------------------------------

    def _replay(self, entry: _Graph, args, n: int, size: int):
        fill_all(entry.inputs, args, n, size)
        if self.session.check_addresses:
            self._check_addresses(entry, args)
        entry.graph.replay()
        if n == size:
            return entry.outputs
        return narrow_all(entry.outputs, self.layout.output_dims, n)

    def _check_addresses(self, entry: _Graph, args) -> None:
        for i, by_addr in enumerate(self.layout.by_address):
            if by_addr and (address(args[i]), args[i].stride()) != entry.addresses[i]:
                raise CaptureError(
                    f"{self.piece_name}: input {i} (a parameter or buffer) was captured at address "
                    f"{show_address(entry.addresses[i][0])} but is now at {show_address(address(args[i]))}; "
                    f"it was replaced after capture. Update weights in place (param.data.copy_) or call clear() "
                    f"to recapture"
                )

    # -- first call of a size: warm up and capture ---------------------------------------

    def _first_call(self, args, n: int, size: int, entry: _Graph | None):
        padded, in_place = self._padded_args(args, n, size)
        mode = self.session.mode
        if mode is Mode.WARMUP:
            self._warmed.add(size)
            outputs = self._warm_up(padded)
            return narrow_all(outputs, self.layout.output_dims, n)
        if entry is None:
            if mode is Mode.LAZY or size not in self._warmed:  # never capture a cold piece
                self._warm_up(padded)
                # Fresh copies for the capture: the warm-up may have written into its own.
                padded, in_place = self._padded_args(args, n, size)
            try:
                return self._capture(padded, in_place, n, size)
            except CaptureError as error:
                raise PieceCaptureFailed(self, args, padded, error) from error
        return self._replay(entry, args, n, size)

    def _warm_up(self, padded: list):
        """Run once before capture, leaving the inputs the piece writes into as they were:
        the replay that follows the capture is the call's one update of a buffer."""
        saved = [(padded[i], padded[i].clone()) for i in self.layout.written
                 if isinstance(padded[i], torch.Tensor)]
        outputs = self.session.warm_up(self.fn, *padded)
        for tensor, before in saved:
            tensor.copy_(before)
        return outputs

    def _padded_args(self, args, n: int, size: int) -> tuple[list, set[int]]:
        """Inputs at the capture size, and which inputs are live buffers read in place
        (`buffers.LiveBuffers`: earlier graphs' outputs, persistent buffers)."""
        padded, in_place = list(args), set()
        for i in self._copy_inputs:
            arg, dims = args[i], self.layout.input_dims[i]
            if not isinstance(arg, torch.Tensor):
                continue
            shape = padded_shape(arg, dims, size)
            if self.session.live.holds(arg, shape) and self.traced.has_layout(i, arg, size):
                padded[i] = arg.as_strided(shape, arg.stride(), arg.storage_offset())
                in_place.add(i)
            else:
                padded[i] = self.traced.padded_copy(i, arg, dims, n, size)
        for i in self.layout.size_inputs:
            padded[i] = size
        return padded, in_place

    def _capture(self, padded: list, in_place: set[int], n: int, size: int):
        def make_args():
            # Buffers for copied inputs are allocated here, inside capture: from the pool.
            return [
                empty_like_strided(a)
                if i in self._copy_inputs and isinstance(a, torch.Tensor) and i not in in_place
                else a
                for i, a in enumerate(padded)
            ]

        graph, static_args, outputs = self.session.capture(self.piece_name, self.fn, make_args)
        outputs = tuple(outputs)
        addresses = [(address(a), a.stride()) if isinstance(a, torch.Tensor) else None for a in static_args]
        # Inputs read in place get a buffer too: their memory, which a later call whose
        # tensor lies elsewhere is copied into.
        inputs = tuple(
            (i, StaticBuffer(weak_alias(static_args[i]), self.layout.input_dims[i]))
            for i in self._copy_inputs if isinstance(static_args[i], torch.Tensor)
        )
        entry = _Graph(graph, inputs, addresses, tuple(weak_alias(o) for o in outputs))
        self.graphs[size] = entry
        self.session.graphs_changed()
        for i in self._copy_inputs:  # the first replay needs the real data
            if isinstance(static_args[i], torch.Tensor) and i not in in_place:
                copy_rows(static_args[i], padded[i])
        graph.replay()
        narrowed = narrow_all(outputs, self.layout.output_dims, n)
        for full, view in zip(outputs, narrowed):
            self.session.live.add_output(view, full.shape)
        return narrowed


class PaddedPiece(_TracedPiece):
    """A compiled piece run padded to the call's size without CUDA graphs.

    What `Config(padding=True)` gives on CPU: the pieces compute on exactly the padded
    inputs a graph would replay with, so tests without a GPU see what padding does.
    """

    def __init__(self, name, fn, layout: PieceLayout, traced: TracedLayout):
        super().__init__(name, fn, traced)
        self.layout = layout

    def at(self, n: int, size: int | None) -> Callable:
        if size is None or size == n:
            return self.compiled_at(n)
        return functools.partial(self.run, n, size)

    def run(self, n: int, size: int, *args):
        padded = list(args)
        for i, dims in enumerate(self.layout.input_dims):
            if dims and not self.layout.by_address[i]:
                padded[i] = self.traced.padded_copy(i, args[i], dims, n, size)
        for i in self.layout.size_inputs:
            padded[i] = size
        return narrow_all(self.fn(*padded), self.layout.output_dims, n)


class CompiledPiece(_TracedPiece):
    """A compiled piece run as it comes, its inputs handed over in the traced layout."""
