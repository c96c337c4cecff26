"""The `cgcompile` torch.compile backend: split, compile the capturable pieces, wire a runtime.

`Backend.__call__` is what Dynamo calls with each graph it captures; it reads as the
steps it takes. Everything it decides is recorded in `stats` and `pieces`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from typing import Any, Callable

import torch

from . import dump
from .buffers import SizePolicy, StepSize, TracedLayout
from .compat import is_static_address, torch_compile_call_of, torch_compile_call_on_stack
from .config import Config, as_config
from .errors import ArgumentError, CaptureError, ConfigError, StateError, expect, expected
from .full_graph import FullGraph, plain_function
from .weights import FusedWeights, ParameterAddresses, has_address
from .stats import BackendStats, Piece
from .compiler import EagerPieceCompiles, FullGraphCode, PieceCompiler, describe_input
from .passes import (
    CaptureDim,
    SplitGraph,
    classify_nodes,
    example_value,
    find_capture_dim,
    find_padding_hazards,
    find_state_hazards,
    fold_grouped_query_attention,
    fuse_sibling_linears,
    hoist_mask_conversion,
    input_name,
    plan_full_graph,
    split_graph,
    values_sharing_memory,
)
from .aot_capture import (
    MakeInputs,
    capture_all,
    check_capture_call,
    check_pool,
    require_captured,
    require_cuda_graphs,
    requested_sizes,
)
from .capture import CaptureSession
from .memory_plan import MemoryPlan, capture_within_budget, count_graphs, profile_plan, write_plan
from .recovery import find_uncapturable_node, split_at_node
from .graph_piece import CompiledPiece, CudaGraphPiece, PaddedPiece, piece_layout
from .runtime import CallSizing, GraphRuntime, OutputCopy, PieceRunner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GraphAnalysis:
    """What the backend learned about one Dynamo graph before splitting it."""

    capture_dim: CaptureDim | None
    capture_index: int | None  # position of the capture dimension's input among the graph's inputs
    static_inputs: frozenset[str]  # placeholder names of parameters and buffers
    device: torch.device  # the accelerator the graph runs on, or cpu
    cudagraphs: bool


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


class Backend:
    """A torch.compile backend object: `torch.compile(model, backend=Backend(config))`.

    One Backend owns one CUDA graph pool that every graph it captures shares (pass
    `pool` to share it with other graph users). Use one Backend per model.
    """

    def __new__(cls, *args, **kwargs):
        # torch.compile(model, backend=cgcompile.Backend) hands Dynamo the class, which then
        # calls Backend(gm, example_inputs): say so before Python's TypeError about arguments.
        if args and isinstance(args[0], torch.fx.GraphModule):
            raise ArgumentError(expected(
                "torch.compile: backend", "a Backend object, cgcompile.Backend(...)", "the class cgcompile.Backend",
                "write backend=cgcompile.Backend() (or backend=cgcompile.Backend(cgcompile.Config(...)))", raw=True))
        return super().__new__(cls)

    def __init__(self, config: Config | None = None, *, pool: Any = None, session: CaptureSession | None = None):
        self.config = as_config(config, "Backend")
        check_pool("Backend", pool)
        expect(session is None or isinstance(session, CaptureSession), "Backend: session",
               "None or the CaptureSession of a GraphManager", session, "leave session out")
        self._stats = BackendStats()
        self.pieces: list[Piece] = []
        self.runtimes: list[GraphRuntime] = []
        self._compiler = PieceCompiler(
            self.config.compiler, self.config.compile_sizes,
            dict(self.config.inductor_options), dict(self.config.size_inductor_options),
        )
        self.session = session or CaptureSession.for_config(self.config, pool=pool)
        # Eager pieces compiled for full graphs (Config.small_query_attention), shared by all graphs.
        self._eager_compiles = EagerPieceCompiles(dict(self.config.inductor_options), self.config.cudnn_attention)
        self.memory_plan: MemoryPlan | None = None  # set by a capture under a memory budget
        self._fused_copies: dict[tuple, torch.Tensor] = {}  # Config.fuse_sibling_linears, by source
        # Ops a capture failed on (capture recovery), by target: later graphs split there
        # at once instead of failing a capture and searching again.
        self._uncapturable: dict[Any, str] = {}
        self._dump_folder: str | None = None  # claimed at the first dump (dump.claim_run_folder)

    def __deepcopy__(self, memo) -> "Backend":
        # A Backend is the one compile context of its graphs (pool, captured graphs, stats):
        # a copy would compile and capture everything again into a second pool. Configs
        # that hold one share it instead: transformers deep-copies its GenerationConfig,
        # and the CompileConfig in it, at every generate().
        return self

    @property
    def stats(self) -> BackendStats:
        self._stats.graphs_captured = self.session.graphs_captured
        self._stats.specialised_compilations = self._compiler.specialised_compilations  # made at first calls
        self._stats.specialise_s = self._compiler.specialise_s
        caches = [rt.full.code.compiles for rt in self.runtimes if rt.full is not None] + [self._eager_compiles.compiles]
        self._stats.full_graph_compilations = sum(c.compilations for c in caches)
        self._stats.full_graph_compile_s = sum(c.compile_s for c in caches)
        self._stats.layout_copies = sum(
            r.traced.copies for rt in self.runtimes for r in rt.runners if hasattr(r, "traced")
        )
        self._stats.fused_weight_refreshes = sum(rt.fused.refreshes for rt in self.runtimes if rt.fused is not None)
        watched = [rt.addresses for rt in self.runtimes if rt.addresses is not None]
        self._stats.calls_with_moved_parameters = sum(a.calls_without_graphs for a in watched)
        self._stats.parameter_recaptures = sum(a.recaptures for a in watched)
        return self._stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graph_index = self.stats.graphs_seen
        self.stats.graphs_seen += 1
        gm, fused = self._fuse_linears(gm, example_inputs)
        if fused is not None:
            example_inputs = [*example_inputs, *fused.tensors]
        analysis = self._analyse(gm, example_inputs)
        split = self._split(gm, analysis)
        sizing = self._choose_sizing(split, analysis)
        step = StepSize()
        runners = self._build_runners(graph_index, split, analysis, sizing, step)
        runtime = GraphRuntime(
            split.stitch, runners, self._outputs_to_clone(gm, split, runners), self.config.cudnn_attention,
            self._call_sizing(graph_index, analysis, sizing), step,
        )
        runtime.fused = fused
        if analysis.cudagraphs and not self.config.check_addresses:  # that one raises instead
            runtime.addresses = self._parameter_addresses(graph_index, gm, split, analysis, runtime, example_inputs)
        self.runtimes.append(runtime)
        self._arm_recovery(graph_index, runtime, runtime, split, analysis, sizing)
        full_plan = self._attach_full_graph(graph_index, gm, split, analysis, runtime)
        self._dump(graph_index, gm, split, analysis, full_plan)
        return runtime.__call__  # a bound method: debuggers such as depyf read its __code__

    def refresh_fused_weights(self) -> None:
        """Copy every fused weight again from its parameters at the next call of its graph
        (after writes through `param.data`, which `Config.fuse_sibling_linears` cannot see)."""
        for runtime in self.runtimes:
            if runtime.fused is not None:
                runtime.fused.invalidate()

    # -- steps ---------------------------------------------------------------------------

    def _fuse_linears(self, gm: torch.fx.GraphModule, example_inputs: list) -> tuple[torch.fx.GraphModule, FusedWeights | None]:
        """Config.fuse_sibling_linears: rewrite sibling linears over parameters; the fused
        weights become new graph inputs, appended to every call's (see `fused_weights`)."""
        if not self.config.fuse_sibling_linears:
            return gm, None
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        # Left out: inference tensors, which have no version counter (a later update could
        # not be seen), and parameters autograd will differentiate (the copies would take
        # their gradients). Dynamo guards on grad mode, so a call with grad on recompiles.
        training = torch.is_grad_enabled()
        params = {name: x for name, x in zip(placeholders, example_inputs)
                  if isinstance(x, torch.nn.Parameter) and not x.is_inference() and not (training and x.requires_grad)}
        gm, fused = fuse_sibling_linears(gm, params, self._fused_copy)
        if not fused:
            return gm, None
        for f in fused:
            torch._dynamo.mark_static_address(f.tensor, guard=False)
        weights = FusedWeights(fused, {name: i for i, name in enumerate(placeholders)}, example_inputs)
        self.stats.fused_linears += sum(len(f.sources) for f in fused if f.kind == "weight")
        self.stats.fused_weight_bytes = sum(t.numel() * t.element_size() for t in self._fused_copies.values())
        log.info("cgcompile: graph %d fused %d groups of sibling linears (weight copies of the backend: %.1f MB)",
                 self.stats.graphs_seen - 1, sum(f.kind == "weight" for f in fused), self.stats.fused_weight_bytes / 2**20)
        return gm, weights

    def _fused_copy(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """One copy per set of sources for all graphs of the model (a prefill and a decode
        graph fuse the same weights). A copy handed to a later graph is first made again
        in place: its sources may have been written since (graphs that read it already
        notice that themselves, see `fused_weights`)."""
        # A copy made inside a stream capture would live in the graph pool and be filled
        # only by the capture's own run: never the case, as Dynamo compiles before any capture.
        assert not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()), \
            "cgcompile: a fused weight copy was requested during a CUDA graph capture"
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in parts)
        with torch.no_grad():
            if key in self._fused_copies:
                return torch.cat(parts, dim=0, out=self._fused_copies[key])
            self._fused_copies[key] = torch.cat(parts, dim=0)
        return self._fused_copies[key]

    def _parameter_addresses(self, graph_index: int, gm: torch.fx.GraphModule, split: SplitGraph,
                             analysis: GraphAnalysis, runtime: GraphRuntime,
                             example_inputs: list) -> ParameterAddresses | None:
        """The per-call check that the parameters and buffers captured pieces read in place
        (never copied, see `graph_piece`) are where the graphs read them. Those only eager
        pieces read need no check: eager code reads the call's own; a full graph checks
        them itself (`FullGraphPlan.by_address`). Left out too: the backend's own fused
        weights (they keep their addresses, see `fused_weights`) and tensors without storage
        of their own (wrapper subclasses), which have no address to check."""
        read = {n.name for spec in split.pieces if spec.capturable for n in spec.inputs if n.op == "placeholder"}
        owned = {id(t) for t in runtime.fused.tensors} if runtime.fused is not None else set()  # never move
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        indices = [i for i, name in enumerate(names)
                   if name in analysis.static_inputs and name in read and id(example_inputs[i]) not in owned
                   and has_address(example_inputs[i])]
        if not indices:
            return None

        def recapture():
            runtime.drop_all_graphs()  # their memory goes back to the pool, for the recapture
            if not self.session.lazy_capture:
                log.warning("cgcompile: graph%d dropped its CUDA graphs after its parameters moved; graphs "
                            "captured under a memory budget are not captured lazily: call backend.capture(...) "
                            "again to have them", graph_index)

        return ParameterAddresses(f"graph{graph_index}", indices, [names[i] for i in indices], recapture)

    def _analyse(self, gm: torch.fx.GraphModule, example_inputs: list) -> GraphAnalysis:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        static = frozenset(n.name for n, x in zip(placeholders, example_inputs) if is_static_address(x))
        try:
            capture_dim = find_capture_dim(
                gm, static, self.config.capture_input, self.config.capture_input_dim
            )
        except LookupError as e:
            raise ConfigError(f"capture_input: {e}") from e
        device = _graph_device(gm)
        cudagraphs = device.type == "cuda" if self.config.cudagraphs is None else self.config.cudagraphs
        if cudagraphs and device.type != "cuda":
            raise ConfigError(
                f"cudagraphs=True: expected the graph's tensors on a CUDA device, got {device}; "
                f"move the model and inputs to CUDA or leave cudagraphs=None"
            )
        if device.type == "cpu" and self.config.compiler == "inductor":
            _hint_eager_on_cpu()
        index = None
        if capture_dim is not None:
            index = next(i for i, n in enumerate(placeholders) if input_name(n) == capture_dim.input_name)
        return GraphAnalysis(capture_dim, index, static, device, cudagraphs)

    def _split(self, gm: torch.fx.GraphModule, analysis: GraphAnalysis) -> SplitGraph:
        # Rewrites before classifying: their new nodes are classified like any other.
        hoist_mask_conversion(gm)
        if self.config.fold_grouped_query:
            fold_grouped_query_attention(gm)
        mutable = frozenset(
            n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name not in analysis.static_inputs
        )
        eager = classify_nodes(
            gm,
            op_reason=self._split_reason,
            capture_symbol=analysis.capture_dim.symbol if analysis.capture_dim else None,
            on_accelerator=analysis.device.type != "cpu",
            mutable_inputs=mutable,
        )
        return split_graph(gm, eager)

    def _split_reason(self, target) -> str | None:
        """Why an op is split: Config's split ops, then ops whose capture failed before."""
        reason = self.config.split_ops.reason(target)
        if reason is None and target in self._uncapturable:
            reason = (f"{self._uncapturable[target]} failed CUDA graph capture in an earlier graph of this "
                      f"Backend (capture recovery)")
        return reason

    def _choose_sizing(self, split: SplitGraph, analysis: GraphAnalysis) -> GraphSizing:
        symbol = analysis.capture_dim.symbol if analysis.capture_dim else None
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
        if not self.config.pads(analysis.cudagraphs):
            return GraphSizing(False, hazards, "exact sizes: padding is off (Config.padding)")
        return GraphSizing(True, hazards, "padded to the capture sizes")

    def _call_sizing(self, graph_index: int, analysis: GraphAnalysis, sizing: GraphSizing) -> CallSizing | None:
        if analysis.capture_dim is None:
            return None
        policy = SizePolicy(
            self.session.padding, exact=not sizing.padded, limit=self.config.exact_size_limit,
            name=f"graph{graph_index}",
        )
        return CallSizing(analysis.capture_index, analysis.capture_dim.dim, policy)

    def _build_runners(self, graph_index: int, split: SplitGraph, analysis: GraphAnalysis,
                       sizing: GraphSizing, step: StepSize, *, resplit: bool = False) -> list[PieceRunner]:
        """resplit: `split` cuts one piece (recovery); its own inputs come from other pieces
        of the graph too, so every input is handed over in the traced layout."""
        piece_outputs = {out for spec in split.pieces for out in spec.outputs}
        runners = []
        for spec in split.pieces:
            piece = _record_piece(graph_index, spec, sizing)
            self.pieces.append(piece)
            self.stats.pieces += 1
            if not spec.capturable:
                runners.append(PieceRunner(piece.name, spec.graph))
                continue
            self.stats.capturable_pieces += 1
            fn = self._compiler.compile(spec, analysis.capture_dim.symbol if analysis.capture_dim else None)
            self.stats.compilations = self._compiler.compilations
            from_pieces = tuple(i for i, node in enumerate(spec.inputs)
                                if node in piece_outputs or (resplit and node.op == "placeholder"))
            runners.append(self._make_runner(piece, spec, fn, analysis, sizing, step, from_pieces))
        if not any(s.capturable for s in split.pieces):
            log.warning(
                "cgcompile: graph %d has no capturable piece; it runs eagerly. Reasons: %s",
                graph_index,
                "; ".join(p.reason or "" for p in self.pieces if p.graph_index == graph_index),
            )
        return runners

    def _make_runner(self, piece: Piece, spec, fn, analysis: GraphAnalysis, sizing: GraphSizing,
                     step: StepSize, from_pieces: tuple[int, ...]) -> PieceRunner:
        symbol = analysis.capture_dim.symbol if analysis.capture_dim else None
        # Inputs made by other pieces: an eager op's kernel, and Inductor too (a cat with
        # an empty operand keeps the other's layout), may return another layout than traced.
        checked = from_pieces if self.config.compiler == "inductor" else ()
        traced = TracedLayout([example_value(n) for n in spec.inputs], symbol, checked)
        graphs = analysis.cudagraphs
        if not (graphs or sizing.padded):
            return CompiledPiece(piece.name, fn, step, traced)
        layout = piece_layout(spec, symbol if sizing.padded else None, analysis.static_inputs)
        if isinstance(layout, str):
            # The padding-safety pass rejects every piece whose layout cannot be padded.
            raise AssertionError(f"{piece.name}: padded, but {layout}")
        if not graphs:
            return PaddedPiece(piece.name, fn, layout, step, traced)
        return CudaGraphPiece(piece.name, fn, layout, self.session, step, traced)

    def _attach_full_graph(self, graph_index: int, gm, split: SplitGraph, analysis: GraphAnalysis,
                           runtime: GraphRuntime) -> str | None:
        """Give the runtime a full path where Config.capturable_split_ops allows one; returns
        what the dump records (None when no split op is declared capturable)."""
        if not self.config.capturable_ops:
            return None
        symbol = analysis.capture_dim.symbol if analysis.capture_dim else None
        plan = plan_full_graph(gm, split, analysis.static_inputs, symbol, self.config.capturable_ops.covers)
        if isinstance(plan, str):
            log.info("cgcompile: graph %d has no full graph: %s", graph_index, plan)
            return f"piecewise only: {plan}"
        values = _output_values(gm)
        copies = () if self.config.reuse_output_buffers else tuple(
            OutputCopy(i, _statically_contiguous(example_value(v)))
            for i, v in enumerate(values) if isinstance(example_value(v), torch.Tensor)
        )
        name = f"graph{graph_index}"
        whole = self.config.full_graph_compile  # Inductor, whatever compiles the pieces
        # Also the fallback of a whole-graph compile that fails: compiles only if it runs.
        eager_compiles = self._eager_compiles if self.config.small_query_attention else None
        pieces = plain_function(runtime, self.config.cudnn_attention, eager_compiles)
        code = FullGraphCode(name, pieces, gm if whole else None, dict(self.config.inductor_options),
                             self.config.cudnn_attention, self.config.small_query_attention)
        runtime.full = FullGraph(name, plan, code, self.session, self._stats, copies, cudagraphs=analysis.cudagraphs)
        checked = [plan.names[i] for i in plan.by_address] + [plan.names[i] for i, _ in plan.host_values]
        runs = "the whole graph compiled as one per size" if whole else "the pieces' code in order"
        if self.config.small_query_attention:
            runs += ", attention of few query rows compiled as batched matmuls"
        return f"full graph per call where these match the capture: {checked or 'nothing'}; it runs {runs}"

    # -- recovery from a failed capture ------------------------------------------------------

    def _arm_recovery(self, graph_index, top: GraphRuntime, owner: GraphRuntime, split: SplitGraph,
                      analysis: GraphAnalysis, sizing: GraphSizing) -> None:
        """Let each graph runner of `owner` (`top` itself, or a piece's split inside it)
        call back here when its capture fails."""
        for spec, runner in zip(split.pieces, owner.runners):
            if isinstance(runner, CudaGraphPiece):
                runner.recover = functools.partial(
                    self._recover, graph_index, top, owner, spec, analysis, sizing
                )

    def _recover(self, graph_index, top: GraphRuntime, owner: GraphRuntime, spec, analysis, sizing,
                 runner: CudaGraphPiece, args, padded, error: CaptureError):
        """Split the piece at the node that cannot be captured, then finish this call.

        Graphs of `top` captured in earlier calls or earlier in this one are dropped, and
        the rest of this call runs without graphs: all graphs of one size must be captured
        in one call for the pool's memory sharing to hold (see `capture.CaptureSession`).
        """
        found = find_uncapturable_node(spec.graph, padded, self.session)
        top.drop_graphs()
        top.step.size = None
        if found is None:
            replacement, reason = PieceRunner(runner.piece_name, spec.graph), (
                f"capture_failed: no single node could be blamed ({error}); the piece runs eagerly"
            )
            new_runners = [replacement]
        else:
            sub = split_at_node(spec.graph, found)
            sub = dataclasses.replace(sub, pieces=tuple(
                dataclasses.replace(p, name=f"{spec.name}.{p.name}") for p in sub.pieces
            ))
            new_runners = self._build_runners(graph_index, sub, analysis, sizing, top.step, resplit=True)
            replacement = GraphRuntime(sub.stitch, new_runners, (), self.config.cudnn_attention, None, top.step)
            self._arm_recovery(graph_index, top, replacement, sub, analysis, sizing)
            reason = f"capture_failed: split at {found.node.name} ({found.op}), see {runner.piece_name}.*"
        self._warn_uncapturable(runner.piece_name, found, error)
        self._replace_record(runner.piece_name, reason)
        owner.replace_runner(runner, replacement, new_runners)
        top.runners.extend(r for r in new_runners if r not in top.runners)
        return replacement(*args)

    def _warn_uncapturable(self, piece_name: str, found, error: CaptureError) -> None:
        """One warning per op that fails capture: later graphs split there without trying."""
        cause = _first_line(error.__cause__ or error)
        if found is None:
            log.warning("cgcompile: capturing %s failed (%s) and no single node could be blamed; "
                        "that piece runs eagerly from now on", piece_name, cause)
            return
        if found.node.op == "call_function":
            if found.node.target in self._uncapturable:
                return
            self._uncapturable[found.node.target] = found.op
        log.warning("cgcompile: %s cannot be captured in a CUDA graph (%s); %s splits there, and so do "
                    "later graphs of this Backend. To skip the search: %s",
                    found.op, cause, piece_name, found.advice)

    def _replace_record(self, name: str, reason: str) -> None:
        for i, piece in enumerate(self.pieces):
            if piece.name == name:
                self.pieces[i] = dataclasses.replace(piece, capturable=False, reason=reason)
                self.stats.capturable_pieces -= 1

    def _outputs_to_clone(self, gm, split: SplitGraph, runners: list[PieceRunner]) -> tuple[OutputCopy, ...]:
        """Graph outputs that share memory with a CUDA graph's output: copied on return.

        Not only the graph pieces' own outputs: a view of one, made by a later eager piece,
        is pool memory too. Whatever the caller keeps of such an output (a KV cache that
        keeps `cat(...)[:, :, 1:]`, a sliding window's) must outlive the replay: after it,
        runners hold only non-owning aliases of their outputs, and graphs of other sizes or
        other Dynamo graphs, captured into the memory the pool thinks free, write over it.
        """
        if self.config.reuse_output_buffers:
            return ()
        from_graphs = [
            out for spec, runner in zip(split.pieces, runners) if isinstance(runner, CudaGraphPiece)
            for out in spec.outputs
        ]
        values = _output_values(gm)
        # A view of a graph input that a piece also returns views the caller's own tensor.
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return tuple(
            OutputCopy(i, _statically_contiguous(example_value(values[i])))
            for i in values_sharing_memory(values, from_graphs, exclude=inputs)
        )

    # -- CUDA graph management -------------------------------------------------------------

    def capture(self, model, make_inputs: MakeInputs, sizes=None, progress: bool = True, *,
                memory_budget: int | None = None, name: str = "model") -> int:
        """Capture every size ahead of time (largest first); returns the graphs captured.

        model is the compiled model (what torch.compile returned); make_inputs(size, warmup)
        returns its inputs for one call of that size (a tuple, a dict of kwargs or one value).
        Raises CaptureError before running anything without CUDA or with cudagraphs=False,
        and after running every size if no graph could be captured at all.

        memory_budget: bytes the pool may hold. The sizes are profiled first, the largest
        kept while the pool fits, and calls of the others padded up to a captured size or
        run without graphs (see `cgcompile.memory_plan`); `self.memory_plan` records it
        all, under `name`.
        """
        if memory_budget is not None:
            check_capture_call("Backend.capture", model, make_inputs, progress)
            self.memory_plan = capture_within_budget(self, model, make_inputs, memory_budget, sizes, progress, name)
            return self.memory_plan.graphs
        check_capture_call("Backend.capture", model, make_inputs, progress)
        sizes = requested_sizes("Backend.capture", sizes, self.config.capture_sizes, bounded=True)
        require_cuda_graphs("Backend.capture", self.config.cudagraphs is not False, "Config.cudagraphs=False")
        captured = capture_all(self.session, model, make_inputs, sizes, progress)
        require_captured("Backend.capture", self.session)
        return captured

    def graph_memory(self) -> int:
        """Bytes the shared pool holds now."""
        return self.session.graph_memory()

    def graphs_held(self) -> int:
        """CUDA graphs the runners hold now (0 after clear())."""
        return sum(len(r.graphs) for r in self._graph_runners())

    def plan_memory(self, model=None, make_inputs: MakeInputs | None = None, sizes=None, *,
                    memory_budget: int | None = None, name: str = "model") -> MemoryPlan:
        """How many graphs and bytes a capture of `sizes` takes, before capturing.

        Without model and make_inputs: graphs counted from the Dynamo graphs traced so
        far, bytes unknown (no CUDA needed). With them: measured on CUDA in a temporary
        pool, and the sizes a capture under `memory_budget` keeps. See `cgcompile.memory_plan`.
        """
        if model is None and make_inputs is None:
            expect(bool(self.runtimes), "Backend.plan_memory", "a model compiled with this backend and called once",
                   "no Dynamo graph yet", "call the compiled model once per kind of call (e.g. prefill and decode) "
                   "first, or pass the compiled model and make_inputs to measure on CUDA", StateError, raw=True)
            expect(memory_budget is None, "plan_memory: memory_budget", "None without model and make_inputs",
                   memory_budget, "pass the compiled model and make_inputs: bytes are measured on CUDA")
            plan = count_graphs(self, sizes, name)
        else:
            plan = profile_plan(self, model, make_inputs, sizes, memory_budget, name)
        write_plan(self.config.resolved_dump_dir(), plan)
        return plan

    def profile_capture_memory(self, model, make_inputs: MakeInputs, sizes=None) -> "CaptureMemoryProfile":
        """Capture the sizes into a temporary pool, measure it, release everything.

        sizes may differ from Config.capture_sizes: the probe captures exactly these.
        Raises CaptureError as `capture` does, before running anything.
        """
        check_capture_call("profile_capture_memory", model, make_inputs, False)
        sizes = requested_sizes("profile_capture_memory", sizes, self.config.capture_sizes, bounded=False)
        require_cuda_graphs("profile_capture_memory", self.config.cudagraphs is not False, "Config.cudagraphs=False")
        if any(r.graphs for r in self._graph_runners()):
            raise CaptureError(
                "profile_capture_memory: expected no captured graphs, got some; call it before the "
                "first capture or after clear()"
            )
        with self.probe_session(sizes) as probe:
            graphs = capture_all(probe, model, make_inputs, sizes, progress=False)
            require_captured("profile_capture_memory", probe)
            reserved = probe.pool.bytes_reserved()
        return CaptureMemoryProfile(reserved, graphs)

    @contextlib.contextmanager
    def probe_session(self, sizes: tuple[int, ...]):
        """Every graph runner captures into a temporary session (its own pool) meanwhile;
        on leaving, that session's graphs and pool are released and the runners return."""
        probe = CaptureSession.for_config(self.config, sizes=sizes)
        previous, self.session = self.session, probe
        for runner in self._graph_runners():
            runner.session = probe
            probe.register(runner)
        try:
            yield probe
        finally:
            probe.clear()
            self.session = previous
            for runner in self._graph_runners():
                runner.session = previous
                previous.register(runner)

    def clear(self) -> None:
        """Release every graph and the pool; later calls capture again lazily (at every
        configured size again, after a capture under a memory budget)."""
        self.session.clear()

    def _graph_runners(self) -> list:
        """Every runner that holds CUDA graphs: graph pieces and full graphs."""
        return [r for rt in self.runtimes for r in (*rt.runners, rt.full) if isinstance(r, (CudaGraphPiece, FullGraph))]

    def _dump(self, graph_index, gm, split, analysis, full_plan: str | None) -> None:
        dump.show_to_debuggers(split)
        dump_dir = self.config.resolved_dump_dir()
        if dump_dir:
            if self._dump_folder is None:  # one folder per Backend: runs never mix
                self._dump_folder = dump.claim_run_folder(dump_dir)
            pieces = [p for p in self.pieces if p.graph_index == graph_index]
            dump.write_graph_dump(self._dump_folder, graph_index, gm, split, pieces, str(analysis.capture_dim),
                                  full_plan)


