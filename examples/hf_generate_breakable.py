"""Hugging Face generate() on breakable CUDA graphs: no compilation, a small random Llama.

    .venv/bin/python examples/hf_generate_breakable.py                     # CPU: the breaks, checked op by op
    .venv/bin/python examples/hf_generate_breakable.py --device cuda       # CUDA graphs, fp32: tokens equal eager

The one-line change is `cgcompile.GraphManager(model, Config(use_breakable=True)).install()`;
generate() keeps its default DynamicCache. Each decoder layer replays two graph segments
around the cache update and attention, which run eagerly. On CPU there are no CUDA graphs:
the manager runs with segments="op_replay" (each segment's recorded ops re-run at the
tensors they were recorded with, as a graph would), which checks the breaks and times nothing.
"""

import argparse

import torch

import cgcompile
from hf_generate import build_model, make_prompt, timed_generate  # the same model, prompt and timing


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    on_cuda = args.device.startswith("cuda")
    if not on_cuda:
        torch.set_num_threads(1)  # a tiny model: threads only add contention
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 eager and graphs run the same kernels
    model = build_model(args.device, args.dtype, args.layers, args.hidden)
    ids, mask = make_prompt(args, model.config.vocab_size)

    timed_generate(model, ids, mask, args.new_tokens)  # warm-up
    expected, eager_s = timed_generate(model, ids, mask, args.new_tokens)

    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True),
                                     segments="cuda_graphs" if on_cuda else "op_replay")
    with manager.install():  # the one-line change (here scoped to the block)
        first, first_s = timed_generate(model, ids, mask, args.new_tokens)  # observes, captures, replays
        again, again_s = timed_generate(model, ids, mask, args.new_tokens)  # replays from the first step

    print(manager.breakable.describe())  # per layer (identical ones once): the steps a replay runs
    same = torch.equal(first, expected) and torch.equal(again, expected)
    print(f"tokens equal eager: {same} ({expected.numel()} tokens, batch {args.batch})")
    if on_cuda:
        print(f"generate({args.new_tokens} new tokens): eager {eager_s * 1e3:.1f} ms, breakable graphs "
              f"{again_s * 1e3:.1f} ms ({eager_s / again_s:.2f}x); first call (with capture) {first_s * 1e3:.1f} ms")
    if not same:
        raise SystemExit("breakable graphs and eager disagree")


if __name__ == "__main__":
    main()
