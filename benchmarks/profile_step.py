"""Where the host time of one decode step goes: a profiling companion to decode_bench.py.

A step of a graph-replaying variant is host-bound when the Python that launches it
takes longer than the GPU work it launches. This script warms a variant up, then:

  - host ms per step: wall time of N steps issued back to back, taken before the final
    synchronize (the time the host needs to issue them), and the wall time after it;
  - cProfile of the same N steps: the functions with the most own time (tottime);
  - with --kernels (GPU): a torch.profiler table of the kernels, and the step's GPU time by
    kernel class (GEMM, attention, copies, elementwise) with each class's achieved bandwidth
    against the peak, and the idle GPU time between kernels by boundary (graph->eager, ...);
    see step_kernels.py. The chrome trace is kept as $OUT/trace_<variant>_B<batch>.json.

    python benchmarks/profile_step.py --model 1b --variants cgcompile-inductor --batches 1,8
    python benchmarks/profile_step.py --model 8b --variants cgcompile-inductor,reduce-overhead --kernels
    python benchmarks/profile_step.py --device cpu --tiny            # smoke test

With OUT set, each profile goes to $OUT/profile_<variant>_B<batch>.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench as bench_lib  # noqa: E402
import harness  # noqa: E402
import step_kernels  # noqa: E402

ATTENTION_OPS = ("decode_attention", "scaled_dot_product", "attention")  # host op names, substrings


def host_times(step, batch: int, steps: int, device) -> tuple[float, float]:
    """(host ms per step to issue `steps` steps, wall ms per step including the GPU)."""
    harness.synchronize(device)
    t0 = time.perf_counter()
    for k in range(steps):
        step(batch, bench_lib.timing_start(k), k)
    issued = time.perf_counter()
    harness.synchronize(device)
    done = time.perf_counter()
    return (issued - t0) * 1e3 / steps, (done - t0) * 1e3 / steps


def profile(step, batch: int, steps: int, device, top: int) -> str:
    profiler = cProfile.Profile()
    harness.synchronize(device)
    profiler.enable()
    for k in range(steps):
        step(batch, bench_lib.timing_start(k), k)
    harness.synchronize(device)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def kernel_report(step, batch: int, steps: int, top: int, bench, peak_gbs: float, trace_path: str) -> str:
    """GPU kernels of `steps` steps by total device time, and the step by kernel class."""
    import json

    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            step(batch, bench_lib.timing_start(k), k)
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        trace = json.load(f)
    floor = bench_lib.bandwidth_floor(bench, peak_gbs)
    bytes_per_class = {
        "gemm": harness.matmul_weight_bytes(bench.llama),
        "attention": batch * floor["kv_bytes_per_sequence"],
    }
    breakdown = step_kernels.classify(trace, steps, ATTENTION_OPS, bytes_per_class, peak_gbs)
    return (prof.key_averages().table(sort_by="cuda_time_total", row_limit=top) + "\n"
            + step_kernels.format_breakdown(breakdown, floor["floor_ms"], peak_gbs))


def run(args) -> None:
    bench_lib.use_length_independent_attention_kernels()
    torch._dynamo.config.recompile_limit = 64
    if args.kernels and args.device.type == "cuda" and args.peak_gbs is None:
        args.peak_gbs = harness.measure_peak_bandwidth(args.device)
        print(f"peak bandwidth: {args.peak_gbs:.0f} GB/s (measured: device-to-device copy)", flush=True)
    cfg = bench_lib.MODEL_CONFIGS["tiny" if args.tiny else args.model]
    bench = bench_lib.build_bench(args.model, cfg, args.device, torch.bfloat16 if args.device.type == "cuda" else torch.float32, args.batches)
    variants = {v.name: v for v in bench_lib.VARIANTS}
    for name in args.variants:
        torch._dynamo.reset()
        with torch.inference_mode():
            prepared = variants[name].prepare(bench)
            bench_lib.measure_ready(prepared, args.batches, args.device)
            for batch in args.batches:
                for k in range(bench_lib.WARMUP_STEPS):
                    prepared.step(batch, bench_lib.timing_start(k), k)
                host_ms, wall_ms = host_times(prepared.step, batch, args.steps, args.device)
                print(f"{name} B={batch}: host {host_ms:.3f} ms/step to issue, {wall_ms:.3f} ms/step wall", flush=True)
                windows = [host_times(prepared.step, batch, 50, args.device)[0] for _ in range(args.windows)]
                if windows:
                    print(f"  host ms/step in {args.windows} windows of 50 steps: "
                          + " ".join(f"{w:.2f}" for w in windows), flush=True)
                report = profile(prepared.step, batch, args.steps, args.device, args.top)
                if args.kernels and args.device.type == "cuda":
                    trace = os.path.join(os.environ.get("OUT", "."), f"trace_{name}_B{batch}.json")
                    report += "\n" + kernel_report(prepared.step, batch, 20, args.top, bench, args.peak_gbs, trace)
                print(report, flush=True)
                if os.environ.get("OUT"):
                    path = os.path.join(os.environ["OUT"], f"profile_{name}_B{batch}.txt")
                    with open(path, "w") as f:
                        f.write(f"host {host_ms:.3f} ms/step, wall {wall_ms:.3f} ms/step\n{report}")
        del prepared
        harness.release_memory(args.device)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=bench_lib.MODEL_CHOICES, default="1b")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak bandwidth for --kernels (default: measured)")
    p.add_argument("--variants", default="cgcompile-inductor")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--top", type=int, default=30, help="functions listed per profile")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--kernels", action="store_true",
                   help="also the GPU kernels: a torch.profiler table and the step by kernel class")
    p.add_argument("--windows", type=int, default=0, help="then host time in this many windows of 50 steps")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.variants = tuple(args.variants.split(","))
    if args.tiny:
        args.steps = min(args.steps, 5)
    return args


if __name__ == "__main__":
    run(parse_args())
