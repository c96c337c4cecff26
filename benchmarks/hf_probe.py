"""Where the host time of a transformers model's decode step goes, beside the project's own
decode model of the same shape (`host_probe.py`'s parts, on a transformers Llama, or with
--family on a Qwen2, Mistral, Gemma2 or Qwen3-MoE model: `hf_families.py`).

Two loops over one StaticCache, `model.forward` compiled with `cgcompile.Backend()` (the
default Config):

  plain loop   forward(input_ids=token, past_key_values=cache, cache_position=position)
               per step, the device idle before each (`host_probe.probe_case`): the host
               time split into host_probe's parts. "outside the runtime" is what the
               runtime does not see: Dynamo's guards and frame, and transformers' Python
               around the compiled graph, if any graph break leaves some outside.
  generate()   `model.generate(..., past_key_values=cache)` with the same compiled forward:
               wall ms per token, the host ms of the forward calls in it, and the rest
               (generate()'s own Python, and its waits for the device: it reads a device
               value every step to decide whether to stop).

Both print the step on the device (CUDA events, back to back) and the weight-bytes floor
(`harness.floor_ms`) on CUDA: the bytes a token's step reads (`hf_families.step_weight_bytes`;
for qwen3_moe only the top-k experts a token routes to, a lower bound at batches above 1).
Random weights, no download:

    python benchmarks/hf_probe.py --model 1b --batches 1,8 --dtype bf16        # the issue's 1.1B shape
    python benchmarks/host_probe.py --model 1b --batches 1,8 --variants cgcompile-inductor   # beside it
    python benchmarks/hf_probe.py --family gemma2 --model 1b --batches 1,8     # another family, same shape
    python benchmarks/hf_probe.py --device cpu --model tiny --batches 1 --steps 5 --dtype fp32   # smoke test
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import statistics
import sys
import time

import torch

import cgcompile
from cgcompile.testing.decode_model import MODEL_CONFIGS
from harness import environment, floor_ms, log, matmul_weight_bytes, measure_peak_bandwidth, synchronize, write_json
from hf_families import FAMILIES, SLIDING_WINDOW, TINY_SLIDING_WINDOW, build, describe, step_weight_bytes
from host_probe import DTYPES, format_case, probe_case

PROMPT = 16


class PlainLoop:
    """`host_probe.probe_case`'s prepared variant: `step(batch, start, k)` is decode step k
    of a plain loop, at cache position PROMPT + k (wrapping before the cache ends)."""

    def __init__(self, model, backend: cgcompile.Backend, batches, device, steps: int):
        from transformers import StaticCache

        self.backend = backend
        self.forward = torch.compile(model.forward, backend=backend)
        self.span = 3 * steps + 16
        self.cache = {b: StaticCache(config=model.config, max_cache_len=PROMPT + self.span + 1) for b in batches}
        self.tokens = {b: torch.ones(b, 1, dtype=torch.long, device=device) for b in batches}
        self.positions = [torch.tensor([PROMPT + k], device=device) for k in range(self.span)]

    def step(self, batch: int, start, k: int):
        return self.forward(input_ids=self.tokens[batch], past_key_values=self.cache[batch],
                            cache_position=self.positions[k % self.span], logits_to_keep=1).logits


def generate_parts(model, forward, batch: int, new_tokens: int, device, profile: bool = False) -> dict:
    """generate() with `forward` (compiled): wall ms per token, and the host ms of the
    forward calls inside it; the rest is generate()'s own Python and its waits. profile: a
    cProfile of one more run, its top functions by own time under "profile"."""
    from transformers import StaticCache

    prompt = torch.ones(batch, PROMPT, dtype=torch.long, device=device)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + new_tokens + 1)
    inner, in_forward = model.forward, [0.0]

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            in_forward[0] += time.perf_counter() - start

    def run():
        cache.reset()
        # disable_compile: with a static cache generate() would wrap the (already compiled,
        # timed) forward in its own torch.compile(mode="reduce-overhead")
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                              max_new_tokens=new_tokens, do_sample=False, disable_compile=True)

    model.forward = timed_forward
    try:
        run()  # compiles and captures what the timed run needs
        walls, forwards = [], []
        for _ in range(3):
            in_forward[0] = 0.0
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            walls.append((time.perf_counter() - start) * 1e3 / new_tokens)
            forwards.append(in_forward[0] * 1e3 / new_tokens)
        profiled = profile_text(run, new_tokens) if profile else None
    finally:
        model.forward = inner
    wall, in_calls = statistics.median(walls), statistics.median(forwards)
    return {"batch": batch, "wall_ms_per_token": wall, "forward_calls_ms_per_token": in_calls,
            "rest_ms_per_token": wall - in_calls, "profile": profiled}


def profile_text(run, new_tokens: int) -> str:
    """One run under cProfile: the functions with the most own time, then the most
    cumulative time (per token: divide by `new_tokens`)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"(one generate() of {new_tokens} tokens)\n")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def kernel_report(loop: PlainLoop, model, batch: int, steps: int, peak_gbs: float, floor: float, out_dir: str) -> str:
    """The plain loop's kernels over `steps` steps (torch.profiler), by total device time,
    and the step by kernel class (`step_kernels`), as `profile_step.py --kernels` prints
    them for the project's own decode model."""
    import json
    import os

    import step_kernels
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            loop.step(batch, None, k)
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_hf_plain_loop_B{batch}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    breakdown = step_kernels.classify(trace, steps, ("attention", "scaled_dot_product"),
                                      {"gemm": matmul_weight_bytes(model)}, peak_gbs)
    return (prof.key_averages().table(sort_by="cuda_time_total", row_limit=45) + "\n"
            + step_kernels.format_breakdown(breakdown, floor, peak_gbs))


