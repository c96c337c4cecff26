"""One decode step's attention per layer: `cgcompile::decode_attention`'s kernels at several
split lengths against the batched matmuls Inductor compiles (`small_query_attention`), the
data behind `cgcompile.kernels.decode_attention.choose_splits`.

Each form runs over `--layers` layers' caches (distinct tensors, as a model's layers are) in
one CUDA graph; us per layer. The cache is a static one of `length` positions, the first
`filled` of them visible through a bool mask [B, 1, 1, L], as transformers passes it.

    python benchmarks/decode_attention_bench.py --json /tmp/attn.json     # GPU machine, ~1 min
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness import environment, log, synchronize, time_steps, write_json

from cgcompile.kernels.decode_attention import choose_splits, decode_attention_kernel_call, kernel_problem
from cgcompile.passes.small_query import small_query_attention

# name: (query heads, key heads, head dim) of one rank's layer
SHAPES = {"1b": (16, 8, 128), "8b": (32, 8, 128), "8b-tp2": (16, 4, 128), "8b-tp4": (8, 2, 128)}


def time_graph(step, device, replays: int) -> float:
    step()
    synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return statistics.median(time_steps(lambda i: graph.replay(), replays, 1, device))


def case(shape: str, batch: int, length: int, filled: int, layers: int, device, replays: int) -> dict:
    heads, key_heads, head_dim = SHAPES[shape]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    qs = [torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype) for _ in range(layers)]
    ks = [torch.randn(batch, key_heads, length, head_dim, device=device, dtype=dtype) for _ in range(layers)]
    vs = [torch.randn(batch, key_heads, length, head_dim, device=device, dtype=dtype) for _ in range(layers)]
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=device)
    mask[..., :filled] = True
    scale = head_dim ** -0.5
    problem = kernel_problem(qs[0], ks[0], vs[0], mask)  # the op would keep the matmuls; the kernels run here anyway
    torch._dynamo.reset()  # else past Dynamo's recompile limit the matmuls would run eagerly, unfused
    matmuls = torch.compile(small_query_attention, dynamic=False)
    want = matmuls(qs[0], ks[0], vs[0], mask, scale)
    chosen = choose_splits(batch * key_heads, length, device)
    row = {"shape": shape, "batch": batch, "length": length, "filled": filled, "chosen_chunk": chosen,
           "op_keeps_matmuls_because": problem}
    forms = {"matmuls": lambda: [matmuls(q, k, v, mask, scale) for q, k, v in zip(qs, ks, vs)]}
    for chunk in sorted({64, 128, 256, 512, 1024, length, chosen}):
        if chunk <= length:
            forms[f"chunk {chunk}"] = (lambda c: lambda: [decode_attention_kernel_call(q, k, v, mask, scale, c)
                                                          for q, k, v in zip(qs, ks, vs)])(chunk)
            got = decode_attention_kernel_call(qs[0], ks[0], vs[0], mask, scale, chunk)
            row.setdefault("max_abs_error", 0.0)
            row["max_abs_error"] = max(row["max_abs_error"], (got.float() - want.float()).abs().max().item())
    for name, step in forms.items():
        row[name] = 1e3 * time_graph(step, device, replays) / layers
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--lengths", default="256:200,512:300,1024:256,4096:2000", help="cache length:filled positions, ...")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for length, filled in (map(int, s.split(":")) for s in args.lengths.split(",")):
                    row = case(shape, batch, length, filled, args.layers, device, args.replays)
                    forms = {k: v for k, v in row.items() if k == "matmuls" or k.startswith("chunk")}
                    best = min(forms, key=forms.get)
                    log(f"{shape:>7} B={batch} L={length} filled={filled}: "
                        + " ".join(f"{k} {v:.2f}" for k, v in forms.items())
                        + f" us/layer; best {best}, chosen chunk {row['chosen_chunk']}, err {row['max_abs_error']:.1e}"
                        + (f"; the op keeps the matmuls: {problem}" if (problem := row["op_keeps_matmuls_because"]) else ""))
                    rows.append(row)
    if args.json:
        write_json(args.json, {"environment": environment(device), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
