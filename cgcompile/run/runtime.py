"""Run one Dynamo graph per call: choose the call's size, then one executor runs it.

The runtime (`GraphRuntime`) reads the call's size n along the capture dimension and
the size N its graphs run at (`CallSizing`; N None: no graphs), then asks its executors
in a fixed order; the first that does not decline runs the call. Three implementations
of one interface (`Executor`: `run(args, n, size)`, and a `kind` for logs and dumps):

  executor                     runs a call when                   why it exists
  ---------------------------  ---------------------------------  ----------------------------
  full graph                   n == N, and the host-side inputs   one launch for the whole
  (`full_graph.FullGraph`)     match its capture (checked per     call, split ops captured too
                               call)
  replay plan                  every graph piece holds a graph    no per-piece lookups, checks
  (`replay_plan.ReplayPlans`)  of N, and the session captures     or narrowing per call
                               lazily
  stitch (`Stitch`)            always (it never declines)         captures, eager pieces, calls
                                                                  without graphs

The order is the same for every call; which one runs is fixed per (n, N) once the
graphs of N are captured (a full graph still declines a call whose host-side inputs
differ). The sizes are passed down explicitly: the stitch binds them into the callables
its generated code calls (`PieceRunner.at(n, size)`), one namespace per (n, N).

Capture recovery: a graph piece whose capture fails raises `PieceCaptureFailed`. The
runtime catches it at the piece's call site (`GraphRuntime._guarded`), asks the
`recovery.PieceRecovery` it was built with for the piece split again at the node to
blame (built by `phases.build_runners`, as the first runners were), swaps its own
runner, drops its graphs and runs the rest of the call without graphs. Nothing below
the runtime holds a callback into it, and nothing writes into it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, NamedTuple, Protocol

import torch

from .buffers import overlaps
from .buffers import SizePolicy
from ..errors import CaptureError
from ..ops import call_without_cudnn_attention
from .replay_plan import ReplayPlans
from ..stats import RunCounts, total
from .device_scalars import DeviceScalarBuffer
from .fused_weights import FusedWeights
from .weights import ParameterAddresses

log = logging.getLogger(__name__)


class PieceRunner(torch.nn.Module):
    """Runs one piece: its FX code (eager pieces, compiler="eager") or a compiled function.

    replays_graphs: whether the runner holds CUDA graphs (`captured_graph(size)`), which
    replay plans launch directly instead of calling the runner.
    """

    replays_graphs = False

    def __init__(self, name: str, fn: Callable):
        super().__init__()
        self.piece_name = name
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)

    def counts(self) -> RunCounts:
        """What this runner counted (`BackendStats`); a plain piece counts nothing."""
        return RunCounts()

    def at(self, n: int, size: int | None) -> Callable:
        """What the stitch calls for this piece on a call of n rows run at `size`: here the
        piece's code itself, without the layers of nn.Module.__call__ (hook checks) around
        this runner and around an FX piece. Sized runners bind n and size into it."""
        return self.fn.forward if isinstance(self.fn, torch.fx.GraphModule) else self.fn


def submodule_name(runner: PieceRunner) -> str:
    """The name the stitch calls `runner` by ("piece_3" for "graph0.piece_3")."""
    return runner.piece_name.rsplit(".", 1)[-1]


class _StitchNamespace:
    """The `self` the stitch's generated forward runs with on the hot path.

    The generated code reaches each piece as `self.submod_<k>(...)`. On the GraphModule
    that is nn.Module.__getattr__ and then nn.Module.__call__ per piece and per step;
    here it is a plain attribute holding what the runner's `at(n, size)` returned.
    Anything else the code reads (get_attr constants) comes from the stitch itself.
    """

    def __init__(self, stitch: torch.fx.GraphModule, calls: dict[str, Callable]):
        self._stitch = stitch
        self.bind(calls)

    def bind(self, calls: dict[str, Callable]) -> None:
        """Reach the pieces through `calls` from now on (the code running holds this object)."""
        self.__dict__.update(calls)

    def __getattr__(self, name: str):
        return getattr(self._stitch, name)


class Executor(Protocol):
    """One way to run a whole call of one Dynamo graph (see the table at the top).

    run: the call's outputs, or None where this executor declines the call (the next one
    runs it). kind: what it is, for logs, dumps and stats.
    """

    kind: str

    def run(self, args: tuple, n: int, size: int | None) -> Any: ...


class PieceCaptureFailed(CaptureError):
    """A graph piece's capture failed; raised to the runtime that runs the piece.

    piece: the `graph_piece.CudaGraphPiece`; inputs: what the stitch passed it; padded:
    those at the capture size, as the capture had them (where the search for the node to
    blame runs); cause: the `CaptureError`, also this exception's `__cause__`. Uncaught
    (a runtime without recovery), it reads as the `CaptureError` it wraps.
    """

    def __init__(self, piece: PieceRunner, inputs: tuple, padded: list, cause: CaptureError):
        super().__init__(str(cause))
        self.piece = piece
        self.inputs = inputs
        self.padded = padded
        self.cause = cause


@dataclasses.dataclass(frozen=True)
class Resplit:
    """What replaces a piece whose capture failed.

    stitch: the stitch of the piece's re-split, calling `runners` in order; None where
    no node could be blamed: `runners` is then the piece's own FX code, run eagerly.
    """

    stitch: torch.fx.GraphModule | None
    runners: tuple[PieceRunner, ...]


class Recovery(Protocol):
    """What a runtime asks when a graph piece's capture fails (`recovery.PieceRecovery`)."""

    def resplit(self, failed: PieceCaptureFailed) -> Resplit: ...


