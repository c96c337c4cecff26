"""Encoder benchmark: a vision transformer's images/s, and graph memory per model.

Parts (all by default):
  throughput  ViT (transformers, built from a config, random weights) at 1, 8 and 32
              images per call: eager, torch.compile mode="reduce-overhead" (one CUDA
              graph per size, static shapes) and cgcompile (Inductor pieces replayed from
              CUDA graphs, captured under --encoder-budget-mib). A toy decoder is compiled
              and captured beside it under --decoder-budget-mib: the graph memory of both
              models in one process, each its own pool, with their plans.
  generate    the pool of a transformers Llama's generate() with backend="cgcompile",
              which shares one Backend across the call's Dynamo graphs, against one
              Backend per Dynamo graph (how the string backend worked before).

    python benchmarks/encoder_bench.py --json encoder.json           # GPU, ViT-Base shape
    python benchmarks/encoder_bench.py --device cpu --tiny            # smoke test, not timed

Method (benchmarks/harness.py, as every benchmark here): every variant is warmed up
(compiled and captured) before any timing; then --rounds rounds in which every (variant,
size) runs one window of --iters calls timed with CUDA events, variants taking turns, so
they see the same phases of the machine; the median of every call is reported, and the
lowest window median beside it.
Inputs are built before timing. Outputs of every variant are checked against eager
at every size (max abs difference, fp32 with TF32 off).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

import cgcompile
import harness  # benchmarks/harness.py: the method every benchmark here shares
from cgcompile.testing.models import SILLY_OP, ToyLlama

MIB = 1024 * 1024
IMAGE_SIZES = (1, 2, 4, 8, 16, 32)
TOKEN_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def vit(device: str, tiny: bool) -> ViTModel:
    shape = (dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128) if tiny else
             dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072))
    torch.manual_seed(0)
    return ViTModel(ViTConfig(**shape, attn_implementation="sdpa"), add_pooling_layer=False).to(device).eval()


def pixels(model: ViTModel, n: int, device: str) -> torch.Tensor:
    c = model.config
    return torch.randn(n, c.num_channels, c.image_size, c.image_size, device=device)  # [N, 3, H, W]


# -- throughput and graph memory per model --------------------------------------------------


def encoder_variants(model: ViTModel, device: str, args) -> tuple[dict, cgcompile.Backend]:
    """name -> callable(pixel_values) -> last_hidden_state, each ready (compiled, captured)."""
    def eager(x):
        return model(x).last_hidden_state

    variants = {"eager": eager}
    if device == "cuda":
        reduce = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def reduce_overhead(x):
            torch.compiler.cudagraph_mark_step_begin()
            return reduce(x).last_hidden_state

        variants["reduce-overhead"] = reduce_overhead
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor" if device == "cuda" else "eager",
                                                 capture_sizes=IMAGE_SIZES))
    compiled = torch.compile(model, backend=backend)
    first = pixels(model, 3, device)
    torch._dynamo.mark_dynamic(first, 0)
    compiled(first)  # traced with the number of images dynamic
    if device == "cuda":
        backend.capture(compiled, lambda n, warmup: (pixels(model, n, device),),
                        memory_budget=args.encoder_budget_mib * MIB, name="vision", progress=False)
    variants["cgcompile"] = lambda x: compiled(x).last_hidden_state
    return variants, backend


def decoder_beside(device: str, args) -> cgcompile.Backend | None:
    """A toy decoder with its own Backend and budget, captured after the encoder."""
    if device != "cuda":
        return None
    torch.manual_seed(0)
    model = ToyLlama(8, hidden=1024 if args.tiny else 2048, vocab=4096).to(device).eval()
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", capture_sizes=TOKEN_SIZES,
                                                 splitting_ops=(SILLY_OP,)))
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 4096, (5,), device=device)
    torch._dynamo.mark_dynamic(ids, 0)
    compiled(ids)
    backend.capture(compiled, lambda n, warmup: (torch.randint(0, 4096, (n,), device=device),),
                    memory_budget=args.decoder_budget_mib * MIB, name="decoder", progress=False)
    return backend


def throughput(device: str, args) -> list[dict]:
    model = vit(device, args.tiny)
    rows = []
    with torch.inference_mode():
        variants, enc_backend = encoder_variants(model, device, args)
        dec_backend = decoder_beside(device, args)
        inputs = {n: pixels(model, n, device) for n in args.sizes}
        errors = {}
        for name, fn in variants.items():
            for n, x in inputs.items():
                for _ in range(3):  # warm: reduce-overhead records on its second call
                    got = fn(x)
                errors[name, n] = float((got.float() - variants["eager"](x).float()).abs().max())
        on = torch.device(device)
        windows = {(name, n): (lambda fn=fn, x=x: harness.time_steps(lambda k: fn(x), args.iters, 2, on))
                   for name, fn in variants.items() for n, x in inputs.items()}
        samples, failed = harness.run_interleaved(windows, args.rounds)
    for (name, n), per_round in samples.items():
        timing = harness.Timing.of(per_round)
        rows.append({"part": "throughput", "variant": name, "images": n, "ms": timing.median_ms,
                     "best_window_ms": timing.best_window_ms, "images_per_s": n / timing.median_ms * 1e3,
                     "max_abs_err": errors[name, n]})
    rows += [{"part": "error", "variant": name, "error": error} for name, error in failed.items()]
    for backend in (enc_backend, dec_backend):
        if backend is not None and backend.memory_plan is not None:
            plan = backend.memory_plan
            print(plan.format())
            rows.append({"part": "memory", "model": plan.name, "graph_memory_bytes": backend.graph_memory(),
                         "estimate_bytes": plan.estimate_bytes, "budget_bytes": plan.budget,
                         "captured_sizes": list(plan.captured), "graphs": plan.graphs})
    return rows


# -- generate(): one pool per torch.compile call, against one per Dynamo graph ---------------------


def llama(device: str, tiny: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hidden = 256 if tiny else 1024
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=2 if tiny else 8, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def generate_pool(device: str, args) -> list[dict]:
    options = {"compiler": "inductor" if device == "cuda" else "eager"}
    made: list[cgcompile.Backend] = []

    def one_backend_per_graph(gm, example_inputs):
        made.append(cgcompile.Backend(cgcompile.Config(**options)))
        return made[-1](gm, example_inputs)

    rows = []
    for variant, backend in (("one Backend per Dynamo graph", one_backend_per_graph), ("backend='cgcompile'", "cgcompile")):
        torch._dynamo.reset()
        model = llama(device, args.tiny)
        ids = torch.randint(3, 4096, (2, 16), device=device)
        kwargs = {"options": options} if backend == "cgcompile" else {}
        with torch.inference_mode():
            expected = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            model.forward = torch.compile(model.forward, backend=backend, **kwargs)
            got = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        backends = made if backend != "cgcompile" else [cgcompile.backend_of(model.forward)]
        pool = sum(b.graph_memory() for b in backends) if device == "cuda" else None
        rows.append({"part": "generate", "variant": variant, "backends": len(backends),
                     "dynamo_graphs": sum(b.stats.graphs_seen for b in backends),
                     "compilations": sum(b.stats.compilations for b in backends),
                     "graphs_captured": sum(b.stats.graphs_captured for b in backends),
                     "graph_memory_bytes": pool, "tokens_equal": bool(torch.equal(got, expected))})
        for b in backends:
            if device == "cuda":
                b.clear()
        del model
    return rows


def report(rows: list[dict]) -> None:
    for row in rows:
        if row["part"] == "throughput":
            print(f"{row['variant']:<16} {row['images']:>3} images  {row['ms']:8.3f} ms  "
                  f"{row['images_per_s']:9.1f} images/s  max|err| {row['max_abs_err']:.1e}")
        elif row["part"] == "memory":
            print(f"graph memory {row['model']:<8} {row['graph_memory_bytes'] / MIB:8.1f} MiB "
                  f"(estimate {row['estimate_bytes'] / MIB:.1f}, budget {row['budget_bytes'] / MIB:.0f}, "
                  f"sizes {row['captured_sizes']})")
        elif row["part"] == "error":
            print(f"{row['variant']:<16} failed: {row['error'].splitlines()[0]}")
        else:
            pool = "n/a" if row["graph_memory_bytes"] is None else f"{row['graph_memory_bytes'] / MIB:.1f} MiB"
            print(f"generate, {row['variant']:<30} backends {row['backends']}, Dynamo graphs {row['dynamo_graphs']}, "
                  f"compilations {row['compilations']}, graphs {row['graphs_captured']}, pool {pool}, "
                  f"tokens equal eager: {row['tokens_equal']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small models (a smoke test)")
    parser.add_argument("--parts", default="throughput,generate")
    parser.add_argument("--sizes", default="1,8,32", help="images per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--encoder-budget-mib", type=int, default=2048)
    parser.add_argument("--decoder-budget-mib", type=int, default=512)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    args.sizes = tuple(int(s) for s in args.sizes.split(","))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = []
    if "throughput" in args.parts:
        rows += throughput(args.device, args)
    if "generate" in args.parts:
        rows += generate_pool(args.device, args)
    report(rows)
    if args.json:
        harness.write_json(args.json, {"environment": harness.environment(args.device), "rows": rows})
    return 1 if any(row["part"] == "error" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
