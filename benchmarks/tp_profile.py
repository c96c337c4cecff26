"""Where a tensor-parallel decode step's GPU time goes: kernels by total time, per rank.

    torchrun --nproc-per-node 2 benchmarks/tp_profile.py [--model 8b] [--batch 1] [--variant full-sq] [--tp-head vocab]

Builds `TensorParallelDecoder` as `distributed_bench.py` does (the 70b class shard by shard), compiles it with the
variant's Config (the LM head split by vocabulary, or replicated with `--tp-head replicated`),
warms it up, then runs `--steps` decode steps under torch.profiler.
Each rank prints its step time (CUDA events), the sum of kernel time per step, the
largest kernels by total time with their count per step, and the all-reduce decisions
(`all_reduce_report`). Kernel time far below the step time means the step waits on the
host or on the other rank; an all-reduce kernel that takes long is mostly waiting for
the slower rank to arrive. `--classes` adds the step by kernel class against the rank's
weight-bytes floor, and the GPU's idle time between kernels (`step_kernels.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import distributed_bench as bench  # noqa: E402
from benchmarks import harness  # noqa: E402
from cgcompile.parallel.distributed import prepare_collectives, torchrun_worker  # noqa: E402
from cgcompile.parallel.fast_all_reduce import all_reduce_report  # noqa: E402
from cgcompile.testing.decode_model import use_length_independent_attention_kernels  # noqa: E402
from cgcompile.testing.parallel_model import TensorParallelDecoder  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variant", default="full-sq", choices=["piecewise", "full", "full-sq"])
    p.add_argument("--all-reduce", default="auto", choices=["auto", "nccl"])
    p.add_argument("--tp-head", default="vocab", choices=["vocab", "replicated"],
                   help="TensorParallelDecoder's LM head: split by vocabulary or replicated on every rank")
    p.add_argument("--no-fuse-norm", action="store_true", help="Config(fuse_all_reduce_norm=False)")
    p.add_argument("--no-skinny", action="store_true", help="Config(skinny_linears=False)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--classes", action="store_true",
                   help="also the step by kernel class beside the rank's floor, and the idle time between kernels")
    return p.parse_args()


def compiled_step(model, device, variant):
    if variant == "piecewise":
        return torch.compile(model, backend=bench.make_backend(device)), False
    backend = bench.make_backend(device, full=True, small_query=variant == "full-sq")
    return torch.compile(model, backend=backend, dynamic=False), True


def kernel_table(prof, steps: int, top: int) -> list[str]:
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in kernels) / steps
    lines = [f"kernel time per step {total / 1e3:.3f} ms over {sum(e.count for e in kernels) / steps:.0f} kernels"]
    for e in kernels[:top]:
        lines.append(f"  {e.device_time_total / steps / 1e3:7.3f} ms  x{e.count / steps:5.1f}  {e.key[:90]}")
    return lines


def class_table(prof, steps: int, model, device) -> list[str]:
    """The profiled steps by kernel class (`step_kernels.classify`), matrix products against
    the rank's weight bytes. Inside a full graph nothing runs on the host, so attention is
    found by its kernels' names."""
    from benchmarks import step_kernels

    trace = step_kernels.trace_of(prof)
    peak, nbytes = harness.measure_peak_bandwidth(device), bench.weight_bytes(model)
    breakdown = step_kernels.classify(trace, steps, ("attention", "scaled_dot_product"), {"gemm": nbytes}, peak)
    return step_kernels.format_breakdown(breakdown, harness.floor_ms(nbytes, peak), peak).splitlines()


def main():
    args = parse_args()
    bench.ALL_REDUCE, bench.FUSE_NORM, bench.SKINNY = args.all_reduce, not args.no_fuse_norm, not args.no_skinny
    with torchrun_worker("cuda") as device, torch.inference_mode():
        use_length_independent_attention_kernels()
        cfg = bench.CONFIGS[args.model]
        if args.model in bench.SHARD_ONLY:  # no rank holds the whole model: each builds its shard
            model = bench.build_shard(cfg, device, torch.bfloat16, args.tp_head)
        else:
            llama = bench.build_llama(cfg, device, torch.bfloat16)
            model = TensorParallelDecoder(llama, head=args.tp_head)
            del llama
        prepare_collectives(device, all_reduce=args.all_reduce)
        step, device_position = compiled_step(model, device, args.variant)
        ids = torch.arange(args.batch, device=device) % 100
        starts = [bench.FILL + k for k in range(64)]
        if device_position:
            starts = [torch.tensor([s], device=device) for s in starts]
        ms = harness.time_steps(lambda k: step(ids, starts[k]), 20, 5, device)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if args.classes:  # the launches too: step_kernels tells graph replays from eager launches by them
            activities.append(torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=activities) as prof:
            for k in range(args.steps):
                step(ids, starts[20 + k])
            torch.cuda.synchronize()
        lines = [f"rank {dist.get_rank()} {args.model} batch {args.batch} {args.variant} head={args.tp_head} "
                 f"all_reduce={args.all_reduce} fuse_norm={bench.FUSE_NORM}: step {statistics.median(ms):.3f} ms"]
        lines += kernel_table(prof, args.steps, args.top)
        if args.classes:
            lines += class_table(prof, args.steps, model, device)
        if dist.get_rank() == 0:
            report = all_reduce_report()
            lines += report.lines()[:4] + [line for line in report.lines() if line.startswith("all-reduce calls")]
        for rank in range(dist.get_world_size()):
            dist.barrier()
            if rank == dist.get_rank():
                print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