class CallSize(NamedTuple):
    """A call's size n along the capture dimension (0 for a static graph) and the size N
    its graphs run at (None: no graphs)."""

    n: int
    size: int | None


@dataclasses.dataclass(frozen=True)
class OutputCopy:
    """How to copy one graph output out of a CUDA graph's static buffer.

    contiguous: eager returns this output contiguous (its size and strides are static in
    the graph), so the copy is made contiguous whatever layout the compiled piece chose.
    Inductor may lay a result out differently from eager (a KV-cache `cat` after a
    transpose, for one); returning that layout would make the next call's stride guard
    fail and Dynamo compile the function again. Otherwise the copy keeps the layout.
    """

    index: int
    contiguous: bool


def copy_out(outputs, copies: tuple[OutputCopy, ...]) -> tuple:
    """`outputs` with each output `copies` names replaced by its copy (see OutputCopy)."""
    outputs = list(outputs)
    for copy in copies:
        value = outputs[copy.index]
        outputs[copy.index] = (value.clone(memory_format=torch.contiguous_format) if copy.contiguous
                               else copy_with_strides(value))
    return tuple(outputs)


def copy_with_strides(value: torch.Tensor) -> torch.Tensor:
    """A copy laid out as `value` is: its sizes and strides, and for a view, a base shaped
    like its base.

    `clone()` makes a view that is not dense (`cat(...)[:, :, 1:]`) contiguous, and a
    caller that keeps it and passes it back (a KV cache) would fail Dynamo's stride
    guards, which eager's view passes; Dynamo also guards on the sizes of such an input's
    `_base`. So a view is copied into a fresh tensor shaped like its base (the graph's
    output buffer, as eager's base is the op's output), of which only the view is
    written. Views whose elements overlap (an `expand`) are cloned.
    """
    if value.numel() == 0 or _overlaps(value):
        return value.clone()
    root = value._base
    if root is not None and root.element_size() == value.element_size() and not _overlaps(root):
        base = torch.empty_strided(root.shape, root.stride(), dtype=value.dtype, device=value.device)
        offset = value.storage_offset() - root.storage_offset()
        return base.as_strided(value.shape, value.stride(), offset).copy_(value)
    span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
    return value.new_empty(span).as_strided(value.shape, value.stride()).copy_(value)


def _overlaps(value: torch.Tensor) -> bool:
    return overlaps(value.shape, value.stride())


@dataclasses.dataclass(frozen=True)
class CallSizing:
    """Where a call's size n is read (dim `dim` of graph input `input_index`) and the
    policy that turns it into the size the pieces run at."""

    input_index: int
    dim: int
    policy: SizePolicy


@dataclasses.dataclass(frozen=True)
class AddressWatch:
    """The graph inputs that are parameters and buffers captured pieces read in place:
    their positions, and names for the log (see `weights.ParameterAddresses`)."""

    name: str  # the graph's, "graph<k>"
    indices: tuple[int, ...]
    names: tuple[str, ...]  # those of `indices`, then one per inner tensor of `wrapped`
    wrapped: tuple[int, ...] = ()  # wrapper subclasses (DTensor shards): their inner tensors are watched


