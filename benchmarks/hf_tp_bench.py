"""transformers' own tensor parallel compiled with cgcompile: a Llama loaded with
`from_pretrained(path, tp_plan="auto")` (DTensor shards, one rank per GPU) in a greedy loop
over a StaticCache, ms per token at TP=N against the same model on one GPU.

    torchrun --nproc-per-node 2 benchmarks/hf_tp_bench.py --layers 8            # 8B shape, 8 layers, bf16
    torchrun --nproc-per-node 2 benchmarks/hf_tp_bench.py --shape small --check  # fp32: tokens equal eager
    torchrun --nproc-per-node 2 benchmarks/hf_tp_bench.py --device cpu --shape tiny --check --compiler eager
                                                                                 # smoke test (gloo)

Set-up: rank 0 builds the LlamaConfig's model with random weights on its device and saves it
to --save-dir (kept: a later run with the same shape loads it; there is no hub), every rank
waits at a barrier, then loads it with `tp_plan="auto"`. `model.forward` is compiled with
`cgcompile.Backend(Config(all_reduce=...))` once per --all-reduce value (Dynamo reset in
between). Rank 0 then loads the whole model alone (`device_map`) for the one-GPU numbers.

Method: per variant, one untimed greedy run (compiles and captures), then --repeats timed
runs; a run is the prompt, then --tokens decode steps; its ms per token is the wall time of
the decode steps (device idle before, synchronised after) over their count; the median run
is reported, with the host ms per forward call (the time a call takes to return: near the
ms per token, the host is the bound) and the compiled variants' full-graph share of calls. The StaticCache of a variant is made once and reset between runs.
--check compares the greedy tokens of every compiled variant with TP eager's and with the
one-GPU eager model's ("tokens match: True"), meant for fp32 (--shape small/tiny).

Targets (issue 41): tp1-cgcompile / tpN-cgcompile >= 1.5 at the 8B shape, TP=2.
Rank 0 prints one JSON line per variant and the ratios at the end; --json writes them.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cgcompile  # noqa: E402
from benchmarks import harness  # noqa: E402
from cgcompile.parallel.distributed import torchrun_worker  # noqa: E402
from cgcompile.parallel.fast_all_reduce import all_reduce_report  # noqa: E402

SHAPES = {  # LlamaConfig fields
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1536, vocab_size=32000),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    p.add_argument("--all-reduce", default="auto,nccl", help="Config.all_reduce values to compare")
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="decode steps of a run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check", action="store_true", help="fp32, tokens compared with eager")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                   help="Config.compiler (the all-reduces only DTensor's dispatch shows need inductor)")
    p.add_argument("--save-dir", default=None, help="where rank 0 saves the model (default under /tmp)")
    p.add_argument("--no-skinny", action="store_true",
                   help="Config(skinny_linears=False): one-row linears keep cuBLAS")
    p.add_argument("--fuse-linear", default="off", choices=["on", "off", "both", "off,on"],
                   help="Config.fuse_linear_all_reduce of the TP=2 variants: both (on, then off) or off,on side by "
                        "side, in that order; the variant ends in -fold where it is on")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true",
                   help="rank 0 prints cProfile's top functions of a greedy run's decode calls per compiled variant "
                        "(where the host time of a call goes)")
    p.add_argument("--spec-guards", default="dropped", choices=["kept", "dropped", "both"],
                   help="Dynamo's DTensor spec guards on parameters: dropped (Config.dtensor_spec_guards="
                        "'cgcompile', the default: cgcompile checks the specs), kept ('dynamo'), or both as two "
                        "variants (the kept one's name ends in -dynamo-spec)")
    p.add_argument("--module-guards", default="kept", choices=["kept", "skipped", "both"],
                   help="Dynamo's guards on torch.nn's own modules (Linear, Embedding, ...): kept (torch.compile's "
                        "default), skipped (options={'guard_filter_fn': torch.compiler."
                        "skip_guard_on_inbuilt_nn_modules_unsafe}: unsound where the program changes such a module's "
                        "attributes), or both as two variants (the skipped one's name ends in -nn-guards-skipped); "
                        "on one GPU too")
    p.add_argument("--kernels", action="store_true",
                   help="every rank prints its decode step's kernels by class (matmuls, collectives, copies, "
                        "...) beside its weight-bytes floor, for the first compiled variant (step_kernels.py)")
    p.add_argument("--guard-probe", action="store_true",
                   help="also time each compiled variant with Dynamo's guards skipped (torch.compiler.set_stance("
                        "skip_guard_eval_unsafe=True), a measurement only: unsound in use): the difference is what "
                        "the guards cost per call")
    return p.parse_args()


def model_config(args):
    from transformers import LlamaConfig

    fields = dict(SHAPES[args.shape])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    return LlamaConfig(**fields, max_position_embeddings=4096)


def saved_model(args, cfg, dtype, device) -> str:
    """The model's folder: rank 0 saves random weights there unless a finished save exists."""
    path = args.save_dir or (f"/tmp/cgcompile-hf-tp/{args.shape}-{cfg.num_hidden_layers}l-"
                             f"{str(dtype).removeprefix('torch.')}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "saved.ok")):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        seconds, _ = harness.wall_s(lambda: _save(AutoModelForCausalLM, cfg, dtype, device, path), device)
        harness.log(f"saved {cfg.num_hidden_layers} layers ({args.shape} shape) to {path} in {seconds:.0f} s")
    dist.barrier()
    return path


def _save(auto, cfg, dtype, device, path):
    with torch.device(device):  # random init on the device: no CPU copy of the whole model
        model = auto.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    open(os.path.join(path, "saved.ok"), "w").close()


@torch.no_grad()
def greedy(forward, cache, prompt, tokens: int, device) -> tuple[torch.Tensor, float, float]:
    """([1, tokens] greedy tokens, ms per decode step, host ms per forward call) from a reset
    `cache`. A call returns once its work is queued (CUDA graphs and kernels run
    asynchronously), so the host ms is the Python of the call: when it nears the ms per
    step, the host sets the pace, not the GPUs."""
    cache.reset()
    logits = forward(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    out, host_s = [token], 0.0
    harness.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        called = time.perf_counter()
        logits = forward(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        host_s += time.perf_counter() - called
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    harness.synchronize(device)
    steps = max(tokens - 1, 1)
    return torch.cat(out, dim=1), (time.perf_counter() - t0) * 1e3 / steps, host_s * 1e3 / steps


def measure(forward, model, prompt, args, device) -> tuple[torch.Tensor, float, float]:
    """(tokens, median ms per token, median host ms per call) over --repeats runs after one untimed run."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.tokens)
    greedy(forward, cache, prompt, args.tokens, device)
    runs = [greedy(forward, cache, prompt, args.tokens, device) for _ in range(args.repeats)]
    return runs[0][0], statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)


@torch.no_grad()
def profile_calls(forward, model, prompt, args, label: str, device) -> None:
    """cProfile of a greedy run's decode steps, shaped as `measure`'s (the same cache length,
    so no recompile), after its prefill; every rank runs them, rank 0 prints."""
    import cProfile
    import io
    import pstats

    from transformers import StaticCache

    warm = 3  # a new cache: its first calls run piecewise and capture, which the profile leaves out
    calls = (args.tokens - 1 - warm) // 2  # timed, then profiled: within the cache's length (no recompile)
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.tokens)
    logits = forward(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)

    def step(token):
        return forward(input_ids=token, past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(warm):
        token = step(token)
    # How long the host waits inside CUDAGraph.replay (the launch itself), apart from Python.
    replay, in_replay = torch.cuda.CUDAGraph.replay, [0.0, 0]

    def timed_replay(graph):
        start = time.perf_counter()
        try:
            return replay(graph)
        finally:
            in_replay[0] += time.perf_counter() - start
            in_replay[1] += 1

    harness.synchronize(device)
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        start = time.perf_counter()
        for _ in range(calls):
            token = step(token)
        unprofiled_ms = (time.perf_counter() - start) * 1e3 / calls
        harness.synchronize(device)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        token = step(token)
    profiler.disable()
    if dist.get_rank() == 0:
        print(f"== replay, {label}: {unprofiled_ms:.3f} ms of host time a step (forward and argmax, not "
              f"profiled), of which CUDAGraph.replay {in_replay[0] * 1e3 / calls:.3f} ms "
              f"({in_replay[1] / calls:.1f} replays a step)", flush=True)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        print(f"== profile, {label}, {calls} decode calls\n{text.getvalue()}", flush=True)


@torch.no_grad()
def kernel_report(forward, model, prompt, args, label: str, device) -> None:
    """The decode step's kernels on this rank (torch.profiler over steps shaped as
    `measure`'s, after a new cache's capturing calls), by class, against the rank's floor:
    its matmul weight bytes at its measured copy bandwidth. Every rank prints its own."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import StaticCache

    from benchmarks import step_kernels

    warm, steps = 3, min(16, args.tokens - 4)
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.tokens)
    token = forward(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
    step = lambda t: forward(input_ids=t[:, None], past_key_values=cache, use_cache=True,  # noqa: E731
                             logits_to_keep=1).logits[:, -1].argmax(-1)
    for _ in range(warm):
        token = step(token)
    harness.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(token)
        harness.synchronize(device)
    trace = step_kernels.trace_of(prof)
    peak = harness.measure_peak_bandwidth(device)
    nbytes = harness.matmul_weight_bytes(model)
    breakdown = step_kernels.classify(trace, steps, ("scaled_dot_product",), {"gemm": nbytes}, peak)
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"== kernels, {label}, rank {rank}\n"
          + step_kernels.format_breakdown(breakdown, harness.floor_ms(nbytes, peak), peak), flush=True)


def compiled_variants(model, prompt, args, device, report, prefix: str, all_reduces: list[str]):
    """`model.forward` compiled with cgcompile, once per Config.all_reduce of `all_reduces`,
    per --spec-guards choice (the variant's name ends in "-dynamo-spec" where Dynamo's DTensor
    spec guards are kept) and per --module-guards choice (it ends in "-nn-guards-skipped"
    where Dynamo's guards on torch.nn's own modules are filtered out)."""
    eager_forward = model.forward
    drops = {"kept": [False], "dropped": [True], "both": [True, False]}[args.spec_guards]
    if prefix == "tp1":
        drops = drops[:1]  # one GPU: no DTensor parameters, so no spec guards either way
    module_guards = {"kept": [True], "skipped": [False], "both": [True, False]}[args.module_guards]
    folds = {"on": [True], "off": [False], "both": [True, False], "off,on": [False, True]}[args.fuse_linear]
    if prefix == "tp1":
        folds = [False]  # one GPU: no all-reduce to fold a product into
    for all_reduce, dropped, kept, fold in ((a, d, k, f) for a in all_reduces for d in drops for k in module_guards
                                            for f in folds):
        torch._dynamo.reset()
        backend = cgcompile.Backend(cgcompile.Config(all_reduce=all_reduce, compiler=args.compiler,
                                                     capture_error_mode="thread_local",
                                                     skinny_linears=not args.no_skinny,
                                                     fuse_linear_all_reduce=fold,
                                                     dtensor_spec_guards="cgcompile" if dropped else "dynamo"))
        options = {} if kept else {"guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}
        model.forward = torch.compile(eager_forward, backend=backend, options=options or None)
        variant = (f"{prefix}-cgcompile" + ("" if dropped else "-dynamo-spec")
                   + ("" if kept else "-nn-guards-skipped") + ("-fold" if fold else ""))
        tokens, ms, host_ms = measure(model.forward, model, prompt, args, device)
        if args.profile:
            profile_calls(model.forward, model, prompt, args, f"{variant} all_reduce={all_reduce}", device)
        if (args.kernels and device.type == "cuda" and dropped == drops[0] and kept == module_guards[0]
                and all_reduce == all_reduces[0]):
            kernel_report(model.forward, model, prompt, args, f"{variant} all_reduce={all_reduce}", device)
        if args.guard_probe:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                unguarded_tokens, unguarded_ms, unguarded_host_ms = measure(model.forward, model, prompt, args, device)
            report(f"{variant}-unguarded", all_reduce, unguarded_ms, unguarded_tokens,
                   host_ms_per_call=round(unguarded_host_ms, 4))
        stats = backend.stats
        report(variant, all_reduce, ms, tokens, host_ms_per_call=round(host_ms, 4),
               graphs_captured=stats.graphs_captured,
               full_graph_calls=f"{stats.full_graph_calls}/{stats.full_graph_calls + stats.piecewise_calls}")
        model.forward = eager_forward
    torch._dynamo.reset()


def tensor_parallel(path, dtype, prompt, args, device, report):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
    compiled_variants(model, prompt, args, device, report, args.prefix, args.all_reduce.split(","))
    tokens, ms, host_ms = measure(model.forward, model, prompt, args, device)
    report(f"{args.prefix}-eager", "-", ms, tokens, host_ms_per_call=round(host_ms, 4))
    del model
    harness.release_memory(device)
    dist.barrier()


def one_gpu(path, dtype, prompt, args, device, report):
    """Rank 0 alone: the whole model on its device, compiled and eager."""
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device).eval()
        compiled_variants(model, prompt, args, device, report, "tp1", ["auto"])  # no all-reduce on one GPU
        if args.check:
            tokens, ms, host_ms = measure(model.forward, model, prompt, args, device)
            report("tp1-eager", "-", ms, tokens, host_ms_per_call=round(host_ms, 4))
        del model
        harness.release_memory(device)
    dist.barrier()


def print_summary(rows, args):
    def ms(variant, all_reduce, key="ms_per_token"):
        return next((r[key] for r in rows if (r["variant"], r["all_reduce"]) == (variant, all_reduce)), None)

    for all_reduce in args.all_reduce.split(","):
        for spec, modules, fold in ((s, m, f) for s in ("", "-dynamo-spec") for m in ("", "-nn-guards-skipped")
                                    for f in ("", "-fold")):
            name, one = f"{args.prefix}-cgcompile{spec}{modules}{fold}", f"tp1-cgcompile{modules}"  # alike guards
            tp, single = ms(name, all_reduce), ms(one, "auto")
            if tp and single:
                host, single_host = ms(name, all_reduce, "host_ms_per_call"), ms(one, "auto", "host_ms_per_call")
                print(f"{name} all_reduce={all_reduce}: {tp:.3f} ms/token (host {host:.3f} ms a call); "
                      f"{one} {single:.3f} (host {single_host:.3f}); "
                      f"{one}/{args.prefix} {single / tp:.2f}x (target >= 1.5 at 8b, TP=2)")
    eager = ms(f"{args.prefix}-eager", "-")
    if eager:
        print(f"{args.prefix}-eager: {eager:.3f} ms/token")
    if args.check:
        reference = [r["tokens"] for r in rows if r["variant"].endswith("-eager")]
        print(f"tokens match: {all(r['tokens'] == reference[0] for r in rows)}")
    report = all_reduce_report()
    kinds = collections.Counter((r.level, r.kind) for r in report.sites)
    print("all-reduce sites (level, path): " + (", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) or "none"))
    print("all-reduce calls by group and path (eager calls and captures): " + json.dumps(report.calls))


def main():
    args = parse_args()
    dtype = torch.float32 if args.check or args.device == "cpu" else torch.bfloat16
    rows = []
    with torchrun_worker(args.device) as device:
        args.prefix = f"tp{dist.get_world_size()}"
        cfg = model_config(args)

        def report(variant, all_reduce, ms, tokens, **extra):
            row = {"shape": args.shape, "layers": cfg.num_hidden_layers, "variant": variant,
                   "all_reduce": all_reduce, "ms_per_token": round(ms, 4), "tokens": tokens.flatten().tolist(), **extra}
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)

        path = saved_model(args, cfg, dtype, device)
        prompt = (torch.arange(args.prompt, device=device) * 7 + 1).remainder(cfg.vocab_size).unsqueeze(0)
        tensor_parallel(path, dtype, prompt, args, device, report)
        one_gpu(path, dtype, prompt, args, device, report)
        if dist.get_rank() == 0:
            print_summary(rows, args)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
