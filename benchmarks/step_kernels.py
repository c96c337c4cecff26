"""Where the GPU time of a decode step goes: kernel classes against the bandwidth floor.

Reads a torch.profiler chrome trace (`prof.export_chrome_trace`) of N steps and splits
the GPU time into classes, each with the bytes it must move per step where that is known:

    gemm        matrix products (cuBLAS, CUTLASS, Triton mm templates, the skinny linear kernels (the SiLU-gated one
                too), and Inductor reductions
                that multiply and sum, `Config.matvec_as_reduction`'s one-row linears, with
                whatever Inductor fused into them): every weight matrix is read once per step,
                so their bytes are the matmul weights
    attention   kernels launched while the attention op ran on the host (found through
                the launch's correlation id), or named as attention kernels (flash, fmha:
                inside a full graph nothing runs on the host): the KV cache read per step
    copy        memcpy/memset and copy kernels (graph input copies, output clones)
    collective  all-reduces and other collectives (NCCL's kernels, symmetric memory's
                one- and two-shot kernels, cgcompile's Lamport kernels, the one fused with
                the residual add and RMS norm included): on several GPUs, their time
                includes waiting for the slowest rank
    elementwise everything else (norms, activations, rotary, fused Triton pointwise)

and the gaps between consecutive kernels, by what launched the kernels on either side
(a CUDA graph replay or an eager launch): graph->eager and eager->graph are the piece
boundaries, graph->graph the gaps between two replays.

Pure: parsing and arithmetic only (stdlib), so tests check it on a hand-made trace;
`trace_of` reads a profiler run's trace.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile

KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GEMM = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|_mm_|tem_fused|mm_kernel|bmm|matmul|skinny_linear|silu_mul_linear", re.I)
ATTENTION = re.compile(r"flash|fmha|attention|sdpa|combine_splits", re.I)  # combine_splits: decode_attention's
MATVEC = re.compile(r"^triton_(red|per)_fused\w*(mul\w*_sum|sum\w*_mul)")  # a product written as a reduction
COPY = re.compile(r"copy|memcpy|memset|fill", re.I)
DTYPE_CAST = "_to_copy"  # in Inductor's kernel names a dtype conversion, not a copy kernel
COLLECTIVE = re.compile(r"nccl|all_reduce|allreduce|all_gather|allgather|reduce_scatter|one_shot|two_shot|lamport",
                        re.I)  # lamport: cgcompile's all-reduce kernels, the one fused with the add and norm too
GRAPH_LAUNCH = "cudaGraphLaunch"


@dataclasses.dataclass(frozen=True)
class KernelClass:
    """One class of a step's kernels (gemm, attention, copy, elementwise), per step."""

    name: str
    ms_per_step: float
    kernels_per_step: float
    bytes_per_step: int | None  # what the class must move; None where not modelled
    gbs: float | None  # achieved: bytes / time
    of_peak: float | None  # gbs / peak


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """A trace's GPU time per step: kernels, span, idle gaps by boundary, and the classes."""

    steps: int
    kernel_ms_per_step: float  # sum of kernel durations
    span_ms_per_step: float  # first kernel start to last kernel end, per step
    gap_ms_per_step: dict[str, float]  # idle GPU time between kernels, by boundary kind
    classes: list[KernelClass]


