"""The `cgcompile` torch.compile backend: the Backend's state, stats and user API.

`Backend.__call__` is what Dynamo calls with each graph it captures; it reads as the
steps it takes, each a function of `cgcompile.build.phases` that returns a record of what it
decided. Everything decided is recorded in `stats` and `pieces`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable

import torch

from .tools import dump
from .build import phases
from .tools.aot_capture import (
    MakeInputs,
    capture_all,
    check_capture_call,
    check_pool,
    require_captured,
    require_cuda_graphs,
    requested_sizes,
)
from .run.capture import CaptureSession
from .compat import graph_input_sources, torch_compile_call_of, torch_compile_call_on_stack
from .build.compiler import EagerPieceCompiles, PieceCompiler
from .config import Config, as_config
from .errors import ArgumentError, CaptureError, ConfigError, StateError, expect, expected
from .run.full_graph import FullGraph
from .run.graph_piece import CudaGraphPiece
from .tools.memory_plan import (
    GraphOwner,
    MemoryPlan,
    capture_within_budget,
    count_graphs,
    profile_plan,
    require_profiling_device,
    write_plan,
)
from .run.recovery import UncapturableOps
from .run.runtime import GraphRuntime
from .stats import BackendStats, Piece, PieceRecords, RunCounts, total
from .run.fused_weights import FusedWeightStore

log = logging.getLogger(__name__)


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
        self._records = PieceRecords(self.pieces, self._stats)  # what compiles add and recovery updates
        self.runtimes: list[GraphRuntime] = []
        self._compiler = PieceCompiler(
            self.config.compile.compiler, self.config.compile.compile_sizes,
            self.config.compile.inductor_patches(), dict(self.config.compile.size_inductor_options),
            all_reduce=self.config.rewrites.all_reduce, matvec_as_reduction=self.config.compile.matvec_as_reduction,
            fuse_all_reduce_norm=self.config.rewrites.fuse_all_reduce_norm,
            skinny_linears=self.config.compile.skinny_linears,
            fuse_linear_all_reduce=self.config.rewrites.fuse_linear_all_reduce,
        )
        self.session = session or CaptureSession.for_config(self.config, pool=pool)
        # Eager pieces compiled for full graphs (Config.small_query_attention), shared by all graphs.
        self._eager_compiles = EagerPieceCompiles(self.config.compile.inductor_patches(),
                                                  self.config.split.cudnn_attention,
                                                  self.config.compile.decode_attention_kernel)
        self.memory_plan: MemoryPlan | None = None  # set by a capture under a memory budget
        # Config.fuse_sibling_linears, shared by all graphs; copies only where asked for (True).
        self._fused_weights = FusedWeightStore(copies=self.config.rewrites.fuse_sibling_linears is True)
        # Ops a capture failed on (capture recovery): later graphs split there at once.
        self._uncapturable = UncapturableOps()
        self._dump_folder: str | None = None  # claimed at the first dump (dump.claim_run_folder)

    def __deepcopy__(self, memo) -> "Backend":
        # A Backend is the one compile context of its graphs (pool, captured graphs, stats):
        # a copy would compile and capture everything again into a second pool. Configs
        # that hold one share it instead: transformers deep-copies its GenerationConfig,
        # and the CompileConfig in it, at every generate().
        return self

    @property
    def stats(self) -> BackendStats:
        """The Backend's own counters, with what its compiler and session count and what
        every graph's runtime reports (`GraphRuntime.counts`), added up."""
        eager = self._eager_compiles.compiles  # eager pieces compiled for full graphs, shared by all graphs
        run = total([rt.counts() for rt in self.runtimes] + [
            RunCounts(full_graph_compilations=eager.compilations, full_graph_compile_s=eager.compile_s)])
        reported = dict(
            dataclasses.asdict(run),
            compilations=self._compiler.compilations,
            compile_s=self._compiler.compile_s,
            specialised_compilations=self._compiler.specialised_compilations,  # made at first calls
            specialise_s=self._compiler.specialise_s,
            matvec_reductions=self._compiler.matvec_reductions,
            skinny_linears=self._compiler.skinny_linear_count,
            grouped_skinny_linears=self._compiler.grouped_skinny_linear_count,
            gated_skinny_linears=self._compiler.gated_skinny_linear_count,
            graphs_captured=self.session.graphs_captured,
        )
        for name, value in reported.items():
            setattr(self._stats, name, value)
        return self._stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, *, mode: str | None = None) -> Callable:
        _refuse_mode("torch.compile(..., backend=Backend(...))", mode, "set Config fields in Backend(Config(...))")
        index = self._stats.graphs_seen
        self._stats.graphs_seen += 1
        sources = graph_input_sources(gm)  # before any rewrite adds or drops inputs
        fusion = phases.fuse_linears(index, gm, example_inputs, self.config, self._fused_weights)
        self._count_fusion(fusion)
        gm = fusion.gm
        analysis = phases.analyse(gm, fusion.example_inputs, self.config)
        analysis = phases.without_graphs_for_autograd(index, analysis, fusion.example_inputs)
        self._count_uncaptured(analysis)
        scalars = phases.scalars_from_device(index, gm, fusion.example_inputs, analysis, self.config)
        gm, analysis = scalars.gm, scalars.analysis
        split = phases.split_pieces(gm, analysis, self.config, self._uncapturable)
        sizing = phases.choose_sizing(split, analysis, self.config)
        build = phases.GraphBuild(index, analysis, sizing, self._compiler, self.config)
        runners = phases.build_runners(build, split, self.session)
        self._records.add(index, runners.pieces)
        full = phases.full_graph(build, gm, split, runners, self.session, self._eager_compiles, scalars)
        self._count_choice(full)
        clone = phases.outputs_to_clone(gm, split, runners, self.config)
        watch = phases.address_watch(build, gm, split, fusion, scalars)
        recovery = phases.piece_recovery(build, split, self._records, self._uncapturable)
        specs = phases.dtensor_specs(build, gm, example_inputs, sources)
        runtime = GraphRuntime(
            split.stitch, list(runners.runners), clone, self.config.split.cudnn_attention,
            phases.call_sizing(build, self.session),
            full=full.graph, fused=fusion.weights, scalars=scalars.buffer, addresses=watch, session=self.session,
            recovery=recovery, graph_name=f"graph{index}", specs=specs,
        )
        self.runtimes.append(runtime)
        self._dump(index, gm, split, analysis, full.summary)
        return runtime.__call__  # a bound method: debuggers such as depyf read its __code__

    def refresh_fused_weights(self) -> None:
        """Copy every fused weight again from its parameters at the next call of its graph
        (after writes through `param.data`, which `Config.fuse_sibling_linears` cannot see)."""
        for runtime in self.runtimes:
            if runtime.fused is not None:
                runtime.fused.invalidate()

    def _count_uncaptured(self, analysis: phases.GraphAnalysis) -> None:
        if analysis.uncaptured is not None:
            counts = self._stats.uncaptured_graphs
            counts[analysis.uncaptured] = counts.get(analysis.uncaptured, 0) + 1

    def _count_choice(self, full: phases.FullGraphChoice) -> None:
        choices = self._stats.full_graph_choices
        choices[full.choice] = choices.get(full.choice, 0) + 1

    def _count_fusion(self, fusion: phases.Fusion) -> None:
        if fusion.weights is not None:
            self._stats.fused_linears += fusion.linears
            self._stats.fused_weight_bytes = self._fused_weights.bytes
            self._stats.shared_fused_weights = self._fused_weights.shared

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
        run without graphs (see `cgcompile.tools.memory_plan`); `self.memory_plan` records it
        all, under `name`.
        """
        if memory_budget is not None:
            check_capture_call("Backend.capture", model, make_inputs, progress)
            self.memory_plan = capture_within_budget(self._graph_owner(), model, make_inputs, memory_budget, sizes,
                                                     progress, name)
            return self.memory_plan.graphs
        check_capture_call("Backend.capture", model, make_inputs, progress)
        sizes = requested_sizes("Backend.capture", sizes, self.config.sizes.capture_sizes, bounded=True)
        require_cuda_graphs("Backend.capture", self.config.graphs.cudagraphs is not False, "Config.cudagraphs=False")
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
        pool, and the sizes a capture under `memory_budget` keeps. See `cgcompile.tools.memory_plan`.
        """
        if model is None and make_inputs is None:
            expect(bool(self.runtimes), "Backend.plan_memory", "a model compiled with this backend and called once",
                   "no Dynamo graph yet", "call the compiled model once per kind of call (e.g. prefill and decode) "
                   "first, or pass the compiled model and make_inputs to measure on CUDA", StateError, raw=True)
            expect(memory_budget is None, "plan_memory: memory_budget", "None without model and make_inputs",
                   memory_budget, "pass the compiled model and make_inputs: bytes are measured on CUDA")
            plan = count_graphs(self.runtimes, self.pieces, self.config.sizes.capture_sizes, sizes, name)
        else:
            require_profiling_device("plan_memory")
            plan = profile_plan(self._graph_owner(), model, make_inputs, sizes, memory_budget, name)
        write_plan(self._run_folder(), plan)
        return plan

    def profile_capture_memory(self, model, make_inputs: MakeInputs, sizes=None) -> "CaptureMemoryProfile":
        """Capture the sizes into a temporary pool, measure it, release everything.

        sizes may differ from Config.capture_sizes: the probe captures exactly these.
        Raises CaptureError as `capture` does, before running anything.
        """
        check_capture_call("profile_capture_memory", model, make_inputs, False)
        sizes = requested_sizes("profile_capture_memory", sizes, self.config.sizes.capture_sizes, bounded=False)
        require_cuda_graphs("profile_capture_memory", self.config.graphs.cudagraphs is not False, "Config.cudagraphs=False")
        if any(r.graphs for r in self._graph_runners()):
            raise CaptureError(
                "profile_capture_memory: expected no captured graphs, got some; call it before the "
                "first capture or after clear()"
            )
        with self.session.probe() as probe:
            graphs = capture_all(probe, model, make_inputs, sizes, progress=False)
            require_captured("profile_capture_memory", probe)
            reserved = probe.pool.bytes_reserved()
        return CaptureMemoryProfile(reserved, graphs)

    def _graph_owner(self) -> GraphOwner:
        """What a memory plan reads of this Backend; its probes capture into a temporary pool."""
        return GraphOwner(self.session, self._graph_runners(), self.session.probe, self.config.sizes.capture_sizes,
                          self.config.graphs.cudagraphs is not False, self._run_folder())

    def clear(self) -> None:
        """Release every graph and the pool; later calls capture again lazily (at every
        configured size again, after a capture under a memory budget)."""
        self.session.clear()

    def _graph_runners(self) -> list:
        """Every runner that holds CUDA graphs: graph pieces and full graphs."""
        return [r for rt in self.runtimes for r in (*rt.runners, rt.full) if isinstance(r, (CudaGraphPiece, FullGraph))]

    def _run_folder(self) -> str | None:
        """The folder this Backend dumps its graphs and memory plans into, claimed at its
        first dump (one folder per Backend: runs never mix); None without a dump dir."""
        dump_dir = self.config.resolved_dump_dir()
        if dump_dir and self._dump_folder is None:
            self._dump_folder = dump.claim_run_folder(dump_dir)
        return self._dump_folder if dump_dir else None

    def _dump(self, graph_index, gm, split, analysis, full_plan: str | None) -> None:
        dump.show_to_debuggers(split)
        folder = self._run_folder()
        if folder:
            pieces = [p for p in self.pieces if p.graph_index == graph_index]
            dump.write_graph_dump(folder, graph_index, gm, split, pieces, str(analysis.capture_dim), full_plan)