class Stitch:
    """The executor that never declines: the stitch's generated code, calling one runner
    per piece in order.

    runners: one per piece, called by `submodule_name`. guard(stitch, name, call, n,
    size): wraps a graph piece's call at a size with graphs (the runtime's recovery), or
    None. One namespace per (n, size) is kept (at most `_KEPT`), made at its first call.
    """

    kind = "stitch"
    _KEPT = 64

    def __init__(self, stitch: torch.fx.GraphModule, runners: list[PieceRunner], guard: Callable | None = None):
        self.stitch = stitch
        self.runners = {submodule_name(r): r for r in runners}
        self._guard = guard
        self._code = type(stitch).forward  # the generated function; `self` is its first argument
        self._namespaces: dict[tuple[int, int | None], _StitchNamespace] = {}

    def run(self, args: tuple, n: int, size: int | None):
        namespace = self._namespaces.get((n, size))
        if namespace is None:
            if len(self._namespaces) >= self._KEPT:  # n is unbounded where no graph runs
                self._namespaces.clear()
            namespace = self._namespaces[(n, size)] = _StitchNamespace(self.stitch, self.calls(n, size))
        return self._code(namespace, *args)

    def calls(self, n: int, size: int | None) -> dict[str, Callable]:
        """What the stitch calls per piece name on a call of n rows at `size`."""
        calls = {}
        for name, runner in self.runners.items():
            call = runner.at(n, size)
            guarded = self._guard is not None and size is not None and runner.replays_graphs
            calls[name] = self._guard(self, name, call, n, size) if guarded else call
        return calls

    def replace(self, name: str, runner: PieceRunner) -> None:
        """Call `runner` for the piece `name` from the next namespace made on."""
        self.runners[name] = runner

    def without_graphs(self, n: int, size: int) -> None:
        """The rest of a call of (n, size) that is running now runs without graphs: its
        namespace, which the running code holds, is pointed at the runners without graphs;
        every namespace is made anew at its next call. The same for re-splits inside."""
        for runner in self.runners.values():
            if isinstance(runner, SplitPiece):
                runner.inner.without_graphs(n, size)
        running = self._namespaces.get((n, size))
        if running is not None:
            running.bind(self.calls(n, None))
        self._namespaces.clear()

    def leaf_runners(self) -> list[PieceRunner]:
        """Every runner, those of the re-splits inside included."""
        found = []
        for runner in self.runners.values():
            found.extend(runner.inner.leaf_runners() if isinstance(runner, SplitPiece) else [runner])
        return found


class SplitPiece(PieceRunner):
    """A piece split again after its capture failed: its own stitch and runners, run at
    the call's size like the rest (recovery's replacement, see `GraphRuntime._recover`)."""

    def __init__(self, name: str, inner: Stitch):
        super().__init__(name, inner.stitch)
        self.inner = inner

    def at(self, n: int, size: int | None) -> Callable:
        return functools.partial(_run_inner, self.inner, n, size)


def _run_inner(inner: Stitch, n: int, size: int | None, *args):
    return inner.run(args, n, size)


