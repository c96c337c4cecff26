"""One CUDA graph for a whole Dynamo graph, chosen per call beside its piecewise graphs.

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

import copy
import dataclasses
import functools
import logging
import time
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from .ops import call_without_cudnn_attention
from .buffers import StaticBuffer, empty_like_strided, fill_all
from .capture import CaptureSession, Mode, weak_alias
from .compat import inductor_compile
from .errors import CaptureError
from .passes import FullGraphPlan, lower_small_query_attention
from .runtime import GraphRuntime, OutputCopy, PieceRunner, _StitchNamespace, copy_out
from .stats import BackendStats

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

    code: what a full graph runs (`full_graph_code.FullGraphCode`: the pieces' code in order,
        or the whole graph compiled as one); captured, or run per call without CUDA graphs.
    copies: how each tensor output is copied out of the graph's static buffers
        (`runtime.OutputCopy`); empty with Config.reuse_output_buffers.
    """

    def __init__(self, name: str, plan: FullGraphPlan, code: FullGraphCode, session: CaptureSession,
                 stats: BackendStats, copies: tuple[OutputCopy, ...], *, cudagraphs: bool):
        self.name = name
        self.plan = plan
        self.code = code
        self.session = session
        self.stats = stats
        self.copies = copies
        self.cudagraphs = cudagraphs
        self.graphs: dict[int, _Entry] = {}
        self.calls = Counter()  # "full", "piecewise": this graph's share of the stats
        self.disabled: str | None = None  # why the full path is off for good (a failed capture)
        self._last_key: dict[int, tuple] = {}
        self._logged: set[str] = set()
        session.register(self)

    def clear(self) -> None:
        self.graphs.clear()
        self._last_key.clear()

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
        if previous != key:
            if entry is None and previous is None:
                return self._piecewise("first call of its size", "")
            difference = self.plan.difference(key, entry.key if entry is not None else previous)
            return self._piecewise("a host-side input differs from the captured one", f": {difference}")
        if entry is not None:
            self._log_once(f"recapture {size}", "cgcompile: %s recaptures its full graph of size %d: %s",
                           self.name, size, self.plan.difference(key, entry.key))
        self._count("full")
        return self._capture(args, size, key)

    def skip(self, case: str) -> None:
        """Count this call as piecewise for `case`, decided by the caller."""
        return self._piecewise(case, "")

    # -- the two paths ---------------------------------------------------------------------

    def _replay(self, entry: _Entry, args: Sequence, size: int):
        if entry.graph is None:
            return tuple(entry.code(*args))
        fill_all(entry.inputs, args, size, size)  # never padded: the full path runs at n == size
        entry.graph.replay()
        return self._hand_out(entry.outputs)

    def _capture(self, args: Sequence, size: int, key: tuple):
        code = self.code.for_call(size, self.plan.symbol_values(args), args)
        if not self.cudagraphs:
            self.graphs[size] = _Entry(None, key, code, (), ())
            return tuple(code(*args))
        # The real run: this call's results, and its in-place writes (a cache update) happen
        # once. Capture then records the same work without running it.
        outputs = tuple(self.session.warm_up(code, *args))
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

    def _piecewise(self, case: str, detail: str):
        self._count("piecewise")
        self.stats.piecewise_reasons[case] = self.stats.piecewise_reasons.get(case, 0) + 1
        self._log_once(case, "cgcompile: %s runs piecewise: %s%s", self.name, case, detail)
        return None

    def _count(self, path: str) -> None:
        self.calls[path] += 1
        if path == "full":
            self.stats.full_graph_calls += 1
        else:
            self.stats.piecewise_calls += 1

    def _log_once(self, case: str, message: str, *args) -> None:
        if case not in self._logged:
            self._logged.add(case)
            log.info(message, *args)


def plain_function(runtime: GraphRuntime, cudnn_attention: bool,
                   eager_compiles: EagerPieceCompiles | None = None) -> Callable:
    """The whole graph as one function: every piece's own code in order, no graphs, no
    padding (the full path runs only at n == size). With `eager_compiles`, eager pieces
    that hold attention of a few query rows run compiled (see `full_graph_code`)."""
    calls = {}
    for runner in runtime.runners:
        name = runner.piece_name.rsplit(".", 1)[-1]
        compiled = None
        if eager_compiles is not None and type(runner) is PieceRunner and isinstance(runner.fn, torch.fx.GraphModule):
            compiled = eager_compiles.for_piece(runner.fn)
        calls[name] = compiled or _plain_piece(runner, runtime.step)
    namespace = _StitchNamespace(runtime.stitch, calls)
    code = type(runtime.stitch).forward
    if cudnn_attention:
        return lambda *args: code(namespace, *args)
    return lambda *args: call_without_cudnn_attention(code, namespace, *args)


def _plain_piece(runner, step) -> Callable:
    traced = getattr(runner, "traced", None)
    if traced is None:
        return runner.step_fn
    fn = runner.fn
    if not traced.checked:
        return fn
    return lambda *args: fn(*traced.conform(args, step.n))


# --------------------------------------------------------------------------------------
# What a full graph runs: the pieces' code in order, or the whole Dynamo graph compiled as one.
#
# By default the full graph of a size captures the pieces' own compiled code, one piece
# after another: nothing is compiled beyond the pieces, but every value that crosses a
# piece boundary is written out by the piece that makes it and read back by the next, and
# nothing fuses across a boundary (the residual add and norm after attention, a cache
# write and the projection before it). With `Config.full_graph_compile`, the first capture
# of each size compiles the whole Dynamo graph once more with Inductor, at that call's
# shapes, and the full graph captures that instead.
#
# Why a compile at one call's shapes is right for every call that replays it: every shape
# in the graph is an expression of its symbols, and the full path replays a graph only
# for calls whose capture size and other symbols' values equal the captured ones (the
# plan's key). So a compile is kept per (size, symbol values), and a capture under a new
# key compiles anew; after `limit` compiles a graph's further keys capture the pieces'
# code, as does any size whose compile fails (logged, with the error).
#
# `Config.small_query_attention` makes decode attention fast inside a full graph either way:
# inside the whole-graph compile, attention calls of a few query rows are lowered to
# batched matmuls (`passes.small_query`); without it, each eager piece that holds such a call is
# compiled by Inductor, lowered, at the shapes of the call that captures it
# (`EagerPieceCompiles`): in the full graph the eager pieces are captured like the rest, so
# nothing about them has to stay eager, and identical layers share one compile.


