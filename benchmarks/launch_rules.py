"""Launch rules of the one-row product kernels under 4096 features, side by side: the data
behind `choose_launch`'s long steps (`cgcompile.kernels.skinny_linear`) and the short steps
that sibling groups keep (`grouped_launch`).

Per shape: the launch the library chooses, the short-step launch (n / 512 features a program
over 1024-long steps), and eight fixed launches (features a program / step along K / warps),
each timed as one CUDA graph of products over distinct copies of the weight, us a product,
beside the weight's bytes at the copy bandwidth. `--part gated` times the SiLU-gated down
projection's kernel, `--part groups` the grouped kernel over q/k/v siblings.

    python benchmarks/launch_rules.py --part plain      # GPU machine, about a minute a part
"""

from __future__ import annotations

import argparse

import torch

from harness import environment, log, measure_peak_bandwidth, write_json
from skinny_sweep import L2_BYTES, time_graph

from cgcompile.kernels.grouped_skinny_linear import grouped_kernel_call, grouped_launch
from cgcompile.kernels.silu_mul_linear import silu_mul_kernel_call
from cgcompile.kernels.skinny_linear import (Launch, cdiv, choose_launch, launch_arguments, no_step_past, one_row,
                                             short_steps_launch)

FIXED = {"A": Launch(4, 2048, 4), "B": Launch(8, 2048, 8), "C": Launch(2, 2048, 4), "D": Launch(2, 1024, 4),
         "E": Launch(4, 4096, 8), "F": Launch(16, 2048, 16), "G": Launch(1, 2048, 4), "H": Launch(8, 1024, 4)}
PLAIN = [(256, 2048), (512, 4096), (1024, 2048), (1024, 4096), (1536, 4096), (2048, 2048), (2048, 4096), (2560, 2048),
         (3072, 2048), (3072, 4096), (2560, 8192), (896, 896), (1536, 1536), (2048, 1024), (4096, 1024), (4096, 2048)]
GATED = [(2048, 5632), (2048, 8192), (1536, 8960), (896, 4864), (1024, 4096), (3072, 8192), (2048, 2816)]
GROUPS = [((2048, 256, 256), 2048), ((1024, 256, 256), 4096), ((1536, 256, 256), 1536), ((2048, 512, 512), 4096)]


def gated_call(gate, up, weight, launch: Launch):
    """The gated kernel at a given launch (`silu_mul_kernel_call` takes its own choice)."""
    from cgcompile.kernels.skinny_linear_kernel import silu_mul_linear_kernel

    n, k = weight.shape
    y = torch.empty(n, dtype=gate.dtype, device=gate.device)
    silu_mul_linear_kernel[(cdiv(n, launch.block_n),)](
        one_row(gate, k), one_row(up, k), weight, weight, y, n, k, weight.stride(0), HAS_BIAS=False,
        **launch_arguments(launch, k, gate.device))
    return y


def plain_call(x, weight, launch: Launch):
    from cgcompile.kernels.skinny_linear import skinny_linear_kernel_call

    return skinny_linear_kernel_call(x, weight, None, launch)


def case(part: str, shape, device, peak: float, replays: int) -> dict:
    """us a product for the chosen, short-step and fixed launches of one shape."""
    torch.manual_seed(0)
    features, k = (shape[0], shape[1]) if part == "groups" else ((shape[0],), shape[1])
    nbytes = sum(features) * k * 2
    copies = max(2, -(-3 * L2_BYTES // nbytes))
    weights = [[torch.randn(n, k, dtype=torch.bfloat16, device=device) / k ** 0.5 for n in features]
               for _ in range(copies)]
    xs = [torch.randn(1, k, dtype=torch.bfloat16, device=device) for _ in range(copies)]
    ups = [torch.randn(1, k, dtype=torch.bfloat16, device=device) for _ in range(copies)]
    if part == "groups":
        run = lambda launch: [grouped_kernel_call(x, ws, (), launch) for x, ws in zip(xs, weights)]  # noqa: E731
        chosen = grouped_launch(features, k)
        want = torch.cat([x.float() @ w.float().T for x, w in zip([xs[0]] * len(features), weights[0])], -1)
        got = lambda launch: grouped_kernel_call(xs[0], weights[0], (), launch)  # noqa: E731
    elif part == "gated":
        run = lambda launch: [gated_call(x, u, ws[0], launch) for x, u, ws in zip(xs, ups, weights)]  # noqa: E731
        chosen = choose_launch(features[0], k, gated=True)
        silu = torch.nn.functional.silu(xs[0].float()).to(torch.bfloat16)
        gating = (silu.float() * ups[0].float()).to(torch.bfloat16)
        want = gating.float() @ weights[0][0].float().T
        got = lambda launch: gated_call(xs[0], ups[0], weights[0][0], launch)  # noqa: E731
    else:
        run = lambda launch: [plain_call(x, ws[0], launch) for x, ws in zip(xs, weights)]  # noqa: E731
        chosen = choose_launch(features[0], k)
        want = xs[0].float() @ weights[0][0].float().T
        got = lambda launch: plain_call(xs[0], weights[0][0], launch)  # noqa: E731
    launches = {"chosen": chosen, "short": short_steps_launch(max(features), k),
                **{name: no_step_past(launch, k) for name, launch in FIXED.items()}}
    row = {"features": list(features), "k": k, "bytes_us": nbytes / peak / 1e3,
           "launches": {name: [l.block_n, l.block_k, l.num_warps] for name, l in launches.items()}}
    for name, launch in launches.items():
        error = ((got(launch).float().reshape(want.shape) - want).abs().max() / want.abs().max()).item()
        if error > 2e-2:  # a wrong launch is reported, never timed
            log(f"  {features}x{k} {name} {launch}: relative error {error:.1e}")
            row[name] = None
            continue
        ms = time_graph(lambda: run(launch), device, replays, name)
        row[name] = None if ms is None else 1e3 * ms / copies
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("plain", "gated", "groups"), default="plain")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    peak = measure_peak_bandwidth(device)
    log(f"copy bandwidth {peak:.0f} GB/s; us a product (fixed launches: features/step/warps "
        + ", ".join(f"{name} {l.block_n}/{l.block_k}/{l.num_warps}" for name, l in FIXED.items()) + ")")
    shapes = {"plain": PLAIN, "gated": GATED, "groups": GROUPS}[args.part]
    names = ["chosen", "short", *FIXED]
    print(f"{'shape':>22} {'bytes':>6} " + " ".join(f"{n:>7}" for n in names), flush=True)
    rows = []
    with torch.inference_mode():
        for shape in shapes:
            row = case(args.part, shape, device, peak, args.replays)
            label = "/".join(map(str, row["features"])) + f"x{row['k']}"
            print(f"{label:>22} {row['bytes_us']:>6.2f} "
                  + " ".join(f"{row[n]:>7.2f}" if row[n] else f"{'-':>7}" for n in names), flush=True)
            rows.append(row)
    if args.json:
        write_json(args.json, {"environment": environment(device), "part": args.part, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
