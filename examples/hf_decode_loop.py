"""Greedy decoding of a transformers model in a plain loop over a StaticCache, without
generate(): the few lines that let the host run ahead of the GPU.

    .venv/bin/python examples/hf_decode_loop.py                   # CPU: eager pieces, no graphs
    .venv/bin/python examples/hf_decode_loop.py --device cuda     # one CUDA graph a decode step

generate() decides after every step whether to stop, which reads a value from the device:
the host then waits for each step's kernels before it prepares the next. The loop below
reads nothing back. The next token stays on the device (argmax, no `.item()`), and the
cache position is a device tensor the loop advances itself. So nothing makes the host wait,
and it can queue step k + 1 while the GPU still runs step k. The cache is made once and
reset between prompts: it stays at one address, so the compiled steps keep their graphs.
The loop's tokens equal generate()'s on the same model (checked at the end).
"""

import argparse
import time

import torch
from transformers import StaticCache

import cgcompile
from hf_generate import build_model  # the model of every generate() example


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    return parser.parse_args()


@torch.no_grad()
def greedy(forward, cache: StaticCache, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, new_tokens] greedy tokens after `prompt` [B, T], from a reset `cache`."""
    cache.reset()
    position = torch.arange(prompt.shape[1], device=prompt.device)
    logits = forward(input_ids=prompt, past_key_values=cache, cache_position=position, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    position = position[-1:] + 1
    for _ in range(new_tokens - 1):
        logits = forward(input_ids=token, past_key_values=cache, cache_position=position, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)  # stays on the device: the host does not wait
        tokens.append(token)
        position = position + 1
    return torch.cat(tokens, dim=1)


def timed(fn) -> tuple[torch.Tensor, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    model = build_model(args.device)
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(0)).to(args.device)
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new_tokens)
    config = cgcompile.Config(compiler="eager") if args.device == "cpu" else cgcompile.Config()
    backend = cgcompile.Backend(config)
    forward = torch.compile(model.forward, backend=backend)

    greedy(forward, cache, prompt, args.new_tokens)  # compiles the prefill and the decode step
    tokens, seconds = timed(lambda: greedy(forward, cache, prompt, args.new_tokens))
    with torch.no_grad():
        reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                                   do_sample=False)[:, args.prompt:]
    print(f"plain loop, compiled: {args.new_tokens} tokens x {args.batch} rows in {seconds * 1e3:.1f} ms "
          f"({backend.stats.graphs_seen} Dynamo graphs, {backend.stats.full_graph_calls} calls as one full graph)")
    print(f"tokens match generate(): {torch.equal(tokens, reference)}")


if __name__ == "__main__":
    main()
