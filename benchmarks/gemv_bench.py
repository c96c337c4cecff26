"""How close a decode step's matrix products come to the copy bandwidth, by kernel choice.

At one to eight rows a linear reads its whole weight to produce a few outputs: its floor is
the weight bytes at the device's copy bandwidth. This times the linears of a decoder
layer, several layers' worth of distinct weights (so the L2 cache holds none of them), in
one CUDA graph, and reports the share of the copy bandwidth each kernel choice reaches:

  cublas        F.linear as the model runs it (cuBLAS through aten.mm)
  reduction     the same product written as a multiply and a sum over K, compiled by
                Inductor into one reduction kernel per linear (fp32 accumulation)
  reduction-cd  the same with Inductor's coordinate-descent tuning of the launch
  autotune      Inductor's max-autotune of the mm (Triton templates beside cuBLAS); slow to
                compile, so only with --variants naming it
  skinny        cgcompile::skinny_linear (Config.skinny_linears): its Triton kernel at one row
                and up to 4096 output features, cuBLAS otherwise

    python benchmarks/gemv_bench.py                          # GPU machine, ~2 min
    python benchmarks/gemv_bench.py --shapes 1b --rows 1 --variants cublas,reduction
    python benchmarks/gemv_bench.py --device cpu --shapes tiny --rows 1 --variants cublas,reduction   # smoke test
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from harness import environment, guarded, log, measure_peak_bandwidth, synchronize, time_steps, write_json

from cgcompile.kernels.skinny_linear import skinny_linear

# (out_features, in_features) of one decoder layer's linears
LAYER_SHAPES = {
    "1b": [(2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)],
    "8b": [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)],
    "8b-tp2": [(2048, 4096), (512, 4096), (512, 4096), (4096, 2048), (7168, 4096), (7168, 4096), (4096, 7168)],
    # TinyLlama-1.1B's linears, as transformers runs them (q, k, v, o, gate, up, down)
    "1b-hf": [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)],
    # the project's tensor-parallel decoder at TP=2: q/k/v and gate/up fused
    "8b-tp2-fused": [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)],
    "tiny": [(64, 32), (32, 32), (32, 64)],
}
LAYERS = {"1b": 4, "8b": 2, "8b-tp2": 4, "1b-hf": 4, "8b-tp2-fused": 4, "tiny": 2}  # enough distinct weights to exceed the L2 cache


def linear_as_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype)


def make_step(variant: str):
    """fn(xs, ws): every linear of the set; compiled where the variant compiles."""
    op = {"cublas": F.linear, "autotune": F.linear, "skinny": skinny_linear}.get(variant, linear_as_reduction)

    def step(xs, ws):
        return [op(x, w) for x, w in zip(xs, ws)]

    if variant in ("cublas", "skinny"):
        return step
    options = {"reduction": {}, "reduction-cd": {"coordinate_descent_tuning": True},
               "autotune": {"max_autotune": True, "max_autotune_gemm_backends": "TRITON,ATEN"}}[variant]
    return torch.compile(step, dynamic=False, options=options)


def time_variant(variant: str, shapes, layers: int, rows: int, dtype, device, replays: int) -> dict:
    torch.manual_seed(0)
    ws = [torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5 for _ in range(layers) for n, k in shapes]
    xs = [torch.randn(rows, w.shape[1], dtype=dtype, device=device) for w in ws]
    step = make_step(variant)
    reference = [F.linear(x.float(), w.float()) for x, w in zip(xs, ws)]
    out = step(xs, ws)
    error = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(out, reference))
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    if device.type != "cuda":
        return {"variant": variant, "rows": rows, "weight_mb": nbytes / 2**20, "max_rel_error": error}
    for _ in range(3):
        step(xs, ws)
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(xs, ws)
    ms = statistics.median(time_steps(lambda k: graph.replay(), replays, 1, device))
    return {"variant": variant, "rows": rows, "weight_mb": nbytes / 2**20, "ms": ms,
            "gbs": nbytes / ms / 1e6, "max_rel_error": error}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1b,8b,8b-tp2", help=f"comma-separated, from {sorted(LAYER_SHAPES)}")
    p.add_argument("--rows", default="1,8", help="rows (tokens) of each product, comma-separated")
    p.add_argument("--variants", default="cublas,reduction,reduction-cd")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    peak = measure_peak_bandwidth(device) if device.type == "cuda" else None
    if peak:
        log(f"copy bandwidth {peak:.0f} GB/s")
    rows_out = []
    print(f"{'shapes':>7} {'rows':>4} {'variant':>13} {'weights MB':>10} {'ms':>8} {'GB/s':>7} {'of copy':>7} {'rel err':>8}")
    with torch.inference_mode():
        for name in args.shapes.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                for variant in args.variants.split(","):
                    torch._dynamo.reset()
                    row, error = guarded(f"{name} {rows} {variant}", lambda: time_variant(
                        variant, LAYER_SHAPES[name], LAYERS[name], rows, dtype, device, args.replays))
                    if row is None:
                        print(f"{name:>7} {rows:>4} {variant:>13} failed: {error}", flush=True)
                        continue
                    row["shapes"] = name
                    rows_out.append(row)
                    timing = (f"{row['ms']:>8.3f} {row['gbs']:>7.0f} {row['gbs'] / peak:>7.0%}" if "ms" in row
                              else f"{'-':>8} {'-':>7} {'-':>7}")
                    print(f"{name:>7} {rows:>4} {variant:>13} {row['weight_mb']:>10.1f} {timing} "
                          f"{row['max_rel_error']:>8.1e}", flush=True)
    if args.json:
        write_json(args.json, {"environment": environment(device), "peak_gbs": peak, "rows": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
