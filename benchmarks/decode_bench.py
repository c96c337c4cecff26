"""Decode-step benchmark for issue 3: cgcompile against eager, Inductor and a full CUDA graph.

One run times one decode step (one new token per sequence) of a Llama-like model with
random weights whose attention reads the cache length on the host, so attention can
never live in a CUDA graph:

    eager               the host-length model, plain PyTorch
    compile-default     torch.compile(host-length model), Inductor, no CUDA graphs
    reduce-overhead     torch.compile(static-mask model, mode="reduce-overhead"): the cache
                        length is a device tensor, every shape is static, and the whole step
                        is one CUDA graph. This is the full-graph ideal cgcompile aims at.
    cgcompile-eager     cgcompile, capturable pieces run as FX code under CUDA graphs
    cgcompile-inductor  cgcompile, capturable pieces compiled by Inductor under CUDA graphs

Usage (from the repository root, with cgcompile installed: `pip install -e . --no-deps`):

    python benchmarks/decode_bench.py                       # both models, all variants
    python benchmarks/decode_bench.py --model small --variants eager,cgcompile-inductor
    python benchmarks/decode_bench.py --device cpu --tiny   # smoke test without a GPU

Method, and why it is fair:
  - Both models share one set of weights and one KV cache. The cache is filled with
    random keys and values up to FILL_LEN once; every step writes at positions >= FILL_LEN,
    so the prefix every step reads is the same for every variant.
  - Ready time: wall time of the first READY_STARTS calls at every batch size, i.e.
    Dynamo tracing, compilation, warm-up and CUDA graph capture. Dynamo specialises the
    int `start` on the first call and makes it dynamic when it changes (automatic
    dynamic), so two different starts are needed before the compiled code is final;
    cudagraph trees need a third call (warm-up, record, replay).
  - Each variant compiles in a fresh Inductor cache (in memory and on disk), so its ready
    time is a cold compile that does not depend on the variants run before it. Pass
    --warm-cache to keep the caches (faster, but ready times then mean little).
  - Step time: after untimed warm-up steps, CUDA events around every step; the median
    is reported. Inputs (token ids, device positions) are built before timing.
  - Correctness: one step at start FILL_LEN per batch size, logits against eager.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

FILL_LEN = 256  # cache positions filled before any step; every step writes at >= this
CHECK_START = FILL_LEN  # the correctness step reads exactly the shared prefix
READY_STARTS = (FILL_LEN + 1, FILL_LEN + 2, FILL_LEN + 3)
TIMING_START = FILL_LEN + 4
TIMING_SPAN = 60  # timed steps cycle over starts TIMING_START .. TIMING_START + 59
MEMORY_START = FILL_LEN + 100
WARMUP_STEPS = 3
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)
REL_ERR_FLAG = 2e-2
SPLIT_OP = "cgbench::decode_attention"


# -- model ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000
    max_batch: int = 64
    max_len: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODEL_CONFIGS = {
    "1b": ModelConfig(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=8192),
    "small": ModelConfig(hidden=512, layers=16, heads=8, kv_heads=4, intermediate=1536),
    "tiny": ModelConfig(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # x: [T, hidden]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    """Projections, MLP and KV cache of one layer; attention is left to the caller.

    The layer stops before attention and resumes after it, so the host-length and the
    static-mask model can run the same weights with different attention code.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        qkv_out = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, qkv_out, bias=False)  # fused q, k, v
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)  # fused gate, up
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)
        cache_shape = (cfg.max_batch, cfg.kv_heads, cfg.max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)

    def qkv_heads(self, x):  # x: [T, hidden] -> q: [T, H, D], k, v: [T, KV, D]
        c = self.cfg
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1
        )
        t = x.shape[0]
        return q.view(t, c.heads, c.head_dim), k.view(t, c.kv_heads, c.head_dim), v.view(t, c.kv_heads, c.head_dim)

    def finish(self, x, attn):  # x: [T, hidden], attn: [T, H, D] -> [T, hidden]
        x = x + self.o_proj(attn.reshape(x.shape[0], -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """Weights and KV caches; the two decoders below share one instance.

    No rotary embedding: it would need the position inside the capturable pieces, which the
    host-length model only has as a host int. Leaving it out keeps both models identical.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def logits(self, x):  # x: [T, hidden] -> [T, vocab]
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def fill_caches(self, length: int, seed: int = 0) -> None:
        """Random keys and values at positions < length, zeros after (deterministic)."""
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for layer in self.layers:
            for cache in (layer.k_cache, layer.v_cache):
                cache.zero_()
                cache[:, :, :length].normal_(generator=gen)


def grouped_attention(q, k, v, mask=None):
    """One query token per sequence attending over S cached positions, with GQA.

    q: [B, H, D], k/v: [B, KV, S, D], mask: [1, 1, 1, S] bool or None -> [B, H, D].
    The H // KV query heads that share a kv head become that head's "query positions",
    so no kv head is repeated. Query head h uses kv head h // (H // KV).
    """
    b, h, d = q.shape
    kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, attn_mask=mask)
    return out.reshape(b, h, d)


@torch.library.custom_op(SPLIT_OP, mutates_args=("k_cache", "v_cache"))
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
) -> torch.Tensor:
    """Write k, v at position `start`, attend over positions 0..start (host-side length).

    q: [B, H, D], k/v: [B, KV, D], caches: [B_max, KV, L, D] -> [B, H, D].
    """
    b = q.shape[0]
    k_cache[:b, :, start] = k
    v_cache[:b, :, start] = v
    return grouped_attention(q, k_cache[:b, :, : start + 1], v_cache[:b, :, : start + 1])


@decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, start):
    return q.new_empty(q.shape)


def static_attention(q, k, v, k_cache, v_cache, pos):
    """The same step with every shape static: pos is a [1] device tensor.

    The write is an index_put_ at a device position and attention runs over the whole
    cache with a mask built on the device, so the step never reads the length on the host.
    The write indexes the whole cache rather than a slice `cache[:B]`: functionalization
    turns a write into a slice of a buffer into a copy of the whole slice, which Inductor
    keeps (a [B, KV, L, D] copy per layer); a write into the buffer itself is done in place.
    """
    b = q.shape[0]
    rows = torch.arange(b, device=pos.device)  # [B]
    k_cache[rows, :, pos] = k  # rows and pos broadcast to [B]: writes k [B, KV, D]
    v_cache[rows, :, pos] = v
    mask = (torch.arange(k_cache.shape[2], device=pos.device) <= pos).view(1, 1, 1, -1)  # [1, 1, 1, L]
    return grouped_attention(q, k_cache[:b], v_cache[:b], mask)


class HostLengthDecoder(nn.Module):
    """ids: [B], start: host int (cache length) -> logits [B, vocab]."""

    def __init__(self, llama: Llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids, start: int):
        x = self.llama.embed(ids)
        for layer in self.llama.layers:
            q, k, v = layer.qkv_heads(x)
            attn = torch.ops.cgbench.decode_attention(q, k, v, layer.k_cache, layer.v_cache, start)
            x = layer.finish(x, attn)
        return self.llama.logits(x)


class StaticMaskDecoder(nn.Module):
    """ids: [B], pos: [1] int64 device tensor (cache length) -> logits [B, vocab]."""

    def __init__(self, llama: Llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids, pos):
        x = self.llama.embed(ids)
        for layer in self.llama.layers:
            q, k, v = layer.qkv_heads(x)
            x = layer.finish(x, static_attention(q, k, v, layer.k_cache, layer.v_cache, pos))
        return self.llama.logits(x)


# -- inputs --------------------------------------------------------------------------------


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


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclasses.dataclass
class Bench:
    """One model under test: shared weights, both decoders, inputs and eager references."""

    name: str
    cfg: ModelConfig
    llama: Llama
    host: HostLengthDecoder
    static: StaticMaskDecoder
    inputs: DecodeInputs
    device: torch.device
    references: dict[int, torch.Tensor]  # batch -> eager logits at CHECK_START, float32


def build_bench(name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, batches) -> Bench:
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):  # no float32 copy of the weights
        llama = Llama(cfg).eval()
    llama.fill_caches(FILL_LEN)
    host, static = HostLengthDecoder(llama), StaticMaskDecoder(llama)
    inputs = DecodeInputs(cfg.vocab, device)
    with torch.no_grad():
        refs = {b: host(inputs.ids(b, 0), CHECK_START).float() for b in batches}
    return Bench(name, cfg, llama, host, static, inputs, device, refs)


# -- variants ------------------------------------------------------------------------------

Step = Callable[[int, int, int], torch.Tensor]  # (batch, start, i) -> logits


@dataclasses.dataclass
class Prepared:
    step: Step
    backend: object | None = None  # the cgcompile.Backend, for its stats


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


def cgcompile_config(compiler: str):
    import cgcompile

    return cgcompile.Config(compiler=compiler, splitting_ops=(SPLIT_OP,), capture_sizes=CAPTURE_SIZES)


def prepare_cgcompile(compiler: str) -> Callable[[Bench], Prepared]:
    def prepare(bench: Bench) -> Prepared:
        import cgcompile

        backend = cgcompile.Backend(cgcompile_config(compiler))
        compiled = torch.compile(bench.host, backend=backend)
        return Prepared(lambda b, start, i: compiled(bench.inputs.ids(b, i, marked=True), start), backend)

    return prepare


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    prepare: Callable[[Bench], Prepared]
    cuda_graphs: bool  # on CPU it still runs, without CUDA graphs


VARIANTS = (
    Variant("eager", prepare_eager, False),
    Variant("compile-default", prepare_compile_default, False),
    Variant("reduce-overhead", prepare_reduce_overhead, True),
    Variant("cgcompile-eager", prepare_cgcompile("eager"), True),
    Variant("cgcompile-inductor", prepare_cgcompile("inductor"), True),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
MEMORY_STEP = "memory"  # --variants name of the capture memory check


# -- measurement ---------------------------------------------------------------------------


@dataclasses.dataclass
class VariantResult:
    name: str
    ms_per_step: dict[int, float] = dataclasses.field(default_factory=dict)  # median, per batch
    ms_mean: dict[int, float] = dataclasses.field(default_factory=dict)  # N steps back to back / N
    ready_s: float | None = None  # first calls at every batch size: trace + compile + capture
    checks: dict[int, dict] = dataclasses.field(default_factory=dict)  # batch -> logits vs eager
    dynamo_graphs: int | None = None  # graphs Dynamo compiled for this variant
    recompiles_while_timing: int | None = None  # should be 0
    cgcompile: dict | None = None  # backend stats, pool bytes, pieces
    wall_s: float | None = None  # everything this variant took, timing included
    error: str | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dynamo_graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def timing_start(k: int) -> int:
    return TIMING_START + k % TIMING_SPAN


def measure_ready(step: Step, batches, device) -> float:
    """Wall seconds of the first calls at every batch size, until the variant is warm."""
    t0 = time.perf_counter()
    for b in batches:
        for k, start in enumerate(READY_STARTS):
            step(b, start, k)
    synchronize(device)
    return time.perf_counter() - t0


def time_steps(step: Step, batch: int, steps: int, device) -> tuple[list[float], float]:
    """Per-step milliseconds of `steps` timed steps, and the back-to-back mean."""
    for k in range(WARMUP_STEPS):
        step(batch, timing_start(k), k)
    if device.type != "cuda":
        return _time_steps_host(step, batch, steps)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    synchronize(device)
    for k, (begin, end) in enumerate(events):
        begin.record()
        step(batch, timing_start(k), k)
        end.record()
    torch.cuda.synchronize(device)
    per_step = [begin.elapsed_time(end) for begin, end in events]
    return per_step, events[0][0].elapsed_time(events[-1][1]) / steps


def _time_steps_host(step: Step, batch: int, steps: int) -> tuple[list[float], float]:
    per_step = []
    for k in range(steps):
        t0 = time.perf_counter()
        step(batch, timing_start(k), k)
        per_step.append((time.perf_counter() - t0) * 1e3)
    return per_step, sum(per_step) / steps


def compare_logits(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """out: [B, vocab] logits of one step, ref: eager's in float32."""
    diff = out.float() - ref
    rel = (diff.norm() / ref.norm().clamp_min(1e-12)).item()
    return {"max_abs": diff.abs().max().item(), "rel_err": rel, "flagged": rel > REL_ERR_FLAG}


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


@torch.no_grad()
def run_variant(variant: Variant, bench: Bench, batches, steps: int) -> VariantResult:
    """Prepare, warm up (timed as ready time), check against eager, then time every batch."""
    result = VariantResult(variant.name)
    t0, graphs_before = time.perf_counter(), dynamo_graph_count()
    prepared = variant.prepare(bench)
    result.ready_s = measure_ready(prepared.step, batches, bench.device)
    log(f"  {variant.name}: ready in {result.ready_s:.1f}s")
    result.checks = {b: compare_logits(prepared.step(b, CHECK_START, 0), bench.references[b]) for b in batches}
    graphs_before_timing = dynamo_graph_count()
    for b in batches:
        per_step, result.ms_mean[b] = time_steps(prepared.step, b, steps, bench.device)
        result.ms_per_step[b] = statistics.median(per_step)
        log_batch(result, b)
    result.recompiles_while_timing = dynamo_graph_count() - graphs_before_timing
    result.dynamo_graphs = dynamo_graph_count() - graphs_before
    if prepared.backend is not None:
        result.cgcompile = cgcompile_report(prepared.backend)
        log(f"  {variant.name}: {result.cgcompile}")
    result.wall_s = time.perf_counter() - t0
    return result


def log_batch(result: VariantResult, batch: int) -> None:
    check = result.checks[batch]
    flag = f"  FLAG: rel err > {REL_ERR_FLAG:.0e}" if check["flagged"] else ""
    log(f"  {result.name}: B={batch:<3} {result.ms_per_step[batch]:8.3f} ms/step  "
        f"logits vs eager: max abs {check['max_abs']:.3g}, rel {check['rel_err']:.3g}{flag}")


# -- capture memory --------------------------------------------------------------------------


@torch.no_grad()
def memory_check(bench: Bench) -> dict:
    """Pool bytes for every capture size against the pool for the largest size alone.

    Both profiles run on one fresh backend, before any lazy capture (as
    profile_capture_memory requires). Every call uses the same start, so the warm-up
    and the capture call of a size run the same Dynamo graph: the capture never runs
    a piece that was not warmed up first.
    """
    import cgcompile

    torch._dynamo.reset()
    backend = cgcompile.Backend(cgcompile_config("inductor"))
    compiled = torch.compile(bench.host, backend=backend)

    def make_inputs(size: int, warmup: bool):
        return bench.inputs.ids(size, 0, marked=True), MEMORY_START

    t0 = time.perf_counter()
    largest = backend.profile_capture_memory(compiled, make_inputs, sizes=(max(CAPTURE_SIZES),))
    t1 = time.perf_counter()
    every = backend.profile_capture_memory(compiled, make_inputs, sizes=CAPTURE_SIZES)
    t2 = time.perf_counter()
    ratio = every.bytes / largest.bytes if largest.bytes else math.nan
    return {
        "largest_size": max(CAPTURE_SIZES), "largest_bytes": largest.bytes, "largest_graphs": largest.graphs,
        "all_sizes": list(CAPTURE_SIZES), "all_bytes": every.bytes, "all_graphs": every.graphs,
        "ratio": ratio, "target": 1.25, "passed": ratio <= 1.25,
        "first_profile_s": t1 - t0, "all_sizes_profile_s": t2 - t1,
    }


# -- report ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    value: float | None
    limit: float
    passed: bool | None  # None: a variant it needs was not run or failed


def _ok(results: dict[str, VariantResult], *names) -> bool:
    return all(n in results and results[n].error is None for n in names)


def evaluate_targets(results: dict[str, VariantResult], batches) -> list[Target]:
    """The three targets of issue 3, as ratios within this run."""
    cg, ro, eager = "cgcompile-inductor", "reduce-overhead", "eager"
    step_ratio = ready_ratio = speed_up = None
    if _ok(results, cg, ro):
        step_ratio = max(results[cg].ms_per_step[b] / results[ro].ms_per_step[b] for b in batches)
        ready_ratio = results[cg].ready_s / results[ro].ready_s
    if _ok(results, cg, eager) and 1 in batches:
        speed_up = results[eager].ms_per_step[1] / results[cg].ms_per_step[1]
    return [
        _target("cgcompile-inductor step <= 1.15x reduce-overhead at every batch", step_ratio, 1.15, at_most=True),
        _target("cgcompile-inductor >= 3.5x faster than eager at B=1", speed_up, 3.5, at_most=False),
        _target("cgcompile-inductor ready time <= 0.5x reduce-overhead warm-up", ready_ratio, 0.5, at_most=True),
    ]


def _target(name: str, value: float | None, limit: float, at_most: bool) -> Target:
    if value is None:
        return Target(name, None, limit, None)
    return Target(name, value, limit, value <= limit if at_most else value >= limit)


def _ratios(results, name, base, batches, invert=False) -> str:
    if not _ok(results, name, base):
        return "-"
    r, b_ = results[name].ms_per_step, results[base].ms_per_step
    return "/".join(f"{(b_[b] / r[b]) if invert else (r[b] / b_[b]):.2f}" for b in batches)


def format_table(results: dict[str, VariantResult], batches) -> str:
    ms_cols = [f"B={b} ms" for b in batches]
    batch_list = "/".join(map(str, batches))
    header = ["variant", *ms_cols, f"x RO ({batch_list})", f"speed-up vs eager ({batch_list})", "ready s"]
    rows = [header]
    for name, r in results.items():
        if r.error is not None:
            rows.append([name, *(["error"] * len(batches)), "-", "-", "-"])
            continue
        rows.append([
            name,
            *(f"{r.ms_per_step[b]:.3f}" for b in batches),
            _ratios(results, name, "reduce-overhead", batches),
            _ratios(results, name, "eager", batches, invert=True),
            f"{r.ready_s:.1f}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def format_targets(targets: list[Target]) -> str:
    lines = []
    for t in targets:
        verdict = "n/a" if t.passed is None else ("PASS" if t.passed else "FAIL")
        value = "-" if t.value is None else f"{t.value:.3f}"
        lines.append(f"  [{verdict}] {t.name}: {value} (limit {t.limit})")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
    }
    with contextlib.suppress(Exception):
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    return env


# -- driver ----------------------------------------------------------------------------------


_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def compile_cache_scope(warm: bool):
    """A fresh Inductor cache (disk and memory) for one variant, unless --warm-cache."""
    if warm:
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def release_memory(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def guarded(what: str, fn: Callable):
    """(fn(), None), or (None, the error in words) when fn raises; the run goes on either way."""
    try:
        return fn(), None
    except Exception as e:  # one failing variant must not stop the others
        traceback.print_exc()
        log(f"  {what} FAILED: {type(e).__name__}: {e}")
        return None, f"{type(e).__name__}: {e}"


def run_model(name: str, cfg: ModelConfig, args, report: dict, write: Callable[[], None]) -> None:
    log(f"model {name}: building ({cfg})")
    bench = build_bench(name, cfg, args.device, args.dtype, args.batches)
    params = sum(p.numel() for p in bench.llama.parameters())
    model_report = report["models"][name] = {"config": dataclasses.asdict(cfg), "params": params, "variants": {}}
    log(f"model {name}: {params / 1e9:.3f}B parameters, eager references at start {CHECK_START}")
    results: dict[str, VariantResult] = {}
    for variant in (v for v in VARIANTS if v.name in args.variants):
        results[variant.name] = run_one_variant(variant, bench, args, model_report)
        write()
    if MEMORY_STEP in args.variants and "cgcompile-inductor" not in args.variants:
        with compile_cache_scope(args.warm_cache):
            run_memory_check(bench, args, model_report)
    finish_model(name, results, args.batches, model_report)
    write()
    del bench
    release_memory(args.device)


def run_one_variant(variant: Variant, bench: Bench, args, model_report: dict) -> VariantResult:
    log(f"model {bench.name}: variant {variant.name}")
    if variant.cuda_graphs and args.device.type != "cuda":
        log(f"  {variant.name}: no CUDA here, so it runs without CUDA graphs")
    with compile_cache_scope(args.warm_cache):
        result, error = guarded(variant.name, lambda: run_variant(variant, bench, args.batches, args.steps))
        if variant.name == "cgcompile-inductor" and MEMORY_STEP in args.variants:
            release_memory(args.device)  # same Inductor cache: its pieces are not compiled again
            run_memory_check(bench, args, model_report)
    result = result or VariantResult(variant.name, error=error)
    model_report["variants"][variant.name] = dataclasses.asdict(result)
    release_memory(args.device)
    return result


def run_memory_check(bench: Bench, args, model_report: dict) -> None:
    if args.device.type != "cuda":
        log("  memory check skipped: it measures the CUDA graph pool")
        return
    log(f"model {bench.name}: capture memory check")
    memory, error = guarded("memory check", lambda: memory_check(bench))
    model_report["memory"] = memory or {"error": error}
    if memory:
        verdict = "PASS" if memory["passed"] else "FAIL"
        log(f"  pool for all sizes {memory['all_bytes'] / 2**20:.1f} MiB vs largest only "
            f"{memory['largest_bytes'] / 2**20:.1f} MiB: ratio {memory['ratio']:.3f} [{verdict}, <= 1.25]")
    release_memory(args.device)


def finish_model(name: str, results: dict[str, VariantResult], batches, model_report: dict) -> None:
    targets = evaluate_targets(results, batches)
    model_report["targets"] = [dataclasses.asdict(t) for t in targets]
    print(f"\n== {name}: median ms per decode step ==", flush=True)
    print(format_table(results, batches), flush=True)
    if "memory" in model_report and "ratio" in model_report["memory"]:
        m = model_report["memory"]
        print(f"capture pool: all sizes / largest = {m['ratio']:.3f} (target <= 1.25)", flush=True)
    print("targets:\n" + format_targets(targets) + "\n", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("1b", "small", "both"), default="both")
    p.add_argument("--steps", type=int, default=None, help="timed steps per batch size (50; 2 with --tiny)")
    p.add_argument("--batches", default="1,8,64", help="comma list of batch sizes (<= 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model, 2 steps unless --steps (smoke test)")
    p.add_argument("--variants", default=",".join(VARIANT_NAMES + (MEMORY_STEP,)),
                   help=f"comma list from {', '.join(VARIANT_NAMES + (MEMORY_STEP,))}")
    p.add_argument("--warm-cache", action="store_true", help="keep Inductor caches between variants")
    default_out = os.path.join(os.environ["OUT"], "decode_bench.json") if os.environ.get("OUT") else "decode_bench.json"
    p.add_argument("--out", default=default_out)
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = sorted(set(args.variants) - set(VARIANT_NAMES + (MEMORY_STEP,)))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {VARIANT_NAMES + (MEMORY_STEP,)}")
    if max(args.batches) > max(CAPTURE_SIZES):
        p.error(f"--batches: expected sizes <= {max(CAPTURE_SIZES)} (the KV cache's batch), got {args.batches}")
    if args.steps is None:
        args.steps = 2 if args.tiny else 50
    return args


def model_names(args) -> list[str]:
    if args.tiny:
        return ["tiny"]
    return ["small", "1b"] if args.model == "both" else [args.model]  # small first: results sooner


def main(argv=None) -> int:
    args = parse_args(argv)
    report = {"env": environment(args.device), "args": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    log(f"decode bench on {report['env']['device']}, torch {torch.__version__}; writing {args.out}")
    try:
        import cgcompile  # noqa: F401
    except ImportError as e:
        log(f"cannot import cgcompile ({e}); its variants will fail. Run `pip install -e . --no-deps` first")

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)

    for name in model_names(args):
        run_model(name, MODEL_CONFIGS[name], args, report, write)
    write()
    log(f"done; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