class GraphRuntime:
    """What the backend hands back to Dynamo for one graph: the call's size, then the
    first executor that does not decline (full graph, replay plan, stitch; see the top).

    clone_outputs: graph outputs that are CUDA graph static buffers; they are copied
    before returning so a later call cannot overwrite what the caller holds.
    cudnn_attention: False runs every call with SDPA's cuDNN backend off (see
    `cgcompile.ops`).
    sizing: how a call's size is read and which size its pieces run at (None: a static
    graph, whose pieces always run at the one size they were traced with, 0).
    full: a `full_graph.FullGraph`, one graph for the whole call where allowed.
    fused: a `fused_weights.FusedWeights`, inputs appended to every call.
    scalars: a `device_scalars.DeviceScalarBuffer`, written with the call's host ints and
        appended after them, before any executor runs.
    addresses: the parameters and buffers to watch (None without CUDA graphs); watched
        by `self.addresses`, a `weights.ParameterAddresses`.
    session: the capture session of the graphs (read when moved parameters drop them).
    graph_name: the Dynamo graph's ("graph<k>"), for the replay plans' log.
    recovery: a `recovery.PieceRecovery`: where a graph piece's capture fails, the
        runtime asks it for the piece split again (None: the failure is raised).
    specs: a `parallel.dtensor_guards.ParameterSpecs`, the DTensor parameters' specs,
        checked first at every call (None: the graph has none).

    `step` records the last call's `CallSize` (for tests and inspection; nothing reads
    it to run a call).
    """

    def __init__(
        self,
        stitch: torch.fx.GraphModule,
        runners: list[PieceRunner],
        clone_outputs: tuple[OutputCopy, ...],
        cudnn_attention: bool = False,
        sizing: "CallSizing | None" = None,
        *,
        full: Any = None,
        fused: FusedWeights | None = None,
        scalars: DeviceScalarBuffer | None = None,
        addresses: AddressWatch | None = None,
        session: Any = None,
        graph_name: str = "graph",
        recovery: Recovery | None = None,
        specs: Any = None,
    ):
        self.recovery = recovery
        self.specs = specs
        self.stitch = Stitch(stitch, runners, self._guarded if recovery is not None else None)
        self.clone_outputs = clone_outputs
        self.cudnn_attention = cudnn_attention
        self.sizing = sizing
        self.step = CallSize(0, 0)
        self.full = full
        self.fused = fused
        self.scalars = scalars
        self.session = session
        self.addresses = None if addresses is None else ParameterAddresses(
            addresses.name, addresses.indices, addresses.names, self._recapture, wrapped=addresses.wrapped)
        # Replays through straight-line plans, except where each replay checks addresses
        # (Config.check_addresses: the graph pieces' own replay does that).
        self.plans = None if session is None or session.check_addresses or not any(
            r.replays_graphs for r in runners) else ReplayPlans(self.stitch, session, graph_name)
        self.executors: tuple[Executor, ...] = tuple(e for e in (self.plans, self.stitch) if e is not None)

    @property
    def runners(self) -> list[PieceRunner]:
        """Every piece's runner, those of re-split pieces included."""
        return self.stitch.leaf_runners()

    def _recapture(self) -> None:
        """The parameters moved and settled: drop the graphs that read the old ones."""
        self.drop_all_graphs()  # their memory goes back to the pool, for the recapture
        if not self.session.lazy_capture:
            log.warning("cgcompile: %s dropped its CUDA graphs after its parameters moved; graphs "
                        "captured under a memory budget are not captured lazily: call backend.capture(...) "
                        "again to have them", self.addresses.name)

    def counts(self) -> RunCounts:
        """What this graph's parts counted: its runners, its full graph, its fused weights
        and its parameter watch (the Backend adds up every graph's)."""
        parts = [runner.counts() for runner in self.runners]
        if self.full is not None:
            parts.append(self.full.counts())
        if self.fused is not None:
            parts.append(RunCounts(fused_weight_refreshes=self.fused.refreshes))
        if self.addresses is not None:
            parts.append(RunCounts(calls_with_moved_parameters=self.addresses.calls_without_graphs,
                                   parameter_recaptures=self.addresses.recaptures))
        return total(parts)

    def drop_graphs(self) -> None:
        """Forget every CUDA graph of this graph's pieces; they are captured again lazily."""
        for runner in self.runners:
            if runner.replays_graphs:
                runner.clear()

    def drop_all_graphs(self) -> None:
        """`drop_graphs`, and the full graphs too."""
        self.drop_graphs()
        if self.full is not None:
            self.full.drop_graphs()

    def __call__(self, *args):
        if self.specs is not None:
            self.specs.check(args)
        if self.fused is not None:
            args = self.fused.extend(args)
        if self.scalars is not None:
            args = self.scalars.extend(args)
        graphs = self.addresses is None or self.addresses.allow(args)
        if self.sizing is None:
            n, size = 0, 0  # a static graph: its one size
        else:
            n = args[self.sizing.input_index].shape[self.sizing.dim]
            size = self.sizing.policy.size_for(n)
        self.step = CallSize(n, size if graphs else None)
        return self._run(args, n, size, graphs)

    def _run(self, args: tuple, n: int, size: int | None, graphs: bool):
        if self.full is not None:
            outputs = self.full.run(args, n, size) if graphs else self.full.moved(args, n, size)
            if outputs is not None:
                return outputs
        if not graphs:
            size = None  # the pieces run without their graphs
        for executor in self.executors:  # the stitch never declines
            outputs = (executor.run(args, n, size) if self.cudnn_attention
                       else call_without_cudnn_attention(executor.run, args, n, size))
            if outputs is not None:
                break
        return copy_out(outputs, self.clone_outputs) if self.clone_outputs else outputs

    # -- capture recovery -----------------------------------------------------------------

    def _guarded(self, owner: Stitch, name: str, call: Callable, n: int, size: int) -> Callable:
        """`call` (a graph piece's, at a size with graphs), with its capture failure
        recovered here: one more Python frame per graph piece on the stitch's path, none
        on a replay plan's (it launches the graphs itself)."""
        def guarded(*args):
            try:
                return call(*args)
            except PieceCaptureFailed as failed:
                return self._recover(owner, name, failed, n, size)
        return guarded

    def _recover(self, owner: Stitch, name: str, failed: PieceCaptureFailed, n: int, size: int):
        """Swap the failed piece for its re-split, then finish this call without graphs.

        Graphs of this runtime captured in earlier calls or earlier in this one are
        dropped, and the rest of this call runs without graphs: all graphs of one size
        must be captured in one call for the pool's memory sharing to hold (see
        `capture.CaptureSession`).
        """
        resplit = self.recovery.resplit(failed)
        self.drop_graphs()
        replacement = resplit.runners[0] if resplit.stitch is None else SplitPiece(
            failed.piece.piece_name, Stitch(resplit.stitch, list(resplit.runners), self._guarded))
        owner.replace(name, replacement)
        self.stitch.without_graphs(n, size)
        if self.session is not None:
            self.session.graphs_changed()  # replay plans bound the old runner
        return replacement.at(n, None)(*failed.inputs)