def probe_generate(model, config: cgcompile.Config, args, device) -> tuple[list[dict], cgcompile.Backend | None]:
    """generate()'s split at each batch (`generate_parts`), and its Backend; none with
    --new-tokens 0."""
    if not args.new_tokens:
        return [], None
    # generate() passes other arguments than the loop: its own Dynamo graphs and Backend.
    torch._dynamo.reset()
    backend = cgcompile.Backend(config)
    forward = torch.compile(model.forward, backend=backend)
    generates = []
    for batch in args.batches:
        parts = generate_parts(model, forward, batch, args.new_tokens, device, args.profile_generate)
        generates.append(parts)
        print(f"hf-generate B={batch}: {parts['wall_ms_per_token']:.3f} ms a token, of which the forward calls "
              f"{parts['forward_calls_ms_per_token']:.3f} ms on the host and generate()'s own Python and "
              f"waits {parts['rest_ms_per_token']:.3f} ms", flush=True)
        if parts["profile"]:
            print(f"== generate() profile, B={batch}\n{parts['profile']}", flush=True)
    return generates, backend


def floor_note(model) -> str:
    experts = getattr(model.config, "num_experts", None)
    if not experts:
        return ""
    return (f" (only the {model.config.num_experts_per_tok} of {experts} experts one token reads: "
            f"a lower bound at batches above 1)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_CONFIGS), default="1b")
    p.add_argument("--family", choices=FAMILIES, default="llama", help="the model's family (hf_families.py)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens of each generate() run (0: no generate())")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--json", default=None, help="write the cases here")
    fused = p.add_mutually_exclusive_group()
    fused.add_argument("--fuse-sibling-linears", dest="fuse_sibling_linears", action="store_const", const=True,
                       default=None, help="Config(fuse_sibling_linears=True): q/k/v and gate/up as one matmul each, "
                                          "copying weights that cannot be shared (the default fuses only those that can)")
    fused.add_argument("--no-fuse-sibling-linears", dest="fuse_sibling_linears", action="store_const", const=False,
                       help="Config(fuse_sibling_linears=False): q/k/v and gate/up as the model has them")
    p.add_argument("--matvec-reduction", action="store_true",
                   help="Config(matvec_as_reduction=True): one-row linears as Inductor reductions, not cuBLAS")
    p.add_argument("--no-skinny", action="store_true",
                   help="Config(skinny_linears=False): one-row linears keep cuBLAS")
    p.add_argument("--no-decode-attention-kernel", action="store_true",
                   help="Config(decode_attention_kernel=False): the full graph's decode attention as batched matmuls")
    p.add_argument("--coordinate-descent", action="store_true",
                   help='Config(inductor_options={"coordinate_descent_tuning": True}): Inductor tunes every kernel')
    p.add_argument("--inductor-option", action="append", default=[], metavar="NAME=VALUE",
                   help="Config(inductor_options=...): an Inductor config option for every compile, the value "
                        "read as a Python literal (e.g. combo_kernels=True); may repeat")
    p.add_argument("--profile-generate", action="store_true",
                   help="a cProfile of one generate() run per batch: where its host time goes")
    p.add_argument("--kernels", action="store_true",
                   help="on CUDA: the plain loop's kernels per step, by class, beside the weight-bytes floor "
                        "(the chrome traces go to $OUT, default /tmp)")
    args = p.parse_args(argv)
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.inductor_options = dict(_option(text) for text in args.inductor_option)
    if args.coordinate_descent:
        args.inductor_options["coordinate_descent_tuning"] = True
    return args


def _option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--inductor-option {text!r}: write NAME=VALUE, e.g. combo_kernels=True")
    try:
        return name.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise SystemExit(f"--inductor-option {text!r}: the value must be a Python literal (True, 3, 'max-autotune')")


def main(argv=None) -> int:
    args = parse_args(argv)
    device, cfg, dtype = torch.device(args.device), MODEL_CONFIGS[args.model], DTYPES[args.dtype]
    window = TINY_SLIDING_WINDOW if args.model == "tiny" else SLIDING_WINDOW
    model = build(args.family, cfg, device, dtype, window=window)
    log(f"hf probe: transformers {args.family} of the {args.model} shape ({cfg.layers} layers), {args.dtype}, "
        f"batches {args.batches}; {describe(model)}")
    weight_bytes = step_weight_bytes(model)
    peak_gbs = measure_peak_bandwidth(device) if device.type == "cuda" else None
    floor = floor_ms(weight_bytes, peak_gbs) if peak_gbs else None
    config = cgcompile.Config(fuse_sibling_linears=args.fuse_sibling_linears, matvec_as_reduction=args.matvec_reduction,
                              skinny_linears=not args.no_skinny,
                              decode_attention_kernel=not args.no_decode_attention_kernel,
                              inductor_options=args.inductor_options)
    if device.type != "cuda":
        config = dataclasses.replace(config, compiler="eager")
    loop = PlainLoop(model, cgcompile.Backend(config), args.batches, device, args.steps)
    cases = []
    with torch.inference_mode():
        for batch in args.batches:
            for k in range(3):  # compile and capture: the first steps of each size
                loop.step(batch, None, k)
        for batch in args.batches:
            case = probe_case("hf-plain-loop", loop, batch, args.steps, device)
            case["floor_ms"] = floor
            cases.append(case)
            print(format_case(case, cfg.layers) + (f"\n  weight-bytes floor {floor * 1e3:.0f} us{floor_note(model)}"
                                                   if floor else ""), flush=True)
        if args.kernels and device.type == "cuda":
            for batch in args.batches:
                print(f"== kernels, hf-plain-loop B={batch}\n"
                      + kernel_report(loop, model, batch, 20, peak_gbs, floor, os.environ.get("OUT", "/tmp")),
                      flush=True)
        generates, backend = probe_generate(model, config, args, device)
    backends = (("plain loop", loop.backend), ("generate()", backend))
    for name, stats in ((name, b.stats) for name, b in backends if b is not None):
        print(f"{name}: {stats.graphs_seen} Dynamo graphs, {stats.full_graph_calls} calls as one full graph, "
              f"{stats.piecewise_calls} piecewise; {stats.matvec_reductions} one-row linears as reductions, "
              f"{stats.skinny_linears} as skinny linears ({stats.gated_skinny_linears} with their SiLU gating); "
              f"{stats.fused_linears} linears fused, {stats.shared_fused_weights} "
              f"fused weights shared with the parameters, {stats.fused_weight_bytes / 2**20:.1f} MB of copies; "
              f"full-graph choices {stats.full_graph_choices}; piecewise because {stats.piecewise_reasons}")
    if args.json:
        write_json(args.json, {"environment": environment(device), "model": args.model, "family": args.family,
                               "model_info": describe(model), "layers": cfg.layers,
                               "inductor_options": args.inductor_options, "cases": cases, "generate": generates})
    return 0


if __name__ == "__main__":
    sys.exit(main())