log = logging.getLogger(__name__)


class CompileCache:
    """Inductor compiles at concrete shapes, kept by key: timed, at most `limit` of them,
    a failure logged once and remembered. `get` returns None where there is no compile
    (over the limit, or failed): the caller then runs its uncompiled code, still right.

    compilations / compile_s: the compiles made and the wall seconds they took.
    """

    def __init__(self, options: dict[str, Any], cudnn_attention: bool, limit: int):
        self.options = dict(options)
        self.cudnn_attention = cudnn_attention
        self.limit = limit
        self.compilations = 0
        self.compile_s = 0.0
        self._compiled: dict[tuple, Callable] = {}
        self._failed: set[tuple] = set()

    def get(self, key: tuple, gm: torch.fx.GraphModule, args: Sequence, what: str) -> Callable | None:
        fn = self._compiled.get(key)
        if fn is not None or key in self._failed:
            return fn
        if len(self._compiled) >= self.limit:
            self._failed.add(key)
            log.info("cgcompile: %s already has %d compiles; this one runs uncompiled", what, self.limit)
            return None
        t0 = time.perf_counter()
        # SDPA picks its kernel while Inductor traces: the cuDNN switch must hold then too.
        compile_now = lambda: inductor_compile(gm, list(args), self.options)  # noqa: E731
        try:
            compiled = compile_now() if self.cudnn_attention else call_without_cudnn_attention(compile_now)
        except Exception as error:  # Inductor raises many types; the uncompiled code stays right
            self._failed.add(key)
            log.warning("cgcompile: compiling %s failed (%s: %s); it runs uncompiled", what,
                        type(error).__name__, error)
            return None
        elapsed = time.perf_counter() - t0
        self.compilations += 1
        self.compile_s += elapsed
        log.info("cgcompile: compiled %s in %.1f s", what, elapsed)
        if not self.cudnn_attention:
            compiled = functools.partial(call_without_cudnn_attention, compiled)
        self._compiled[key] = compiled
        return compiled


class FullGraphCode:
    """`for_call(size, host_values, args)`: the function a full graph of that size and those
    symbol values captures.

    pieces: the pieces' code in order (`full_graph.plain_function`), used where there is
        no whole-graph compile.
    gm: the Dynamo graph to compile as one, or None: always the pieces' code.
    compiles: the whole-graph compiles, by (size, symbol values).
    """

    def __init__(self, name: str, pieces: Callable, gm: torch.fx.GraphModule | None = None,
                 options: dict[str, Any] | None = None, cudnn_attention: bool = False,
                 small_query_attention: bool = False, limit: int = 4):
        # Inductor's pre-grad passes rewrite the graph they are handed (and so may we);
        # the dump and the split keep the original.
        self.gm = None if gm is None else torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if self.gm is not None and small_query_attention:
            lowered = lower_small_query_attention(self.gm)
            log.info("cgcompile: %s: %d attention calls of few query rows lowered to batched matmuls", name, lowered)
        self.name = name
        self.pieces = pieces
        self.compiles = CompileCache(options or {}, cudnn_attention, limit)

    def for_call(self, size: int, host_values: Sequence, args: Sequence) -> Callable:
        if self.gm is None:
            return self.pieces
        fn = self.compiles.get((size, tuple(host_values)), self.gm, args, f"{self.name} as one graph")
        return self.pieces if fn is None else fn


class EagerPieceCompiles:
    """Compiles of eager pieces for full graphs that run the pieces' code
    (`Config.small_query_attention`: without `full_graph_compile`, or where a whole-graph
    compile failed), one per distinct (piece code, input layouts and values, aliasing),
    shared by every Dynamo graph of a Backend.

    `for_piece(gm)` returns the function a full graph calls for that eager piece: the
    piece lowered and compiled at the shapes of its first call with them (the lowered FX
    code where there is no compile); or None when the piece holds no attention to lower
    (it then runs as it is).
    """

    def __init__(self, options: dict[str, Any], cudnn_attention: bool, limit: int = 16):
        self.compiles = CompileCache(options, cudnn_attention, limit)

    def for_piece(self, gm: torch.fx.GraphModule) -> Callable | None:
        lowered = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if not lower_small_query_attention(lowered):
            return None
        return lambda *args: self._run(lowered, args)

    def _run(self, gm: torch.fx.GraphModule, args: tuple):
        key = (gm.code, tuple(_describe(a) for a in args), _aliasing(args))
        fn = self.compiles.get(key, gm, args, "an attention piece for a full graph") or gm
        return fn(*args)


def _describe(value) -> tuple:
    """What a compile at concrete shapes depends on: a tensor's layout, an int's value."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, tuple(value.shape), value.stride(), value.data_ptr() % 16 == 0)
    return (type(value).__name__, value)


def _aliasing(args: tuple) -> tuple:
    """Which tensor arguments share storage (a compile treats aliased inputs it writes
    into differently): per argument, the first argument with the same storage."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(a.untyped_storage().data_ptr(), i) if isinstance(a, torch.Tensor) else None
                 for i, a in enumerate(args))
