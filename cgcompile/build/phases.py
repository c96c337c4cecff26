"""The compile steps of one Dynamo graph, in the order `Backend.__call__` runs them.

Each step is a function that returns a record of what it decided; none of them reaches
back into the Backend. What they need of its state (the compile cache, the capture
session, the fused weights, the ops a capture failed on) is handed to them.
Capture recovery (`recovery.PieceRecovery`, which `piece_recovery` builds and the graph's
runtime holds) runs `build_runners` again on a piece's re-split when the runtime asks
it, so a piece cut after a failed capture is built as the first compile built it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import torch

from ..run.buffers import SizePolicy, TracedLayout
from ..run.capture import CaptureSession
from ..compat import is_static_address
from .compiler import EagerPieceCompiles, FullGraphCode, PieceCompiler, describe_input
from ..config import AUTO, Config, FullGraphOptions
from ..errors import ConfigError
from ..run.device_scalars import DeviceScalarBuffer
from ..run.full_graph import FullGraph, plain_function
from ..run.graph_piece import CompiledPiece, CudaGraphPiece, PaddedPiece, piece_layout
from ..parallel.dtensor_guards import ParameterSpecs, drop_checked_spec_guards, parameter_specs
from ..parallel.fast_all_reduce import route_graph_all_reduces
from ..passes import (
    CaptureDim,
    FullGraphPlan,
    SplitGraph,
    classify_nodes,
    example_value,
    find_capture_dim,
    find_padding_hazards,
    find_state_hazards,
    free_symbols,
    fold_grouped_query_attention,
    fuse_sibling_linears,
    hoist_host_constants,
    hoist_mask_conversion,
    input_name,
    plan_full_graph,
    read_scalars_from_device,
    split_graph,
    values_sharing_memory,
    written_inputs,
)
from ..passes.graph_values import contiguous_strides
from ..run.recovery import PieceRecovery, UncapturableOps
from ..run.runtime import AddressWatch, CallSizing, OutputCopy, PieceRunner
from ..stats import Piece, PieceRecords
from ..run.fused_weights import FusedWeights, FusedWeightStore
from ..run.weights import has_address, storage_tensors

log = logging.getLogger(__name__)


# -- records ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fusion:
    """Config.fuse_sibling_linears: the rewritten graph, its inputs with the fused weights
    appended (None: nothing fused), and how many linears were fused away."""

    gm: torch.fx.GraphModule
    example_inputs: list
    weights: FusedWeights | None = None
    linears: int = 0


@dataclasses.dataclass(frozen=True)
class GraphAnalysis:
    """What the backend learned about one Dynamo graph before splitting it."""

    capture_dim: CaptureDim | None
    capture_index: int | None  # position of the capture dimension's input among the graph's inputs
    static_inputs: frozenset[str]  # placeholder names of inputs read at their own address: parameters, buffers, state
    device: torch.device  # the accelerator the graph runs on, or cpu
    cudagraphs: bool
    uncaptured: str | None = None  # why a graph that could have CUDA graphs has none (autograd)

    @property
    def symbol(self):
        return self.capture_dim.symbol if self.capture_dim else None


@dataclasses.dataclass(frozen=True)
class ScalarInputs:
    """Host ints the graph reads from a device buffer (`passes.device_scalars`): the
    rewritten graph, the analysis with the buffer among the static inputs, the example
    inputs with it appended, and the buffer (None: nothing read so, all unchanged)."""

    gm: torch.fx.GraphModule
    analysis: GraphAnalysis
    example_inputs: list
    buffer: DeviceScalarBuffer | None = None

    @property
    def inputs(self) -> tuple[int, ...]:
        """The SymInt inputs read from the buffer."""
        return () if self.buffer is None else self.buffer.inputs


@dataclasses.dataclass(frozen=True)
class GraphSizing:
    """How one graph's pieces are sized: padded to capture sizes, or at the exact size.

    hazards: per capturable piece name, why padding could change its results (the
    padding-safety pass); one hazard anywhere makes the whole graph run at exact sizes.
    why: the sentence recorded for the graph's pieces and the dump.
    """

    padded: bool
    hazards: dict[str, tuple]
    why: str


@dataclasses.dataclass(frozen=True)
class GraphBuild:
    """What the steps after sizing share for one graph; building the runners of a piece's
    re-split (capture recovery) needs the same."""

    index: int  # the graph's number in its Backend
    analysis: GraphAnalysis
    sizing: GraphSizing
    compiler: PieceCompiler
    config: Config


@dataclasses.dataclass(frozen=True)
class Runners:
    """One runner and one `Piece` record per piece of a split, in order."""

    graph_index: int
    runners: tuple[PieceRunner, ...]
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class FullGraphChoice:
    """The full path of a graph (None: piecewise only), the line the dump records (None
    when no split op is declared capturable), and how it was chosen (the case
    `BackendStats.full_graph_choices` counts graphs by)."""

    graph: FullGraph | None
    summary: str | None
    choice: str


# -- the steps -------------------------------------------------------------------------


def fuse_linears(index: int, gm: torch.fx.GraphModule, example_inputs: list, config: Config,
                 store: FusedWeightStore) -> Fusion:
    """Config.fuse_sibling_linears: rewrite sibling linears over parameters; the fused
    weights become new graph inputs, appended to every call's (see `fused_weights.FusedWeights`)."""
    mode = config.rewrites.fuse_sibling_linears
    if mode is False:
        return Fusion(gm, example_inputs)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    # Left out: inference tensors, which have no version counter (a later update could
    # not be seen), and parameters autograd will differentiate (the copies would take
    # their gradients). Dynamo guards on grad mode, so a call with grad on recompiles.
    training = torch.is_grad_enabled()
    # The default (None) fuses on CUDA only, where decode-size products pay for their launches.
    params = {name: x for name, x in zip(placeholders, example_inputs)
              if isinstance(x, torch.nn.Parameter) and not x.is_inference() and not (training and x.requires_grad)
              and (mode is True or x.is_cuda)}
    gm, fused = fuse_sibling_linears(gm, params, store)
    if not fused:
        return Fusion(gm, example_inputs)
    for f in fused:
        torch._dynamo.mark_static_address(f.tensor, guard=False)
    weights = FusedWeights(fused, {name: i for i, name in enumerate(placeholders)}, example_inputs)
    log.info("cgcompile: graph %d fused %d groups of sibling linears (the backend's fused weights: %d shared with "
             "their parameters, copies of %.1f MB)", index, sum(f.kind == "weight" for f in fused), store.shared,
             store.bytes / 2**20)
    linears = sum(len(f.sources) for f in fused if f.kind == "weight")
    return Fusion(gm, [*example_inputs, *weights.tensors], weights, linears)


