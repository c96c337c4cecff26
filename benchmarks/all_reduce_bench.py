"""One captured all-reduce, NCCL against cgcompile's fast path (torch symmetric memory) and
against the fast path with the Lamport kernel.

    torchrun --nproc-per-node 2 benchmarks/all_reduce_bench.py [--rows 1,8,64,256,1024] [--json out.json]

For each size [rows, hidden] bf16 and each path, `--per-graph` all-reduces are captured
in one CUDA graph (as a decode step's pieces hold them) and the graph is replayed; the time
per all-reduce is the median replay over `--per-graph`. "fast" is the op the graph rewrite
inserts, `cgcompile::all_reduce`, on a group set up with all_reduce="symm_mem" (torch's
one-shot, two-shot or NCCL by size, see `cgcompile.parallel.all_reduce_choice`); "lamport"
is the same op on a second group over the same ranks set up with all_reduce="auto", the
default (`cgcompile.parallel.lamport_all_reduce` up to 64 KiB, then as "fast");
"nccl" is `funcol.all_reduce` + wait, what the model's collective is without the rewrite.
Each rank checks that every path sums like NCCL, bit for bit. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cgcompile.parallel.all_reduce_choice import kind_for_call  # noqa: E402
from cgcompile.parallel.distributed import prepare_collectives, setup_all_reduce, torchrun_worker  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,64,256,1024,1100")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--per-graph", type=int, default=64)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    return p.parse_args()


def fast(x, group_name):
    return torch.ops.cgcompile.all_reduce(x, "sum", group_name)


def nccl(x, group_name):
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))


def us_per_all_reduce(path, x, group_name, args) -> float:
    """Median replay time of a graph of `per_graph` all-reduces of `x` (one stream: serial), per
    all-reduce, as distributed_bench.py's all-reduce row measures NCCL; and the last result."""
    def chain():
        return [path(x, group_name) for _ in range(args.per_graph)][-1]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    times = []
    for _ in range(args.replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.per_graph)
    result = out.clone()
    graph.reset()  # before teardown: a live graph holding NCCL work blocks it
    return statistics.median(times), result


def set_up_groups(device):
    """The default group with torch's kernels only ("symm_mem"), and a second group over the
    same ranks as "auto" sets it up, with the Lamport kernel (a group's choice is made once)."""
    prepare_collectives(device, all_reduce="symm_mem")
    lamport_group = dist.new_group(list(range(dist.get_world_size())))
    prepare_collectives(device, lamport_group, all_reduce="auto")
    return {"fast": setup_all_reduce(device), "lamport": setup_all_reduce(device, lamport_group)}


def time_row(rows, choices, device, args) -> dict:
    """One size on every path: the time per all-reduce, each path's kind, all checked against NCCL."""
    x = torch.full((rows, args.hidden), float(dist.get_rank() + 1), device=device, dtype=torch.bfloat16)
    row = {"world": dist.get_world_size(), "rows": rows, "hidden": args.hidden, "dtype": "bf16", "bytes": x.numel() * 2}
    nccl_us, nccl_out = us_per_all_reduce(nccl, x, dist.group.WORLD.group_name, args)
    row["nccl_us"] = round(nccl_us, 2)
    for path, choice in choices.items():
        row[f"{path}_kind"], row[f"{path}_why"] = kind_for_call(choice, reduce_op="sum", dtype=x.dtype, numel=x.numel())
        path_us, path_out = us_per_all_reduce(fast, x, choice.group_name, args)
        torch.testing.assert_close(path_out, nccl_out, rtol=0, atol=0, msg=f"{path} at {rows} rows")
        row[f"{path}_us"], row[f"{path}_speedup"] = round(path_us, 2), round(nccl_us / path_us, 2)
    return row


def print_table(choices, rows_out) -> None:
    for path, choice in choices.items():
        print(f"{path} group choice: {choice}")
    print(f"{'rows':>6} {'bytes':>9} {'nccl us':>8} {'fast kind':>9} {'fast us':>8} {'x':>5} "
          f"{'lamport kind':>12} {'lamport us':>10} {'x':>5}")
    for r in rows_out:
        print(f"{r['rows']:>6} {r['bytes']:>9} {r['nccl_us']:>8} {r['fast_kind']:>9} {r['fast_us']:>8} "
              f"{r['fast_speedup']:>5} {r['lamport_kind']:>12} {r['lamport_us']:>10} {r['lamport_speedup']:>5}")


def main():
    args = parse_args()
    with torchrun_worker("cuda") as device, torch.inference_mode():
        choices = set_up_groups(device)
        rows_out = []
        for rows in map(int, args.rows.split(",")):
            rows_out.append(time_row(rows, choices, device, args))
            if dist.get_rank() == 0:
                print(json.dumps(rows_out[-1]), flush=True)
        if dist.get_rank() == 0:
            print_table(choices, rows_out)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"choices": {k: str(c) for k, c in choices.items()}, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
