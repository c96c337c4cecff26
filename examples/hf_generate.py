"""Hugging Face generate() with cgcompile: a small random Llama, eager against compiled.

    .venv/bin/python examples/hf_generate.py                                   # CPU, pieces as FX code: ~15 s
    .venv/bin/python examples/hf_generate.py --device cuda                     # CUDA graphs, fp32: tokens bit-equal
    .venv/bin/python examples/hf_generate.py --device cuda --compiler inductor --dtype bfloat16

The one-line change is `model.forward = torch.compile(model.forward, backend=backend)`;
generate() keeps its default DynamicCache. The model is built from a config with random
weights (no download), so the tokens mean nothing, but eager and compiled must agree.
On CPU there are no CUDA graphs, so the CPU run shows the split and is not timed.

Dynamo compiles two graphs of `forward` (prefill, decode) with the `dynamic_sources` line
below, except with Inductor pieces and no CUDA graphs (`--compiler inductor` on CPU): there
it compiles three, and the printout says why.
"""

import argparse
import re
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cgcompile


def build_model(device: str, dtype: str = "float32", layers: int = 4, hidden: int = 256) -> LlamaForCausalLM:
    """A small random Llama (no download), seeded: the model of every generate() example."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).to(device, getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # random weights: generate exactly --new-tokens
    model.generation_config.pad_token_id = 0
    return model


def timed_generate(model, ids, mask, new_tokens) -> tuple[torch.Tensor, float]:
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def best_of(runs: int, model, ids, mask, new_tokens) -> tuple[torch.Tensor, float]:
    results = [timed_generate(model, ids, mask, new_tokens) for _ in range(runs)]
    return results[0][0], min(seconds for _, seconds in results)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    return parser.parse_args()


def make_prompt(args, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(3, vocab_size, (args.batch, args.prompt_len), device=args.device)  # [B, T]
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0  # rows after the first are left-padded by two tokens
    return ids.masked_fill(mask == 0, 0), mask


def main() -> None:
    args = parse_args()
    model = build_model(args.device, args.dtype, args.layers, args.hidden)
    ids, mask = make_prompt(args, model.config.vocab_size)
    timing = ids.is_cuda  # without CUDA there are no CUDA graphs: a speed-up figure would mislead
    runs = 3 if timing else 1
    if timing:
        timed_generate(model, ids, mask, args.new_tokens)  # warm-up
    expected, eager_s = best_of(runs, model, ids, mask, args.new_tokens)

    backend = cgcompile.Backend(cgcompile.Config(compiler=args.compiler))
    model.forward = torch.compile(model.forward, backend=backend)  # the one-line change
    # Recommended: the cache length is a symbol from the first decode step on, so
    # generate() compiles two graphs (prefill, decode) instead of three (see `graph_roles`).
    torch.compiler.config.dynamic_sources = r".*past_key_values.*"
    _, warmup_s = timed_generate(model, ids, mask, args.new_tokens)  # trace, compile, capture
    got, compiled_s = best_of(runs, model, ids, mask, args.new_tokens)

    print_split(backend, inductor_off_cuda=args.compiler == "inductor" and not timing)
    tokens = args.batch * args.new_tokens
    if timing:
        print(f"eager:     {tokens / eager_s:8.1f} tokens/s")
        print(f"cgcompile: {tokens / compiled_s:8.1f} tokens/s  (first call, with compilation: {warmup_s:.1f} s)")
    else:
        print(f"not timed on {ids.device.type}: there are no CUDA graphs to measure "
              f"(first compiled call, with compilation: {warmup_s:.1f} s)")
    same = torch.equal(got, expected)
    print(f"greedy tokens {'identical to' if same else 'DIFFERENT from'} eager "
          f"({args.batch} x {args.new_tokens} new tokens, {args.dtype}, compiler={args.compiler})")
    if not same:
        raise SystemExit(1)


THIRD_GRAPH_WHY = (
    "graph 1 served the first decode step only: the prefill's cache came out of an Inductor piece in "
    "Inductor's layout ([B, T, H, D]-major), and without CUDA graphs outputs are returned as the piece made "
    "them (with CUDA graphs they are copied out in eager's contiguous layout). The first decode step's cache "
    "is contiguous, so the second fails graph 1's stride guard on past_key_values and compiles graph 2"
)


def graph_roles(graphs: int) -> list[str]:
    """What each Dynamo graph of one generate() serves, by index: the prefill, then the
    decode steps. Two graphs with the `dynamic_sources` line; a third where the first decode
    step's graph is not reused (`THIRD_GRAPH_WHY`): the last graph serves every later step."""
    if graphs <= 2:
        return ["prefill", "every decode step"][:graphs]
    middle = ["first decode step"] + [f"decode step {i}" for i in range(2, graphs - 1)]
    return ["prefill", *middle, "every later decode step"]


def print_split(backend: cgcompile.Backend, inductor_off_cuda: bool) -> None:
    """Pieces per graph, then one short line per piece of the last graph (the one every
    later step runs): why it runs eagerly, as the split rules' names
    (`backend.pieces[i].reason` has the full text, node by node)."""
    graphs = backend.stats.graphs_seen
    roles = graph_roles(graphs)
    for graph, role in enumerate(roles):
        pieces = [p for p in backend.pieces if p.graph_index == graph]
        print(f"graph {graph} ({role}): {len(pieces)} pieces, {sum(p.capturable for p in pieces)} capturable")
    if graphs == 3 and inductor_off_cuda:
        print(THIRD_GRAPH_WHY)
    print(f"pieces of graph {graphs - 1} ({roles[-1]}):")
    print(f"{'piece':<16} {'capturable':<10} {'nodes':>5}  {'inputs':>6}  eager because")
    for piece in backend.pieces:
        if piece.graph_index == graphs - 1:
            rules = dict.fromkeys(re.findall(r"\[(\w+)\]", piece.reason or ""))  # in order, once each
            line = f"{piece.name:<16} {'yes' if piece.capturable else 'no':<10} {piece.node_count:>5}  "
            print(f"{line}{len(piece.input_shapes):>6}  {', '.join(rules)}".rstrip())
    print(backend.stats)


if __name__ == "__main__":
    main()