@dataclasses.dataclass(frozen=True)
class CaptureMemoryProfile:
    bytes: int  # pool size after capturing every requested size
    graphs: int  # CUDA graphs that capture made


def cgcompile_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                      mode: str | None = None):
    """Entry point for `torch.compile(model, backend="cgcompile", options={...})`.

    Every graph of one torch.compile call goes to one Backend (one pool, one compile
    cache; see `cgcompile.backend`); `cgcompile.backend_of(compiled)` returns it.
    `mode` is refused: torch.compile hands any mode but "default" to the backend, and
    cgcompile is a CUDA-graph mode of its own.
    """
    _refuse_mode('torch.compile(..., backend="cgcompile")', mode,
                "set Config fields with options={...}, e.g. options={'capture_sizes': [1, 2, 4]}")
    return backend_for_this_compile(options)(gm, example_inputs)


def _refuse_mode(culprit: str, mode: str | None, where_config_goes: str) -> None:
    """Raise ConfigError for a torch.compile `mode` (which torch hands to the backend)."""
    expect(mode is None, f"{culprit}: mode", "no mode (cgcompile is itself the CUDA-graph mode)", mode,
           f"leave mode out, and {where_config_goes}", ConfigError)


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


# id(per-call object) -> its Backend; an entry leaves with the object (weakref.finalize).
_BACKENDS: dict[int, Any] = {}
_warned_unscoped = False


def backend_for_this_compile(options: dict | None):
    """The Backend of the torch.compile call whose graph is being compiled now."""
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
