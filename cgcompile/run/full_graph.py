"""One CUDA graph for a whole Dynamo graph, chosen per call beside its piecewise graphs.

`FullGraph` is the first of the runtime's three executors (see `cgcompile.run.runtime`): it
declines a call (returns None) that must run piecewise, and the replay plan or the
stitch runs it.

`FullGraph.run` is the per-call choice, before any piece runs. A call takes the full
path when
  1. its size is a capture size itself (n == size: a full graph would run the split ops
     on padding rows, which piecewise graphs never do), and
  2. what it hands the graph host-side (`FullGraphPlan.key`: addresses of the inputs the
     split ops reach, the values of every host-side symbol) equals what the full graph
     of that size was captured with.
Else it runs piecewise, the reason logged once per new case and counted in
`BackendStats.piecewise_reasons`. The check is one list of pointers and one of ints per
call, whatever the depth of the model: nothing runs per layer.

When a full graph is captured: on the second consecutive call of a size that hands the
same key (so a key that changes every call, as a growing cache length does, never costs
a capture), and again, replacing it, when the key settles on new values (a new static
cache). One full graph per size: calls that alternate between two keys replay the graph
of one and run the other piecewise, rather than capture at every other call. The capturing call runs the graph once for real on the capture stream (its
results are the call's results, and its in-place writes happen once, as in eager), then
captures without running.

Memory. The full graph of size N is captured into the same pool as the piecewise graphs
and keeps only non-owning aliases of its buffers, so its memory and theirs overlap. That
is sound because a call runs either the full graph or piecewise graphs, never both: no
graph needs memory another one of the same step wrote (the invariant of
`capture.CaptureSession`, with "one step" now holding one full graph or one size's
pieces). Outputs are copied before they are returned, unless reuse_output_buffers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .buffers import StaticBuffer, empty_like_strided, fill_all
from .capture import CaptureSession, Mode, weak_alias
from .device_scalars import DeviceScalarBuffer
from ..errors import CaptureError
from ..ops import call_without_cudnn_attention
from ..passes import FullGraphPlan
from .runtime import OutputCopy, PieceRunner, _StitchNamespace, copy_out, submodule_name
from ..stats import RunCounts

if TYPE_CHECKING:
    from ..build.compiler import EagerPieceCompiles, FullGraphCode

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One captured size: the graph (None without CUDA graphs) and what it was captured with."""

    graph: torch.cuda.CUDAGraph | None
    key: tuple
    code: Callable  # what was captured (what runs per call without CUDA graphs)
    inputs: tuple[tuple[int, StaticBuffer], ...]  # (graph input, its buffer): the plan's copied inputs
    outputs: tuple  # non-owning aliases of the graph's outputs (non-tensors as they were)


