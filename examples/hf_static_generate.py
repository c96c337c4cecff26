"""Hugging Face generate() over a static KV cache, each decode step one full CUDA graph.

    .venv/bin/python examples/hf_static_generate.py                           # CPU: the choice of path, no graphs
    .venv/bin/python examples/hf_static_generate.py --device cuda             # full CUDA graphs, fp32
    .venv/bin/python examples/hf_static_generate.py --device cuda --compiler inductor --small-query-attention
    .venv/bin/python examples/hf_static_generate.py --device cuda --compiler inductor --generate-compile

With `cache_implementation="static"` the cache tensors stay at one address through a
generate() and its length lives on the device, so attention may be captured too:
`Config(capturable_split_ops=("attention",))` says so, and every decode step whose
host-side inputs match the capture replays one graph for the whole forward. The first
decode step of each generate() runs piecewise (generate() makes a new cache, at a new
address), the second captures. A small random Llama (no download); eager and compiled
tokens must agree.

--generate-compile takes the route docs/transformers.md recommends for a static cache:
generate() compiles its decode step itself with a cgcompile Backend (its compile_config), so
the prefill runs eagerly and Dynamo traces one graph, and one StaticCache serves every call
(reset in between), so its tensors, which the graphs read in place, never move.
"""

import argparse

import torch

import cgcompile
from hf_generate import build_model  # the model of every generate() example


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--small-query-attention", action="store_true",
                        help="compile decode attention as batched matmuls in the full graph (needs --compiler inductor)")
    parser.add_argument("--generate-compile", action="store_true",
                        help="let generate() compile its decode step with cgcompile, one StaticCache for every call")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    return parser.parse_args()


def generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    # disable_compile: on CUDA, generate() would compile a static cache's step itself.
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          cache_implementation="static", disable_compile=True)


def generate_compiled_by_generate(model, ids: torch.Tensor, new_tokens: int, backend) -> list[torch.Tensor]:
    """Two generate() calls that compile their decode step with `backend` (the prefill
    runs eagerly), over one StaticCache emptied before each."""
    from transformers import CompileConfig, StaticCache

    compile_config = CompileConfig(backend=backend, mode=None)
    if ids.device.type == "cpu":  # transformers compiles on accelerators only, unless its testing flag says so
        compile_config._compile_all_devices = True
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    runs = []
    for _ in range(2):
        cache.reset()
        runs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, past_key_values=cache, compile_config=compile_config))
    return runs


def main() -> None:
    args = parse_args()
    model = build_model(args.device, layers=2, hidden=128)
    ids = (torch.arange(args.batch * 8, device=args.device).view(args.batch, 8) * 7 + 3) % 512  # [B, 8]
    expected = generate(model, ids, args.new_tokens)

    config = cgcompile.Config(compiler=args.compiler, capturable_split_ops=("attention",),
                              small_query_attention=args.small_query_attention)
    backend = cgcompile.Backend(config)
    if args.generate_compile:
        runs = generate_compiled_by_generate(model, ids, args.new_tokens, backend)
    else:
        model.forward = torch.compile(model.forward, backend=backend)
        runs = [generate(model, ids, args.new_tokens) for _ in range(2)]

    stats = backend.stats
    if stats.graphs_captured:
        print(f"decode calls: {stats.full_graph_calls} replayed the full graph, {stats.piecewise_calls} piecewise "
              f"({stats.piecewise_reasons}); CUDA graphs captured: {stats.graphs_captured}")
    else:  # CPU, or CUDA graphs off: the full-graph path runs, without a graph to replay
        print(f"decode calls: {stats.full_graph_calls} full-graph calls (no CUDA graphs on {args.device}: the "
              f"compiled forward ran as one piece), {stats.piecewise_calls} piecewise ({stats.piecewise_reasons}); "
              f"CUDA graphs captured: 0")
    same = all(torch.equal(run, expected) for run in runs)
    print(f"greedy tokens {'identical to' if same else 'DIFFERENT from'} eager "
          f"({args.batch} x {args.new_tokens} new tokens, two generate() calls, compiler={args.compiler})")
    if not same or stats.full_graph_calls == 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