def trace_of(prof) -> dict:
    """The chrome trace of a finished `torch.profiler.profile` run, as `classify` reads it."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            return json.load(trace_file)


def classify(trace: dict, steps: int, attention_ops: tuple[str, ...], bytes_per_class: dict[str, int],
             peak_gbs: float) -> StepBreakdown:
    """The breakdown of a trace of `steps` steps; `attention_ops` are host op names (substrings)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = sorted((e for e in events if e.get("cat") in KERNEL_CATS), key=lambda e: e["ts"])
    launches = {_correlation(e): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ranges = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") == "cpu_op" and any(op in e.get("name", "") for op in attention_ops)]
    totals: dict[str, list[float]] = {}
    for kernel in kernels:
        launch = launches.get(_correlation(kernel))
        totals.setdefault(_class_of(kernel, launch, ranges), []).append(kernel.get("dur", 0))
    classes = [_summarise(name, durs, steps, bytes_per_class.get(name), peak_gbs) for name, durs in sorted(totals.items())]
    span = (kernels[-1]["ts"] + kernels[-1].get("dur", 0) - kernels[0]["ts"]) if kernels else 0.0
    return StepBreakdown(
        steps, sum(k.get("dur", 0) for k in kernels) / 1e3 / steps, span / 1e3 / steps,
        {kind: us / 1e3 / steps for kind, us in _gaps(kernels, launches).items()}, classes,
    )


def _correlation(event: dict):
    return (event.get("args") or {}).get("correlation")


def _class_of(kernel: dict, launch: dict | None, attention_ranges: list[tuple[float, float]]) -> str:
    if launch is not None and any(lo <= launch["ts"] <= hi for lo, hi in attention_ranges):
        return "attention"
    name = kernel.get("name", "")
    if ATTENTION.search(name):
        return "attention"
    if COLLECTIVE.search(name):
        return "collective"
    if MATVEC.search(name):
        return "gemm"
    if kernel["cat"] != "kernel" or COPY.search(name.replace(DTYPE_CAST, "")) and not GEMM.search(name):
        return "copy"
    return "gemm" if GEMM.search(name) else "elementwise"


def _source(kernel: dict, launches: dict) -> str:
    launch = launches.get(_correlation(kernel))
    return "graph" if launch is not None and GRAPH_LAUNCH in launch.get("name", "") else "eager"


def _gaps(kernels: list[dict], launches: dict) -> dict[str, float]:
    """Idle microseconds between consecutive kernels (one stream assumed), by boundary kind."""
    gaps: dict[str, float] = {}
    for prev, nxt in zip(kernels, kernels[1:]):
        idle = nxt["ts"] - (prev["ts"] + prev.get("dur", 0))
        if idle > 0:
            kind = f"{_source(prev, launches)}->{_source(nxt, launches)}"
            gaps[kind] = gaps.get(kind, 0.0) + idle
    return gaps


def _summarise(name: str, durations_us: list[float], steps: int, nbytes: int | None, peak_gbs: float) -> KernelClass:
    ms = sum(durations_us) / 1e3 / steps
    gbs = nbytes / (ms / 1e3) / 1e9 if nbytes and ms > 0 else None
    return KernelClass(name, ms, len(durations_us) / steps, nbytes, gbs, gbs / peak_gbs if gbs else None)


def format_breakdown(b: StepBreakdown, floor_ms: float, peak_gbs: float) -> str:
    lines = [f"per step: kernels {b.kernel_ms_per_step:.3f} ms, GPU span {b.span_ms_per_step:.3f} ms, "
             f"floor {floor_ms:.3f} ms (weights at {peak_gbs:.0f} GB/s)",
             f"{'class':<12} {'ms/step':>8} {'kernels':>8} {'MB/step':>9} {'GB/s':>8} {'of peak':>8}"]
    for c in b.classes:
        mb = "-" if c.bytes_per_step is None else f"{c.bytes_per_step / 1e6:.1f}"
        gbs = "-" if c.gbs is None else f"{c.gbs:.0f}"
        of_peak = "-" if c.of_peak is None else f"{c.of_peak:.0%}"
        lines.append(f"{c.name:<12} {c.ms_per_step:8.3f} {c.kernels_per_step:8.1f} {mb:>9} {gbs:>8} {of_peak:>8}")
    gaps = ", ".join(f"{kind} {ms:.3f} ms" for kind, ms in sorted(b.gap_ms_per_step.items())) or "none"
    lines.append(f"GPU idle between kernels per step: {gaps}")
    return "\n".join(lines)