class FullGraph:
    """The full path of one Dynamo graph: `run(args, n, size)` returns its outputs or None.

    code: what a full graph runs (`compiler.FullGraphCode`: the pieces' code in order,
        or the whole graph compiled as one); captured, or run per call without CUDA graphs.
    copies: how each tensor output is copied out of the graph's static buffers
        (`runtime.OutputCopy`); empty with Config.reuse_output_buffers.
    scalars: the graph's `device_scalars.DeviceScalarBuffer` (None: none). The runtime
        writes it before every call; here the host ints the graph returns that depend on
        its values are computed again for the call (a graph holds those of its capture).
    """

    kind = "full graph"

    def __init__(self, name: str, plan: FullGraphPlan, code: FullGraphCode, session: CaptureSession,
                 copies: tuple[OutputCopy, ...], *, cudagraphs: bool, scalars: DeviceScalarBuffer | None = None):
        self.name = name
        self.plan = plan
        self.code = code
        self.session = session
        self.copies = copies
        self.cudagraphs = cudagraphs
        self.scalars = scalars
        self.graphs: dict[int, _Entry] = {}
        self.calls = Counter()  # "full", "piecewise": this graph's calls by path (`counts`)
        self.reasons = Counter()  # its piecewise calls by case
        self.disabled: str | None = None  # why the full path is off for good (a failed capture)
        self._last_key: dict[int, tuple] = {}
        self._logged: set[str] = set()
        session.register(self)

    def clear(self) -> None:
        self.graphs.clear()
        self._last_key.clear()

    def drop_graphs(self) -> None:
        """Forget the captured graphs (their parameters moved) but not the last call's key
        of each size: the call that finds the new parameters settled then captures at once,
        if its key is that of the call before (`moved`), without a piecewise call first."""
        self.graphs.clear()

    def run(self, args: Sequence, n: int, size: int | None):
        if self.disabled or size is None or n != size or self.session.mode is not Mode.LAZY:
            return self._piecewise(self._why_not(n, size), "")
        key = self.plan.key(args)
        entry = self.graphs.get(size)
        if entry is not None and entry.key == key:
            self._count("full")
            self._last_key[size] = key  # a key seen once between replays is no reason to recapture
            return self._replay(entry, args, size)
        previous, self._last_key[size] = self._last_key.get(size), key
        if not self.session.lazy_capture:  # a capture under a memory budget planned no full graph
            return self._piecewise("no graph may be added after a capture under a memory budget", "")
        if previous != key:
            if entry is None and previous is None:
                return self._piecewise("first call of its size", "")
            captured = entry.key if entry is not None else previous
            return self._piecewise("a host-side input differs from the captured one",
                                   lambda: f": {self.plan.difference(key, captured)}")
        if entry is not None:
            self._log_once(f"recapture {size}", "cgcompile: %s recaptures its full graph of size %d: %s",
                           self.name, size, self.plan.difference(key, entry.key))
        self._count("full")
        return self._capture(args, size, key)

    def moved(self, args: Sequence, n: int, size: int | None) -> None:
        """A call whose parameters are not where the graphs read them: it runs without
        graphs. Its key is kept as the last of its size, so that the next call, if the new
        parameters are still there (settled: graphs dropped, `drop_graphs`) and it hands the
        same key, captures the full graph directly. For a static cache made anew at every
        generate(), that is one capture per generate() instead of every piece's and then the
        full graph's."""
        if not self.disabled and size is not None and n == size and self.session.mode is Mode.LAZY:
            self._last_key[size] = self.plan.key(args)
        return self._piecewise("its parameters are not where its graphs read them", "")

    # -- the two paths ---------------------------------------------------------------------

    def _replay(self, entry: _Entry, args: Sequence, size: int):
        if entry.graph is None:
            return self._host_ints(args, tuple(entry.code(*args)))
        fill_all(entry.inputs, args, size, size)  # never padded: the full path runs at n == size
        entry.graph.replay()
        return self._host_ints(args, self._hand_out(entry.outputs))

    def _host_ints(self, args: Sequence, outputs: tuple) -> tuple:
        """The host ints computed from device scalars, for this call: a graph holds those of
        its capture, a whole-graph compile those of the call it was compiled at."""
        return outputs if self.scalars is None else self.scalars.host_outputs(args, outputs)

    def _capture(self, args: Sequence, size: int, key: tuple):
        code = self.code.for_call(size, self.plan.symbol_values(args), args)
        if not self.cudagraphs:
            self.graphs[size] = _Entry(None, key, code, (), ())
            return self._host_ints(args, tuple(code(*args)))
        # The real run: this call's results, and its in-place writes (a cache update) happen
        # once. Capture then records the same work without running it. Its results are handed
        # out as a replay's are, in eager's layout where eager's is contiguous: in a compiled
        # piece's layout (a KV cache `cat` laid out [B, T, H, D]-major by Inductor) the next
        # call would fail Dynamo's stride guard and compile another graph.
        outputs = self._host_ints(args, self._hand_out(tuple(self.session.warm_up(code, *args))))
        try:
            graph, static_args, static_outputs = self.session.capture(
                self.name, code, lambda: self._static_args(args)
            )
        except CaptureError as error:
            self.disabled = f"capturing the full graph failed: {error}"
            log.warning("cgcompile: %s: %s; it runs piecewise from now on", self.name, self.disabled)
            return outputs
        inputs = tuple((i, StaticBuffer(weak_alias(static_args[i]))) for i in self.plan.copied)
        aliases = tuple(weak_alias(o) if isinstance(o, torch.Tensor) else o for o in static_outputs)
        self.graphs[size] = _Entry(graph, key, code, inputs, aliases)
        log.info("cgcompile: %s captured a full graph of size %d", self.name, size)
        return outputs

    def _static_args(self, args: Sequence) -> list:
        """The call's inputs with each copied one replaced by a buffer of the pool (this
        runs inside capture, so the buffers come from the pool); the data is copied in
        at every replay."""
        static = list(args)
        for i in self.plan.copied:
            static[i] = empty_like_strided(args[i])
        return static

    def _hand_out(self, outputs: tuple):
        return copy_out(outputs, self.copies) if self.copies else outputs

    # -- accounting -------------------------------------------------------------------------

    def _why_not(self, n: int, size: int | None) -> str:
        if self.disabled:
            return "its full graph failed to capture"
        if self.session.mode is not Mode.LAZY:
            return "ahead-of-time capture runs piecewise"
        if size is None:
            return "the call's size has no graph"
        return "the call's size is padded (a full graph would run the split ops on padding rows)"

    def _piecewise(self, case: str, detail: str | Callable[[], str]):
        """Count a piecewise call; `detail` (or what it returns: made only for the log, once
        per case, as a model whose cache length grows takes this path every call) is logged."""
        self._count("piecewise")
        self.reasons[case] += 1
        if case not in self._logged:
            self._logged.add(case)
            log.info("cgcompile: %s runs piecewise: %s%s", self.name, case, detail() if callable(detail) else detail)
        return None

    def _count(self, path: str) -> None:
        self.calls[path] += 1

    def counts(self) -> RunCounts:
        """This graph's calls by path, why the piecewise ones were, and its compiles."""
        compiles = self.code.compiles
        return RunCounts(full_graph_calls=self.calls["full"], piecewise_calls=self.calls["piecewise"],
                         piecewise_reasons=dict(self.reasons), full_graph_compilations=compiles.compilations,
                         full_graph_compile_s=compiles.compile_s)

    def _log_once(self, case: str, message: str, *args) -> None:
        if case not in self._logged:
            self._logged.add(case)
            log.info(message, *args)