@dataclasses.dataclass(frozen=True)
class CaptureMemoryProfile:
    bytes: int  # pool size after capturing every requested size
    graphs: int  # CUDA graphs that capture made


def _record_piece(graph_index: int, spec, sizing: GraphSizing) -> Piece:
    reason = "; ".join(str(r) for r in spec.reasons) if not spec.capturable else None
    hazards = sizing.hazards.get(spec.name)
    padding = "; ".join(map(str, hazards)) if hazards else None
    shapes = tuple(describe_input(example_value(n)) for n in spec.inputs)
    return Piece(
        f"graph{graph_index}.{spec.name}", graph_index, spec.capturable, reason, spec.graph, shapes,
        padding_unsafe=padding, sizes=sizing.why,
    )


def _output_values(gm: torch.fx.GraphModule) -> list:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _statically_contiguous(value) -> bool:
    """True when eager's result is contiguous with sizes and strides that are plain ints."""
    if not isinstance(value, torch.Tensor):
        return False
    sizes, strides = value.shape, value.stride()
    if not all(type(x) is int for x in (*sizes, *strides)):
        return False
    expected = 1
    for size, stride in reversed(list(zip(sizes, strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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


def cgcompile_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None):
    """Entry point for `torch.compile(model, backend="cgcompile", options={...})`.

    Every graph of one torch.compile call goes to one Backend (one pool, one compile
    cache; see `cgcompile.backend`); `cgcompile.backend_of(compiled)` returns it.
    """
    return backend_for_this_compile(options)(gm, example_inputs)


# --------------------------------------------------------------------------------------
# One Backend per `torch.compile(..., backend="cgcompile")` call, shared by all its graphs.
#
# Dynamo calls a string backend once per graph it captures: the prefill and decode graphs
# of a transformers model, each resume after a graph break, each recompilation. No
# argument says which `torch.compile` call a graph belongs to, but torch.compile builds
# one small object per call (it holds the backend name and `options`) and every graph of
# that call reaches the backend through it. That object is the scope here: the first
# graph of a call builds a `Backend` from the call's `options`, later graphs of the same
# call reuse it, so they share one graph pool, one capture session and one compile cache.
#
# Scope, exactly: one `torch.compile(...)` call (or `module.compile(...)`), whatever it
# compiled: a module, a function, with any number of graphs. Two calls never share a
# Backend; but where Dynamo finds code it compiled for an equal call (same function,
# backend name and options) it runs that code, whose graphs belong to the earlier call's
# Backend. The Backend lives as long as that call's object, i.e. as long as
# what torch.compile returned. Where the object cannot be found (a torch that calls
# backends another way, or the backend function called directly), each graph gets a
# Backend of its own, which is safe (separate pools), only larger; that is logged once.


log = logging.getLogger(__name__)

# id(per-call object) -> its Backend; an entry leaves with the object (weakref.finalize).
_BACKENDS: dict[int, Any] = {}
_warned_unscoped = False


def backend_for_this_compile(options: dict | None):
    """The Backend of the torch.compile call whose graph is being compiled now."""
    # backend.py imports this module for its entry point

    call = torch_compile_call_on_stack()
    if call is None:
        _warn_unscoped()
        return Backend(Config.from_options(options))
    backend = _BACKENDS.get(id(call))
    if backend is None:
        backend = Backend(Config.from_options(options))
        _BACKENDS[id(call)] = backend
        weakref.finalize(call, _BACKENDS.pop, id(call), None)
    return backend


def backend_of(compiled: Any):
    """The Backend that `torch.compile(model, backend="cgcompile")` built for `compiled`
    (what torch.compile returned, or a module compiled with `module.compile(...)`).

    Raises ArgumentError when `compiled` was not compiled with the string backend or has
    not been called yet (Dynamo compiles on the first call, and the Backend with it).
    """
    backend = _backend_behind(compiled)
    forward = getattr(compiled, "__dict__", {}).get("forward")  # model.forward = torch.compile(model.forward)
    if backend is None and forward is not None:
        backend = _backend_behind(forward)
    if backend is None:
        raise ArgumentError(expected(
            "backend_of", "what torch.compile(..., backend='cgcompile') returned, called at least once",
            compiled, _advice(compiled if forward is None else forward)))
    return backend


def _backend_behind(compiled: Any):
    call = torch_compile_call_of(compiled)
    return _BACKENDS.get(id(call)) if call is not None else None


def _advice(compiled: Any) -> str:
    call = torch_compile_call_of(compiled)
    if call is None:
        return "call it once first; or pass backend=cgcompile.Backend(config) and keep that object"
    if getattr(call, "compiler_name", "cgcompile") != "cgcompile":
        return ("it was compiled with a Backend object: keep that object and use it "
                "(a GraphManager's is GraphManager.backend)")
    return "call it once first (Dynamo compiles at the first call)"


def _warn_unscoped() -> None:
    global _warned_unscoped
    if not _warned_unscoped:
        _warned_unscoped = True
        log.warning("cgcompile: the string backend was called outside torch.compile's per-call "
                    "wrapper; each graph gets its own Backend (own pool and compile cache)")
