"""Every launch configuration of `skinny_linear`'s kernel on every weight shape a decoder has,
against cuBLAS: the data behind `cgcompile.kernels.skinny_linear.choose_launch`.

Each (shape, rows, launch) is timed as one CUDA graph of linears over distinct copies of
the weight, enough copies that the L2 cache holds none, and reported as a share of the
copy bandwidth. Outputs are checked against a float32 product first.

    python benchmarks/skinny_sweep.py --json /tmp/sweep.json            # GPU machine, ~4 min
    python benchmarks/skinny_sweep.py --shapes 1b-hf --rows 1 --quick

With --groups, a layer's sibling linears (q/k/v, gate/up: one input, several weights) instead:
cuBLAS per linear, the skinny kernel per linear, and `grouped_skinny_linear`'s one launch
for them all (`GROUPS`), each as one CUDA graph over copies of the weights as above.

    python benchmarks/skinny_sweep.py --groups 1b-hf,8b-tp2,8b-tp4 --json /tmp/groups.json   # ~1 min

--no-pdl launches every kernel without programmatic dependent launch, for a side by side run
with the default.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from harness import environment, log, measure_peak_bandwidth, synchronize, time_steps, write_json

from cgcompile.kernels.grouped_skinny_linear import grouped_kernel_call
from cgcompile.kernels.skinny_linear import Launch, choose_launch, skinny_linear_kernel_call

# (out_features, in_features) of one layer's linears as the models run them
SHAPES = {
    "1b-hf": [(2048, 2048), (256, 2048), (5632, 2048), (2048, 5632), (32000, 2048)],  # TinyLlama, unfused
    "1b-fused": [(2560, 2048), (11264, 2048)],  # the same with q/k/v and gate/up fused
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096), (14336, 4096)],
    "8b-tp2": [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)],
    "8b-tp4": [(1536, 4096), (4096, 1024), (7168, 4096), (4096, 3584)],
    "70b-tp4": [(2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168)],
    "1b-probe": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],  # hf_probe's 1b Llama, fused
    "heads": [(128256, 4096), (64128, 4096)],
}
# ((out_features of each sibling), in_features): q/k/v, then gate/up, of one layer
GROUPS = {
    "1b-hf": [((2048, 256, 256), 2048), ((5632, 5632), 2048)],  # TinyLlama: gate/up past MAX_FEATURES
    "1b": [((2048, 1024, 1024), 2048), ((8192, 8192), 2048)],
    "8b": [((4096, 1024, 1024), 4096), ((14336, 14336), 4096)],
    "8b-tp2": [((2048, 512, 512), 4096), ((7168, 7168), 4096)],
    "8b-tp4": [((1024, 256, 256), 4096), ((3584, 3584), 4096)],
}
L2_BYTES = 64 * 2**20


def candidates(quick: bool, wide: bool = False) -> list[Launch]:
    """The launches tried per shape. `wide`: tall blocks over short steps along K (8 to 64
    features a program, 64 to 512 inputs a step, up to 16K elements a tile), so that a
    program keeps several steps of loads in flight even where K is short."""
    if wide:
        return [Launch(bn, bk, w, s) for bn, bk, w, s in itertools.product(
            (8, 16, 32, 64), (64, 128, 256, 512), (4, 8), (3, 5)) if 1024 <= bn * bk <= 16384]
    return [Launch(bn, bk, w, s) for bn, bk, w, s in itertools.product(
        (1, 2, 4, 8) if not quick else (2, 4), (256, 512, 1024), (4, 8), (1, 3))]


def time_launch(ws, xs, launch, device, replays: int):
    """ms per linear, or None where the launch does not compile or run."""
    def step():
        for w, x in zip(ws, xs):
            if launch == "cublas":
                F.linear(x, w)
            else:
                skinny_linear_kernel_call(x, w, None, launch)

    ms = time_graph(step, device, replays, launch)
    return None if ms is None else ms / len(ws)


def time_graph(step, device, replays: int, what) -> float | None:
    """ms per replay of one CUDA graph of step(), or None where it does not compile or run."""
    try:
        step()
        synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # a launch whose registers or shared memory do not fit
        log(f"  {what}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None
    return statistics.median(time_steps(lambda i: graph.replay(), replays, 1, device))


def time_group(features: tuple[int, ...], k: int, device, replays: int) -> dict:
    """us per group of sibling linears (one input, a weight each): cuBLAS and the skinny kernel
    per linear, and the grouped kernel once, after checking it against float32."""
    dtype, nbytes = torch.bfloat16, sum(features) * k * 2
    copies = max(2, -(-3 * L2_BYTES // nbytes))
    torch.manual_seed(0)
    sets = [[torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5 for n in features] for _ in range(copies)]
    xs = [torch.randn(1, k, dtype=dtype, device=device) for _ in range(copies)]
    want = torch.cat([F.linear(xs[0].float(), w.float()) for w in sets[0]], -1)
    error = ((grouped_kernel_call(xs[0], sets[0]).float() - want).abs().max() / want.abs().max()).item()
    steps = {
        "cublas": lambda: [F.linear(x, w) for x, ws in zip(xs, sets) for w in ws],
        "skinny": lambda: [skinny_linear_kernel_call(x, w) for x, ws in zip(xs, sets) for w in ws],
        "grouped": lambda: [grouped_kernel_call(x, ws) for x, ws in zip(xs, sets)],
    }
    timed = {name: time_graph(step, device, replays, name) for name, step in steps.items()}
    return {"features": list(features), "k": k, "max_rel_error": error,
            **{f"{name}_us": None if ms is None else 1e3 * ms / copies for name, ms in timed.items()}}


def sweep_groups(names: str, device, replays: int) -> list[dict]:
    print(f"{'features':>22} {'k':>6} {'cublas':>8} {'skinny':>8} {'grouped':>8}  us per group", flush=True)
    rows = []
    with torch.inference_mode():
        for features, k in [group for name in names.split(",") for group in GROUPS[name]]:
            row = time_group(features, k, device, replays)
            us = [f"{row[f'{v}_us']:>8.2f}" if row[f"{v}_us"] else f"{'-':>8}"
                  for v in ("cublas", "skinny", "grouped")]
            shape = "/".join(map(str, features))
            print(f"{shape:>22} {k:>6} {' '.join(us)}  err {row['max_rel_error']:.1e}", flush=True)
            rows.append(row)
    return rows


def check(x, w, launch) -> float:
    ref = F.linear(x.float(), w.float())
    out = skinny_linear_kernel_call(x, w, None, launch).float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1", help="the kernel takes one; more for cuBLAS only")
    p.add_argument("--quick", action="store_true", help="a few launches only")
    p.add_argument("--wide", action="store_true", help="tall blocks over short steps along K instead")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--groups", default=None, help=f"time sibling linears instead, of: {','.join(GROUPS)}")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the kernels without programmatic dependent launch (each waits for the one "
                        "before to finish, as before f9d9e32), to compare a chain of products with and without it")
    args = p.parse_args(argv)
    if args.no_pdl:
        from cgcompile.kernels import skinny_linear

        skinny_linear.dependent_launch = lambda device: False  # read by launch_arguments at every launch
    device, dtype = torch.device("cuda"), torch.bfloat16
    if args.groups:
        rows = sweep_groups(args.groups, device, args.replays)
        if args.json:
            write_json(args.json, {"environment": environment(device), "groups": rows})
        wrong = [row["features"] for row in rows if row["max_rel_error"] > 2e-2]
        if wrong:
            log(f"the grouped kernel is wrong (relative error over 2e-2) for {wrong}")
        return 1 if wrong else 0
    peak = measure_peak_bandwidth(device)
    log(f"copy bandwidth {peak:.0f} GB/s")
    launches = candidates(args.quick, args.wide)
    shapes = sorted({s for name in args.shapes.split(",") for s in SHAPES[name]})
    rows_out = []
    print(f"{'n':>7} {'k':>6} {'m':>2} {'cublas':>7} {'chosen':>7} {'best':>7}  best launch", flush=True)
    with torch.inference_mode():
        for (n, k), m in itertools.product(shapes, (int(r) for r in args.rows.split(","))):
            nbytes = n * k * 2
            copies = max(2, -(-3 * L2_BYTES // nbytes))
            torch.manual_seed(0)
            ws = [torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5 for _ in range(copies)]
            xs = [torch.randn(m, k, dtype=dtype, device=device) for _ in range(copies)]
            share = lambda ms: nbytes / ms / 1e6 / peak if ms else 0.0  # noqa: E731
            cublas = time_launch(ws, xs, "cublas", device, args.replays)
            if m != 1:  # cuBLAS alone: what the kernel would have to beat
                print(f"{n:>7} {k:>6} {m:>2} {share(cublas):>7.0%}", flush=True)
                rows_out.append({"n": n, "k": k, "m": m, "cublas_ms": cublas})
                continue
            chosen = choose_launch(n, k)
            error = check(xs[0], ws[0], chosen)
            timed = {}
            for launch in launches:
                try:
                    bad = check(xs[0], ws[0], launch)
                except Exception as e:  # registers or shared memory that do not fit
                    log(f"  {n}x{k} m={m} {launch}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                if bad > 2e-2:  # a wrong launch is reported, never chosen
                    log(f"  {n}x{k} m={m} {launch}: relative error {bad:.1e}")
                    continue
                ms = time_launch(ws, xs, launch, device, args.replays)
                if ms is not None:
                    timed[launch] = ms
            best = min(timed, key=timed.get)
            chosen_ms = timed.get(chosen) or time_launch(ws, xs, chosen, device, args.replays)
            print(f"{n:>7} {k:>6} {m:>2} {share(cublas):>7.0%} {share(chosen_ms):>7.0%} {share(timed[best]):>7.0%}"
                  f"  {best} err {error:.1e}", flush=True)
            top = sorted(timed, key=timed.get)[:5]
            rows_out.append({"n": n, "k": k, "m": m, "cublas_ms": cublas, "chosen_ms": chosen_ms,
                             "max_rel_error": error,
                             "top": [{**vars(t), "ms": timed[t]} for t in top],
                             "all": [{**vars(t), "ms": ms} for t, ms in timed.items()]})
            del ws, xs
    if args.json:
        write_json(args.json, {"environment": environment(device), "peak_gbs": peak, "rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