def plain_function(stitch: torch.fx.GraphModule, runners: Sequence[PieceRunner], n_at: tuple[int, int] | None,
                   cudnn_attention: bool, eager_compiles: EagerPieceCompiles | None = None) -> Callable:
    """The whole graph as one function: the stitch calling every piece's own code in
    order, no graphs, no padding (the full path runs only at n == size). With
    `eager_compiles`, eager pieces that hold attention of a few query rows run compiled
    (see `EagerPieceCompiles`). n_at: (graph input, dim) where a call's n is read (the
    compiled pieces take their inputs in the layout traced for n); None: a static graph."""
    compiled = {}
    if eager_compiles is not None:
        for runner in runners:
            if type(runner) is PieceRunner and isinstance(runner.fn, torch.fx.GraphModule):
                compiled[submodule_name(runner)] = eager_compiles.for_piece(runner.fn)
    namespaces: dict[int, _StitchNamespace] = {}

    def namespace(args) -> _StitchNamespace:
        n = 0 if n_at is None else args[n_at[0]].shape[n_at[1]]
        if n not in namespaces:
            calls = {submodule_name(r): compiled.get(submodule_name(r)) or r.at(n, None) for r in runners}
            namespaces[n] = _StitchNamespace(stitch, calls)
        return namespaces[n]

    code = type(stitch).forward
    if cudnn_attention:
        return lambda *args: code(namespace(args), *args)
    return lambda *args: call_without_cudnn_attention(code, namespace(args), *args)
