"""The variants `decode_bench.py` times: each turns a Bench into a step function.

A variant's `prepare(bench)` returns a Prepared: `step(batch, start, i) -> logits [batch,
vocab]` runs one decode step at cache length `start` with the i-th id tensor of that
batch size; `capture`, where the variant captures ahead of time, warms up and captures
every capture size (timed as its capture time); `report` gives the runner's own account.

The two breakable variants run the HostStateDecoder: the cache length lives in a
DecodeState that the step sets before running the graphs, and attention reads it at
call time. Their warm-up and capture write at `capture_start(cfg)`, a cache position no
timed step reads (see there why that matters).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from cgcompile.testing.decode_model import SPLIT_OP, DecodeState, HostLengthDecoder, HostStateDecoder, Llama
from cgcompile.testing.decode_model import ModelConfig, StateAttention, StaticMaskDecoder, state_attention
from harness import Unavailable

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)
PEER_MODULE = "breakable_cuda_graphs"
PEER_NOT_INSTALLED = (
    "not installed (carry the wheel: python3 -m pip install --no-index --no-deps --target /tmp/site "
    ".whl/breakable_cuda_graphs-0.1.0-py3-none-any.whl && export PYTHONPATH=/tmp/site)"
)


# -- what a variant gets -------------------------------------------------------------------


class DecodeInputs:
    """Step inputs built once and reused, so timed steps hold only the model call.

    ids(batch, i, marked): token ids [batch], deterministic in (batch, i); `marked` ones
    have dim 0 marked dynamic (never for batch 1, which Dynamo always specialises).
    """

    POOL = 8  # distinct id tensors per batch size, cycled

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self._ids: dict[tuple[int, int, bool], torch.Tensor] = {}
        self._positions: dict[int, torch.Tensor] = {}

    def ids(self, batch: int, i: int, marked: bool = False) -> torch.Tensor:
        key = (batch, i % self.POOL, marked)
        if key not in self._ids:
            gen = torch.Generator().manual_seed(batch * 1000 + key[1])
            ids = torch.randint(self.vocab, (batch,), generator=gen).to(self.device)
            if marked and batch > 1:
                torch._dynamo.mark_dynamic(ids, 0)
            self._ids[key] = ids
        return self._ids[key]

    def position(self, start: int) -> torch.Tensor:
        if start not in self._positions:
            self._positions[start] = torch.tensor([start], device=self.device)
        return self._positions[start]


@dataclasses.dataclass
class Bench:
    """One model under test: shared weights, decoders, inputs and eager references."""

    name: str
    cfg: ModelConfig
    llama: Llama
    host: HostLengthDecoder
    static: StaticMaskDecoder
    inputs: DecodeInputs
    device: torch.device
    references: dict[int, torch.Tensor]  # batch -> eager logits at the check start, float32


Step = Callable[[int, int, int], torch.Tensor]  # (batch, start, i) -> logits [batch, vocab]


@dataclasses.dataclass
class Prepared:
    step: Step
    capture: Callable[[], None] | None = None  # ahead-of-time warm-up + capture of every size
    report: Callable[[], dict] | None = None  # the graph runner's own account, read after timing


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    prepare: Callable[[Bench], Prepared]
    cuda_graphs: bool  # on CPU it still runs, without CUDA graphs


def capture_start(cfg: ModelConfig) -> int:
    """The cache position the breakable variants' warm-up and capture write at.

    Capture records the segments without running them, so the eager attention between
    them runs on buffers nothing has computed yet and writes garbage keys and values at
    `start`. The last position is never read by a timed or checked step (they all run at
    starts far below max_len), so that garbage cannot reach any logits.
    """
    return cfg.max_len - 1


def padded_size(batch: int) -> int:
    """The capture size a batch runs at: the smallest one >= batch."""
    return next(s for s in sorted(CAPTURE_SIZES) if s >= batch)


# -- Dynamo variants -------------------------------------------------------------------------


def prepare_eager(bench: Bench) -> Prepared:
    return Prepared(lambda b, start, i: bench.host(bench.inputs.ids(b, i), start))


def prepare_compile_default(bench: Bench) -> Prepared:
    compiled = torch.compile(bench.host)
    return Prepared(lambda b, start, i: compiled(bench.inputs.ids(b, i, marked=True), start))


def prepare_reduce_overhead(bench: Bench) -> Prepared:
    # dynamic=False: one static graph per batch size, the strongest full-graph baseline.
    compiled = torch.compile(bench.static, mode="reduce-overhead", dynamic=False)

    def step(b, start, i):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(bench.inputs.ids(b, i), bench.inputs.position(start))

    return Prepared(step)


# cgcompile-sizes: the batch sizes issue 17's targets name get pieces compiled for exactly
# that size (Config.compile_sizes). Batch 1 is a static Dynamo graph already (Dynamo
# specialises sizes 0 and 1), so its pieces are compiled for one row either way.
COMPILE_SIZES = (1, 8)
# cgcompile-sizes-tuned: Inductor's coordinate-descent tile tuning for those compiles only
# (every shape there is fixed); it benchmarks tile sizes per kernel, seconds per distinct piece.
TUNED_OPTIONS = {"coordinate_descent_tuning": True}


def cgcompile_config(compiler: str, **fields):
    import cgcompile

    return cgcompile.Config(compiler=compiler, splitting_ops=(SPLIT_OP,), capture_sizes=CAPTURE_SIZES, **fields)


def cgcompile_report(backend) -> dict:
    pieces = backend.pieces
    eager = [p for p in pieces if not p.capturable]
    return {
        "stats": dataclasses.asdict(backend.stats),
        "graph_memory_bytes": backend.graph_memory(),
        "pieces": len(pieces),
        "capturable_pieces": len(pieces) - len(eager),
        "example_eager_reason": eager[0].reason if eager else None,
    }


def prepare_cgcompile(compiler: str, plans: bool = True, **fields) -> Callable[[Bench], Prepared]:
    """plans False: every replay goes through the stitch and each graph piece's own
    replay, not the runtimes' straight-line replay plans (`cgcompile.run.replay_plan`): the
    baseline the plans are measured against."""

    def prepare(bench: Bench) -> Prepared:
        import cgcompile

        backend = cgcompile.Backend(cgcompile_config(compiler, **fields))
        compiled = torch.compile(bench.host, backend=backend)

        def step(b, start, i):
            if not plans:
                for runtime in backend.runtimes:  # made at the first call of each Dynamo graph
                    runtime.executors = (runtime.stitch,)  # no replay plan: the stitch runs every call
            return compiled(bench.inputs.ids(b, i, marked=True), start)

        return Prepared(step, report=lambda: cgcompile_report(backend))

    return prepare


def prepare_cgcompile_static(full: bool | None, whole: bool = False, small_query: bool = False) -> Callable[[Bench], Prepared]:
    """cgcompile (Inductor pieces) on the static decoder reduce-overhead runs, one static
    graph per batch as there. full: attention may be captured too, so a step whose cache
    and positions lie where they lay at capture replays one CUDA graph (the position is a
    device tensor, copied into the graph's buffer); else attention runs between pieces.
    whole: the full graph captures the whole step compiled as one (Config.full_graph_compile);
    small_query: with attention lowered to batched matmuls there (Config.small_query_attention).
    full None: the default Config, whose automatic full graph chooses for itself."""

    def prepare(bench: Bench) -> Prepared:
        import cgcompile

        if full is None:
            config = cgcompile.Config(compiler="inductor", capture_sizes=CAPTURE_SIZES)
        else:
            config = cgcompile.Config(compiler="inductor", capture_sizes=CAPTURE_SIZES,
                                      capturable_split_ops=("attention",) if full else (),
                                      full_graph_compile=whole, small_query_attention=small_query)
        backend = cgcompile.Backend(config)
        compiled = torch.compile(bench.static, backend=backend, dynamic=False)

        def step(b, start, i):
            return compiled(bench.inputs.ids(b, i), bench.inputs.position(start))

        return Prepared(step, report=lambda: cgcompile_report(backend))

    return prepare


# -- breakable CUDA graphs: cgcompile's GraphManager ---------------------------------------------


def prepare_breakable(bench: Bench) -> Prepared:
    """cgcompile's breakable CUDA graphs over the eager decoder: no Dynamo, no compilation.

    Attention is an @eager_break function, so it runs eagerly between graph segments and
    reads `state.start` at every replay; the runner copies its fresh output into the
    buffer the next segment reads. The ids are plain tensors (no mark_dynamic: no Dynamo).
    """
    import cgcompile

    state = DecodeState()
    decoder = HostStateDecoder(bench.llama, state, cgcompile.eager_break(state_attention))
    config = cgcompile.Config(use_breakable=True, splitting_ops=(SPLIT_OP,), capture_sizes=CAPTURE_SIZES)
    manager = cgcompile.GraphManager(decoder, config, boundary=None)

    def make_inputs(size: int, warmup: bool):
        state.start = capture_start(bench.cfg)
        return (bench.inputs.ids(size, 0),)

    def step(b, start, i):
        state.start = start
        return manager.run_pw_graph(decoder, (bench.inputs.ids(b, i),))

    def report() -> dict:
        return {"graphs_captured": manager.session.graphs_captured, "graph_memory_bytes": manager.graph_memory()}

    if bench.device.type != "cuda":  # the manager runs the decoder eagerly: nothing to capture
        return Prepared(step)
    return Prepared(step, lambda: manager.capture(make_inputs, progress=False), report)


# -- breakable CUDA graphs: the peer library (PyPI breakable-cuda-graphs 0.1.0) ------------------


def import_peer():
    try:
        import breakable_cuda_graphs
    except ImportError as e:
        raise Unavailable(PEER_NOT_INSTALLED) from e
    return breakable_cuda_graphs


def peer_attention(no_graph) -> StateAttention:
    """state_attention for the peer library, whose @no_graph functions must not return
    CUDA tensors: the output buffer is allocated in the captured segment (so it is a
    static buffer in the pool) and the eager function writes into it."""

    @no_graph
    def attention_into(out, q, k, v, k_cache, v_cache, state: DecodeState) -> None:
        out.copy_(state_attention(q, k, v, k_cache, v_cache, state))

    def attention(q, k, v, k_cache, v_cache, state: DecodeState):
        out = torch.empty_like(q)  # [B, H, D]
        attention_into(out, q, k, v, k_cache, v_cache, state)
        return out

    return attention


class PeerGraphs:
    """The peer library's documented recipe, one BreakableCUDAGraph per capture size.

    Static ids per size; per size, largest first: warm up on a side stream, then capture
    `static_logits = decoder(static_ids)` into the pool all graphs share. Replay copies
    the ids into the padded static buffer and returns a copy of the logits.
    """

    def __init__(self, lib, decoder: HostStateDecoder, start: int, device: torch.device):
        self.lib = lib
        self.decoder = decoder
        self.start = start  # the cache length of warm-up and capture
        self.static_ids = {s: torch.zeros(s, dtype=torch.long, device=device) for s in CAPTURE_SIZES}  # [s]
        self.static_logits: dict[int, torch.Tensor] = {}  # size -> [size, vocab], in the pool
        self.graphs: dict = {}  # size -> BreakableCUDAGraph, in capture order

    def capture(self) -> None:
        self.decoder.state.start = self.start
        side = torch.cuda.Stream()
        for size in sorted(CAPTURE_SIZES, reverse=True):  # smaller sizes reuse the pool
            self._warm_up(size, side)
            self._capture(size)
        torch.cuda.synchronize()

    def _warm_up(self, size: int, side: torch.cuda.Stream) -> None:
        # On a side stream, as CUDA graphs require: lazy initialisation stays out of capture.
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.decoder(self.static_ids[size])
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self, size: int) -> None:
        first = next(iter(self.graphs.values()), None)
        graph = self.lib.BreakableCUDAGraph(pool=first.pool() if first is not None else None)
        with self.lib.breakable_graph(graph):
            self.static_logits[size] = self.decoder(self.static_ids[size])
        self.graphs[size] = graph

    def replay(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [B] -> logits [B, vocab]
        b = ids.shape[0]
        size = padded_size(b)
        static = self.static_ids[size]
        static[:b].copy_(ids)
        if b < size:
            static[b:].zero_()  # padding rows read token 0, as cgcompile pads
        self.graphs[size].replay()
        # A copy, like cgcompile's default (reuse_output_buffers=False), so that both
        # runners hand the caller logits the next step cannot overwrite: a fair comparison.
        return self.static_logits[size][:b].clone()

    def pool_bytes(self) -> int:
        """Bytes the shared pool holds now (its segments, used or cached)."""
        handle = tuple(next(iter(self.graphs.values())).pool()) if self.graphs else None
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == handle)


def prepare_peer_breakable(bench: Bench) -> Prepared:
    """breakable_cuda_graphs over the same eager decoder; on CPU the decoder runs eagerly."""
    lib = import_peer()
    state = DecodeState()
    decoder = HostStateDecoder(bench.llama, state, peer_attention(lib.no_graph))
    if bench.device.type != "cuda":
        return Prepared(lambda b, start, i: _eager_state_step(decoder, bench.inputs.ids(b, i), start))
    graphs = PeerGraphs(lib, decoder, capture_start(bench.cfg), bench.device)

    def step(b, start, i):
        state.start = start
        return graphs.replay(bench.inputs.ids(b, i))

    def report() -> dict:
        return {"graphs": len(graphs.graphs), "graph_memory_bytes": graphs.pool_bytes()}

    return Prepared(step, graphs.capture, report)


def _eager_state_step(decoder: HostStateDecoder, ids: torch.Tensor, start: int) -> torch.Tensor:
    decoder.state.start = start
    return decoder(ids)


VARIANTS = (
    Variant("eager", prepare_eager, False),
    Variant("compile-default", prepare_compile_default, False),
    Variant("reduce-overhead", prepare_reduce_overhead, True),
    Variant("cgcompile-eager", prepare_cgcompile("eager"), True),
    Variant("cgcompile-inductor", prepare_cgcompile("inductor"), True),
    Variant("cgcompile-inductor-stitch", prepare_cgcompile("inductor", plans=False), True),
    Variant("cgcompile-static", prepare_cgcompile_static(full=False), True),
    Variant("cgcompile-static-default", prepare_cgcompile_static(full=None), True),
    Variant("cgcompile-full", prepare_cgcompile_static(full=True), True),
    Variant("cgcompile-full-whole", prepare_cgcompile_static(full=True, whole=True), True),
    Variant("cgcompile-full-sq", prepare_cgcompile_static(full=True, small_query=True), True),
    Variant("cgcompile-full-whole-sq", prepare_cgcompile_static(full=True, whole=True, small_query=True), True),
    Variant("breakable", prepare_breakable, True),
    Variant("peer-breakable", prepare_peer_breakable, True),
    Variant("cgcompile-sizes", prepare_cgcompile("inductor", compile_sizes=COMPILE_SIZES), True),
    Variant("cgcompile-sizes-tuned", prepare_cgcompile(
        "inductor", compile_sizes=COMPILE_SIZES, size_inductor_options=TUNED_OPTIONS), True),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
