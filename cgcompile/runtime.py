"""Run a split graph: the stitching module calls one runner per piece, in order."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from .buffers import overlaps
from .buffers import SizePolicy, StepSize
from .capture import Mode
from .ops import call_without_cudnn_attention
from .replay_plan import ReplayPlans
from .weights import FusedWeights, ParameterAddresses

log = logging.getLogger(__name__)


class PieceRunner(torch.nn.Module):
    """Runs one piece: its FX code (eager pieces, compiler="eager") or a compiled function."""

    def __init__(self, name: str, fn: Callable):
        super().__init__()
        self.piece_name = name
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)

    @property
    def step_fn(self) -> Callable:
        """What the runtime calls every step: the piece's code itself, without the layers
        of nn.Module.__call__ (hook checks) around this runner and around an FX piece."""
        return self.fn.forward if isinstance(self.fn, torch.fx.GraphModule) else self.fn


class _StitchNamespace:
    """The `self` the stitch's generated forward runs with on the hot path.

    The generated code reaches each piece as `self.submod_<k>(...)`. On the GraphModule
    that is nn.Module.__getattr__ and then nn.Module.__call__ per piece and per step;
    here it is a plain attribute holding the runner's `step_fn`. Anything else the code
    reads (get_attr constants) comes from the stitch itself.
    """

    def __init__(self, stitch: torch.fx.GraphModule, calls: dict[str, Callable]):
        self._stitch = stitch
        self.__dict__.update(calls)

    def __getattr__(self, name: str):
        return getattr(self._stitch, name)


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
    names: tuple[str, ...]


class GraphRuntime:
    """What the backend hands back to Dynamo for one graph: the stitch with its runners.

    The runners are registered on the stitch (so it prints and dumps with them); each
    step runs the stitch's code against a `_StitchNamespace` instead (see there).

    clone_outputs: graph outputs that are CUDA graph static buffers; they are copied
    before returning so a later call cannot overwrite what the caller holds.
    cudnn_attention: False runs every call with SDPA's cuDNN backend off (see
    `cgcompile.ops`).
    sizing: how a call's size is read and which size its pieces run at (None: a static
    graph, whose pieces always run at the one size they were traced with).
    full: a `full_graph.FullGraph`, one graph for the whole call where allowed.
    fused: a `weights.FusedWeights`, inputs appended to every call.
    addresses: the parameters and buffers to watch (None without CUDA graphs); watched
        by `self.addresses`, a `weights.ParameterAddresses`.
    session: the capture session of the graphs (read when moved parameters drop them).
    graph_name: the Dynamo graph's ("graph<k>"), for the replay plans' log.
    recovery: a `recovery.PieceRecovery`, which the graph pieces call when their
        capture fails.
    """

    def __init__(
        self,
        stitch: torch.fx.GraphModule,
        runners: list[PieceRunner],
        clone_outputs: tuple[OutputCopy, ...],
        cudnn_attention: bool = False,
        sizing: "CallSizing | None" = None,
        step: StepSize | None = None,
        *,
        full: Any = None,
        fused: FusedWeights | None = None,
        addresses: AddressWatch | None = None,
        session: Any = None,
        graph_name: str = "graph",
        recovery: Any = None,
    ):
        calls = {}
        for runner in runners:
            name = runner.piece_name.rsplit(".", 1)[-1]
            setattr(stitch, name, runner)
            calls[name] = runner.step_fn
        self.stitch = stitch
        self.runners = runners
        self.clone_outputs = clone_outputs
        self._namespace = _StitchNamespace(stitch, calls)
        self._code = type(stitch).forward  # the generated function; `self` is its first argument
        self.cudnn_attention = cudnn_attention
        self.sizing = sizing
        self.step = step or StepSize()
        self.full = full
        self.fused = fused
        self.session = session
        self.addresses = None if addresses is None else ParameterAddresses(
            addresses.name, addresses.indices, addresses.names, self._recapture)
        # Replays through straight-line plans, except where each replay checks addresses
        # (Config.check_addresses: the graph pieces' own replay does that).
        self.plans = None if session is None or session.check_addresses or not any(
            hasattr(r, "captured_graph") for r in runners) else ReplayPlans(
                stitch, vars(self._namespace), session, graph_name)
        if recovery is not None:
            recovery.arm(self)

    def _recapture(self) -> None:
        """The parameters moved and settled: drop the graphs that read the old ones."""
        self.drop_all_graphs()  # their memory goes back to the pool, for the recapture
        if not self.session.lazy_capture:
            log.warning("cgcompile: %s dropped its CUDA graphs after its parameters moved; graphs "
                        "captured under a memory budget are not captured lazily: call backend.capture(...) "
                        "again to have them", self.addresses.name)

    def replace_runner(self, old: PieceRunner, new: Callable, new_runners: list) -> None:
        """Call `new` where `old` was called (recovery after a failed capture)."""
        name = old.piece_name.rsplit(".", 1)[-1]
        setattr(self._namespace, name, new)
        if self.session is not None:
            self.session.graphs_changed()  # replay plans bound the old runner
        self.runners = [r for r in self.runners if r is not old] + list(new_runners)

    def drop_graphs(self) -> None:
        """Forget every CUDA graph of this graph's pieces; they are captured again lazily."""
        for runner in self.runners:
            clear = getattr(runner, "clear", None)
            if clear is not None:
                clear()

    def drop_all_graphs(self) -> None:
        """`drop_graphs`, and the full graphs too."""
        self.drop_graphs()
        if self.full is not None:
            self.full.clear()

    def __call__(self, *args):
        if self.fused is not None:
            args = self.fused.extend(args)
        graphs = self.addresses is None or self.addresses.allow(args)
        if self.sizing is not None:
            n = args[self.sizing.input_index].shape[self.sizing.dim]
            self.step.n, self.step.size = n, self.sizing.policy.size_for(n) if graphs else None
        elif not graphs:  # a static graph: its one size stays set for later calls
            size, self.step.size = self.step.size, None
            try:
                return self._run(args, graphs)
            finally:
                self.step.size = size
        return self._run(args, graphs)

    def _run(self, args: tuple, graphs: bool):
        if self.full is not None:
            outputs = self.full.run(args, self.step.n, self.step.size) if graphs else self.full.skip(
                "its parameters are not where its graphs read them")
            if outputs is not None:
                return outputs
        plan = self._plan()
        if plan is not None:
            outputs = plan(args) if self.cudnn_attention else call_without_cudnn_attention(plan, args)
        elif self.cudnn_attention:
            outputs = self._code(self._namespace, *args)
        else:
            outputs = call_without_cudnn_attention(self._code, self._namespace, *args)
        return copy_out(outputs, self.clone_outputs) if self.clone_outputs else outputs

    def _plan(self):
        """The replay plan of this call's size, when every graph piece has its graph."""
        size = self.step.size
        if self.plans is None or size is None or self.session.mode is not Mode.LAZY:
            return None
        return self.plans.get(self.step.n, size)