def analyse(gm: torch.fx.GraphModule, example_inputs: list, config: Config) -> GraphAnalysis:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = frozenset(n.name for n, x in zip(placeholders, example_inputs) if is_static_address(x))
    try:
        capture_dim = find_capture_dim(gm, static, config.sizes.capture_input, config.sizes.capture_input_dim)
    except LookupError as e:
        raise ConfigError(f"capture_input: {e}") from e
    device = _graph_device(gm)
    on_device = CaptureSession.graphs.runs_on(device)
    cudagraphs = on_device if config.graphs.cudagraphs is None else config.graphs.cudagraphs
    if cudagraphs and not on_device:
        raise ConfigError(
            f"cudagraphs=True: expected the graph's tensors on a CUDA device, got {device}; "
            f"move the model and inputs to CUDA or leave cudagraphs=None"
        )
    if cudagraphs:
        static |= state_written_in_place(gm, example_inputs, device, capture_dim)
    if device.type == "cpu" and config.compile.compiler == "inductor":
        _hint_eager_on_cpu()
    index = None
    if capture_dim is not None:
        index = next(i for i, n in enumerate(placeholders) if input_name(n) == capture_dim.input_name)
    return GraphAnalysis(capture_dim, index, static, device, cudagraphs)


def state_written_in_place(gm: torch.fx.GraphModule, example_inputs: list, device: torch.device,
                           capture_dim: CaptureDim | None) -> frozenset[str]:
    """Graph inputs the graph writes in place that are read and written at their own address,
    as parameters and buffers are: plain tensors on the graph's accelerator, of fixed shape,
    that autograd does not track, other than the capture input. A KV cache that was not marked static (transformers'
    StaticCache marks its tensors only when made outside a compile, so not when the compiled
    forward runs the prefill) is such an input: its writes then go into the captured piece
    before attention, fused with the rotary embedding, where a copied input would have kept
    them eager (the graph would write into its copy). The address watch
    (`weights.ParameterAddresses`) covers them as it covers parameters: a call with the
    tensor elsewhere runs without graphs, and the graphs are captured again once it stays."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    capture_input = capture_dim.input_name if capture_dim is not None else None
    chosen = set()
    for i in written_inputs(gm):
        node, x, traced = placeholders[i], example_inputs[i], example_value(placeholders[i])
        if (type(x) is torch.Tensor and x.device == device and not x.requires_grad
                and input_name(node) != capture_input and isinstance(traced, torch.Tensor)
                and not free_symbols(traced)):
            chosen.add(node.name)
    return frozenset(chosen)


# Why a graph that needs gradients runs without CUDA graphs (`without_graphs_for_autograd`).
NEEDS_GRADIENTS = ("needs gradients: autograd saves tensors that a CUDA graph replay would overwrite; "
                   "its pieces run compiled, without CUDA graphs")


def without_graphs_for_autograd(index: int, analysis: GraphAnalysis, example_inputs: list) -> GraphAnalysis:
    """The analysis with CUDA graphs off where the graph's calls build an autograd graph.

    A backward reads what autograd saved in the forward: the inputs of a cross-entropy
    (its labels), activations, the ids of an embedding. Under CUDA graphs those are the
    static input buffers and the pool memory of a graph's outputs, which the next call's
    copy or any later replay overwrites before the backward runs. Without graphs every
    piece is still compiled (Inductor through AOTAutograd, with its own backward) and
    autograd saves tensors that belong to the call.

    Why deciding on the example inputs is enough: Dynamo guards the grad mode and each
    tensor input's requires_grad, so a call that differs in either (`torch.no_grad()`,
    `inference_mode`, frozen parameters) runs another graph, compiled for it: inference
    still captures.
    """
    if not analysis.cudagraphs or not _needs_gradients(example_inputs):
        return analysis
    log.info("cgcompile: graph %d runs without CUDA graphs: %s", index, NEEDS_GRADIENTS)
    _warn_uncaptured_for_autograd()
    return dataclasses.replace(analysis, cudagraphs=False, uncaptured=NEEDS_GRADIENTS)


def _needs_gradients(example_inputs: list) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


@functools.cache
def _warn_uncaptured_for_autograd() -> None:
    """Once per process: training runs slower than inference would under graphs."""
    log.warning("cgcompile: a graph compiled with gradients enabled runs without CUDA graphs (%s). Inference "
                "under torch.no_grad() or torch.inference_mode() compiles its own graph, with CUDA graphs",
                NEEDS_GRADIENTS)


def scalars_from_device(index: int, gm: torch.fx.GraphModule, example_inputs: list, analysis: GraphAnalysis,
                        config: Config) -> ScalarInputs:
    """Host ints used only as values of tensor ops, read from a device buffer that the
    runtime writes before every call, where graphs are captured or a full graph may be
    planned: there a captured graph would replay the value of its capture (and a full
    graph's key would hold it). Elsewhere every op reads the call's int anyway."""
    if not (analysis.cudagraphs or config.full_graph_for(False) is not None):
        return ScalarInputs(gm, analysis, example_inputs)
    gm, found = read_scalars_from_device(gm)
    for name, why in found.kept:
        log.debug("cgcompile: graph %d keeps %s a host value (a full graph checks it per call): %s", index, name, why)
    if not found.inputs:
        return ScalarInputs(gm, analysis, example_inputs)
    values = _static_buffer(len(found.inputs), found.device)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    log.info("cgcompile: graph %d reads %d host ints from a device buffer written before every call: %s", index,
             len(found.inputs), [names[i] for i in found.inputs])
    analysis = dataclasses.replace(analysis, static_inputs=analysis.static_inputs | {names[-1]})  # the buffer, last
    return ScalarInputs(gm, analysis, [*example_inputs, values], DeviceScalarBuffer(found, gm, values))


def _static_buffer(k: int, device: torch.device) -> torch.Tensor:
    """A real [k] int64 tensor (even under a fake mode), a normal one even under
    inference mode (the runtime writes it in calls outside it), at a static address."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.inference_mode(False):
        values = torch.zeros(k, dtype=torch.int64, device=device)
    torch._dynamo.mark_static_address(values, guard=False)
    return values


def _build_real(fn, args, kwargs) -> torch.Tensor:
    """A constant for `hoist_host_constants`: a real tensor, even under a fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return fn(*args, **kwargs)


def split_pieces(gm: torch.fx.GraphModule, analysis: GraphAnalysis, config: Config,
                 uncapturable: UncapturableOps) -> SplitGraph:
    # Rewrites before classifying: their new nodes are classified like any other.
    hoist_mask_conversion(gm)
    if analysis.device.type == "cuda":
        # Literal host data: copied to the device once, not per call.
        made = hoist_host_constants(gm, _build_real)
        if made:
            log.info("cgcompile: %d tensors of literal host data made once, as constants of the graph", made)
        # Each all-reduce gets its group's path (docs/parallel.md).
        route_graph_all_reduces(gm, analysis.device, configured=config.rewrites.all_reduce)
    if config.rewrites.fold_grouped_query:
        fold_grouped_query_attention(gm)
    mutable = frozenset(
        n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name not in analysis.static_inputs
    )
    eager = classify_nodes(
        gm,
        op_reason=functools.partial(_split_reason, config, uncapturable),
        capture_symbol=analysis.symbol,
        on_accelerator=analysis.device.type != "cpu",
        mutable_inputs=mutable,
    )
    return split_graph(gm, eager)


def _split_reason(config: Config, uncapturable: UncapturableOps, target) -> str | None:
    """Why an op is split: Config's split ops, then ops whose capture failed before."""
    reason = config.split_ops.reason(target)
    return uncapturable.reason(target) if reason is None else reason


def choose_sizing(split: SplitGraph, analysis: GraphAnalysis, config: Config) -> GraphSizing:
    symbol = analysis.symbol
    hazards = {
        spec.name: (*find_padding_hazards(spec.graph, symbol).values(),
                    *find_state_hazards(spec.inputs, symbol, analysis.static_inputs))
        for spec in split.pieces if spec.capturable
    }
    hazards = {name: h for name, h in hazards.items() if h}
    if symbol is None:
        return GraphSizing(False, hazards, "static: the graph has no capture dimension")
    if hazards:
        first = next(iter(hazards))
        return GraphSizing(False, hazards, f"exact sizes: {first} is unsafe to pad ({hazards[first][0]})")
    if not config.pads(analysis.cudagraphs):
        return GraphSizing(False, hazards, "exact sizes: padding is off (Config.padding)")
    return GraphSizing(True, hazards, "padded to the capture sizes")


def build_runners(build: GraphBuild, split: SplitGraph, session: CaptureSession, *,
                  resplit: bool = False) -> Runners:
    """resplit: `split` cuts one piece (recovery); its own inputs come from other pieces
    of the graph too, so every input is handed over in the traced layout."""
    piece_outputs = {out for spec in split.pieces for out in spec.outputs}
    runners, pieces = [], []
    for spec in split.pieces:
        piece = _record_piece(build.index, spec, build.sizing, build.analysis.uncaptured)
        pieces.append(piece)
        if not spec.capturable:
            runners.append(PieceRunner(piece.name, spec.graph))
            continue
        fn = build.compiler.compile(spec, build.analysis.symbol)
        from_pieces = tuple(i for i, node in enumerate(spec.inputs)
                            if node in piece_outputs or (resplit and node.op == "placeholder"))
        runners.append(_make_runner(build, piece, spec, fn, session, from_pieces))
    return Runners(build.index, tuple(runners), tuple(pieces))


def _make_runner(build: GraphBuild, piece: Piece, spec, fn, session: CaptureSession,
                 from_pieces: tuple[int, ...]) -> PieceRunner:
    symbol, sizing = build.analysis.symbol, build.sizing
    # Inputs made by other pieces: an eager op's kernel, and Inductor too (a cat with
    # an empty operand keeps the other's layout), may return another layout than traced.
    checked = from_pieces if build.config.compile.compiler == "inductor" else ()
    traced = TracedLayout([example_value(n) for n in spec.inputs], symbol, checked)
    graphs = build.analysis.cudagraphs
    if not (graphs or sizing.padded):
        return CompiledPiece(piece.name, fn, traced)
    layout = piece_layout(spec, symbol if sizing.padded else None, build.analysis.static_inputs)
    if isinstance(layout, str):
        # The padding-safety pass rejects every piece whose layout cannot be padded.
        raise AssertionError(f"{piece.name}: padded, but {layout}")
    if not graphs:
        return PaddedPiece(piece.name, fn, layout, traced)
    return CudaGraphPiece(piece.name, fn, layout, session, traced)


def _record_piece(graph_index: int, spec, sizing: GraphSizing, uncaptured: str | None) -> Piece:
    reason = "; ".join(str(r) for r in spec.reasons) if not spec.capturable else None
    hazards = sizing.hazards.get(spec.name)
    padding = "; ".join(map(str, hazards)) if hazards else None
    shapes = tuple(describe_input(example_value(n)) for n in spec.inputs)
    return Piece(
        f"graph{graph_index}.{spec.name}", graph_index, spec.capturable, reason, spec.graph, shapes,
        padding_unsafe=padding, sizes=sizing.why, uncaptured=uncaptured if spec.capturable else None,
    )


# How a graph's full path was chosen, as `BackendStats.full_graph_choices` counts graphs.
CHOSEN_AUTOMATICALLY = "automatic: CUDA graphs are on"
CHOSEN_BY_CONFIG = "configured: Config.full_graph"
NO_PLAN = "none: the graph cannot have one"
OFF_BY_CONFIG = "off: full_graph=None"
OFF_WITHOUT_GRAPHS = "off: automatic, and the graph has no CUDA graphs"
OFF_ONE_PIECE = "off: automatic, and the graph has no eager piece (piecewise is one CUDA graph)"
_AUTOMATIC_NOTE = ' (chosen automatically: full_graph="auto", the default with CUDA graphs; full_graph=None for piecewise only)'


def full_graph(build: GraphBuild, gm: torch.fx.GraphModule, split: SplitGraph, runners: Runners,
               session: CaptureSession, eager_compiles: EagerPieceCompiles,
               scalars: ScalarInputs | None = None) -> FullGraphChoice:
    """A full path where the graph's full-graph options (`Config.full_graph_for`) allow one.

    The automatic default leaves out graphs with no eager piece: their piecewise run is
    one CUDA graph already, and a full graph would only add a capture and a per-call check."""
    automatic = build.config.full_graph == AUTO
    options = build.config.full_graph_for(build.analysis.cudagraphs)
    if options is None or (automatic and all(spec.capturable for spec in split.pieces)):
        off = OFF_BY_CONFIG if not automatic else OFF_WITHOUT_GRAPHS if options is None else OFF_ONE_PIECE
        return FullGraphChoice(None, None, off)
    note = _AUTOMATIC_NOTE if automatic else ""
    plan = plan_full_graph(gm, split, build.analysis.static_inputs, build.analysis.symbol,
                           options.capturable_ops.covers, scalars.inputs if scalars else ())
    if isinstance(plan, str):
        log.info("cgcompile: graph %d has no full graph: %s", build.index, plan)
        return FullGraphChoice(None, f"piecewise only: {plan}{note}", NO_PLAN)
    buffer = scalars.buffer if scalars else None
    graph = _make_full_graph(build, gm, split, runners, session, eager_compiles, options, plan, buffer)
    return FullGraphChoice(graph, _full_graph_summary(plan, options, build.config) + note,
                           CHOSEN_AUTOMATICALLY if automatic else CHOSEN_BY_CONFIG)


def _full_graph_summary(plan: FullGraphPlan, options: FullGraphOptions, config: Config) -> str:
    checked = [plan.names[i] for i in plan.by_address] + [plan.names[i] for i, _ in plan.host_values]
    runs = "the whole graph compiled as one per size" if options.full_graph_compile else "the pieces' code in order"
    if options.small_query_attention:
        runs += ", attention of few query rows compiled as batched matmuls"
        if config.compile.decode_attention_kernel:
            runs += " or run by the decode attention kernel where its operands suit it"
    written = [plan.names[i] for i in plan.device_scalars]
    read = f"; it reads these from a device buffer written per call: {written}" if written else ""
    return f"full graph per call where these match the capture: {checked or 'nothing'}; it runs {runs}{read}"


def _make_full_graph(build: GraphBuild, gm: torch.fx.GraphModule, split: SplitGraph, runners: Runners,
                     session: CaptureSession, eager_compiles: EagerPieceCompiles,
                     options: FullGraphOptions, plan: FullGraphPlan,
                     scalars: DeviceScalarBuffer | None) -> FullGraph:
    config = build.config
    values = _output_values(gm)
    copies = () if config.graphs.reuse_output_buffers else tuple(
        OutputCopy(i, _statically_contiguous(example_value(v)))
        for i, v in enumerate(values) if isinstance(example_value(v), torch.Tensor)
    )
    name = f"graph{build.index}"
    whole = options.full_graph_compile  # Inductor, whatever compiles the pieces
    # Also the fallback of a whole-graph compile that fails: compiles only if it runs.
    eager = eager_compiles if options.small_query_attention else None
    dim = build.analysis.capture_dim
    n_at = None if dim is None else (build.analysis.capture_index, dim.dim)  # where a call's n is read
    pieces = plain_function(split.stitch, runners.runners, n_at, config.split.cudnn_attention, eager)
    code = FullGraphCode(name, pieces, gm if whole else None, config.compile.inductor_patches(),
                         config.split.cudnn_attention, options.small_query_attention,
                         config.compile.decode_attention_kernel)
    return FullGraph(name, plan, code, session, copies, cudagraphs=build.analysis.cudagraphs, scalars=scalars)


def outputs_to_clone(gm: torch.fx.GraphModule, split: SplitGraph, runners: Runners,
                     config: Config) -> tuple[OutputCopy, ...]:
    """Graph outputs that share memory with a CUDA graph's output: copied on return.

    Not only the graph pieces' own outputs: a view of one, made by a later eager piece,
    is pool memory too. Whatever the caller keeps of such an output (a KV cache that
    keeps `cat(...)[:, :, 1:]`, a sliding window's) must outlive the replay: after it,
    runners hold only non-owning aliases of their outputs, and graphs of other sizes or
    other Dynamo graphs, captured into the memory the pool thinks free, write over it.
    """
    if config.graphs.reuse_output_buffers:
        return ()
    from_graphs = [
        out for spec, runner in zip(split.pieces, runners.runners) if isinstance(runner, CudaGraphPiece)
        for out in spec.outputs
    ]
    values = _output_values(gm)
    # A view of a graph input that a piece also returns views the caller's own tensor.
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(
        OutputCopy(i, _statically_contiguous(example_value(values[i])))
        for i in values_sharing_memory(values, from_graphs, exclude=inputs)
    )


def call_sizing(build: GraphBuild, session: CaptureSession) -> CallSizing | None:
    analysis = build.analysis
    if analysis.capture_dim is None:
        return None
    policy = SizePolicy(
        session.padding, exact=not build.sizing.padded, limit=build.config.sizes.exact_size_limit,
        name=f"graph{build.index}",
    )
    return CallSizing(analysis.capture_index, analysis.capture_dim.dim, policy)


def address_watch(build: GraphBuild, gm: torch.fx.GraphModule, split: SplitGraph,
                  fusion: Fusion, scalars: ScalarInputs) -> AddressWatch | None:
    """The parameters and buffers captured pieces read in place (never copied, see
    `graph_piece`), checked at every call (`weights.ParameterAddresses`); None without
    CUDA graphs or with Config.check_addresses (which raises instead). Those only eager
    pieces read need no check: eager code reads the call's own; a full graph checks them
    itself (`FullGraphPlan.by_address`). Left out too: the backend's own fused weights
    (they keep their addresses, see `fused_weights.FusedWeights`) and device-scalar
    buffer (`scalars`: the inputs are its example inputs). A wrapper subclass (a DTensor
    shard, quantized weights) has no address of its own: the tensors it wraps are watched."""
    if not build.analysis.cudagraphs or build.config.debug.check_addresses:
        return None
    read = {n.name for spec in split.pieces if spec.capturable for n in spec.inputs if n.op == "placeholder"}
    owned = {id(t) for t in fusion.weights.tensors} if fusion.weights is not None else set()  # never move
    if scalars.buffer is not None:
        owned.add(id(scalars.buffer.values))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = scalars.example_inputs
    watched = [i for i, name in enumerate(names)
               if name in build.analysis.static_inputs and name in read and id(inputs[i]) not in owned]
    indices = [i for i in watched if has_address(inputs[i])]
    inner = {i: [name for name, _ in storage_tensors(inputs[i], names[i])] for i in watched if i not in indices}
    wrapped = [i for i, found in inner.items() if found]
    if not indices and not wrapped:
        return None
    inner_names = [name for i in wrapped for name in inner[i]]
    return AddressWatch(f"graph{build.index}", tuple(indices), tuple(names[i] for i in indices) + tuple(inner_names),
                        tuple(wrapped))


def dtensor_specs(build: GraphBuild, gm: torch.fx.GraphModule, example_inputs: list,
                  sources: list) -> ParameterSpecs | None:
    """The specs of the graph's DTensor parameters, checked at every call; None without any.
    Under Config.dtensor_spec_guards="cgcompile" Dynamo's spec guards of those parameters
    are dropped from the frame (`parallel.dtensor_guards`). `sources`: each input's Dynamo
    source, read before any rewrite."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    specs = parameter_specs(f"graph{build.index}", names, example_inputs)
    if specs is not None and build.config.rewrites.dtensor_spec_guards == "cgcompile":
        dropped = drop_checked_spec_guards(specs, sources)
        log.debug("graph%d: %d of Dynamo's DTensor spec guards dropped, %d parameters checked at every call",
                  build.index, dropped, len(specs.indices))
        if dropped == 0:  # under Dynamo, yet nothing found to drop
            _warn_spec_guards_kept()
    return specs


def piece_recovery(build: GraphBuild, split: SplitGraph, records: PieceRecords,
                   uncapturable: UncapturableOps) -> PieceRecovery | None:
    """What the graph's runtime asks to split a piece again where its capture fails
    (graph pieces only): the runners of a re-split are built by `build_runners`, as the
    first ones were."""
    if not build.analysis.cudagraphs:
        return None
    rebuild: Callable = functools.partial(build_runners, build, resplit=True)
    return PieceRecovery(split, rebuild, records, uncapturable)


# -- helpers ---------------------------------------------------------------------------


def _output_values(gm: torch.fx.GraphModule) -> list:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]


def _statically_contiguous(value) -> bool:
    """True when eager's result is contiguous with sizes and strides that are plain ints."""
    if not isinstance(value, torch.Tensor):
        return False
    sizes, strides = value.shape, value.stride()
    return all(type(x) is int for x in (*sizes, *strides)) and contiguous_strides(sizes, strides)


@functools.cache
def _warn_spec_guards_kept() -> None:
    """Once per process: the spec guards could not be taken out (this torch keeps or names a
    frame's guards otherwise than cgcompile expects), so both Dynamo and cgcompile check the
    specs."""
    log.warning("cgcompile: Dynamo's DTensor spec guards of a graph's parameters could not be dropped on this "
                "torch, so Dynamo keeps checking them at every call (correct, more host time per call). "
                "Config(dtensor_spec_guards='dynamo') silences this.")


@functools.cache
def _hint_eager_on_cpu() -> None:
    """Once per process: on CPU there are no CUDA graphs, and Inductor's compile is most of
    the warm-up (55 s against 7 s with compiler="eager" for a 2-layer tiny Llama)."""
    log.warning("cgcompile: a graph on CPU with Inductor pieces (the default, compiler='inductor'). CPU has no "
                "CUDA graphs, and compiler='eager' warms up several times faster there: pass "
                "options={'compiler': 'eager'} to torch.compile, or cgcompile.Config(compiler='eager')")


def _graph_device(gm: torch.fx.GraphModule) -> torch.device:
    """The first non-CPU device any tensor of the graph lives on, else cpu."""
    for node in gm.graph.nodes:
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device
    return torch.device("cpu")
