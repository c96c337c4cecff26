"""Hugging Face generate() decode speed: eager, cgcompile with a DynamicCache, and transformers' static path.

A ~1.1B-parameter Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
8192, vocab 32000) with random bf16 weights; prompt 128 tokens, 256 new tokens, greedy,
batch 1 and 8. --model 8b: Llama-3-8B's layer shapes (hidden 4096, 32 layers, 32 heads, 8 KV
heads, intermediate 14336, vocab 32000). --family: the same shape in another family
(`hf_families.py`): qwen2 (q/k/v biases), mistral (a 64-token sliding window on every layer),
gemma2 (soft-capped attention and logits, sliding window on every other layer; eager
attention), qwen3_moe (16 experts of width intermediate / 8, 2 per token: 1.9B parameters,
0.87 GB read per token at the 1b shape). On CUDA the table is followed by the weight-bytes
floor: the bytes a token's step reads (for qwen3_moe only its 2 experts, so a lower bound
at batch 8) over the device's measured copy bandwidth, as decode tokens/s per batch.
Variants:

    eager           model.generate() as is (DynamicCache)
    cgcompile       model.forward = torch.compile(model.forward, backend=cgcompile.Backend(
                    Config(compiler="inductor"))); DynamicCache, nothing else changed. With
                    torch.compiler.config.dynamic_sources = r".*past_key_values.*" while it runs
                    (the README's optional line: the cache length is a symbol from the first
                    decode step, so generate() makes two Dynamo graphs instead of three);
                    --variants cgcompile-3graphs leaves it out
    breakable       cgcompile.GraphManager(model, Config(use_breakable=True)).install(): breakable CUDA
                    graphs, no compilation (the README's other one-line change); DynamicCache. Each
                    decoder layer replays two graph segments around the eager cache update and
                    attention; the prefill and the first decode step of a new signature run eagerly
    cgcompile-static  cgcompile with generate(cache_implementation="static", disable_compile=True)
                    and Config(capturable_split_ops=("attention",)): every decode step whose
                    cache lies where it lay at capture replays one full CUDA graph (see the
                    README, "Full graphs"); backend.stats counts the steps of each path
    cgcompile-static-default  the static cache with forward compiled under the default Config
                    (no flags): its automatic full graph, small-query attention included
    cgcompile-unfused, cgcompile-static-default-unfused  cgcompile and cgcompile-static-default
                    with Config(fuse_sibling_linears=False): q/k/v and gate/up as the model has them
    cgcompile-static-whole  the same with Config(full_graph_compile=True): the full graph is the
                    whole decode step compiled as one by Inductor
    cgcompile-static-sq  cgcompile-static with Config(small_query_attention=True): in the full
                    graph the attention pieces are compiled, as batched matmuls over the keys
    cgcompile-static-whole-sq  cgcompile-static-whole with the same
    cgcompile-fused, cgcompile-static-sq-fused, cgcompile-static-whole-sq-fused  cgcompile,
                    cgcompile-static-sq and cgcompile-static-whole-sq with
                    Config(fuse_sibling_linears=True): q/k/v and gate/up as one matmul each
    cgcompile-static-whole-sq-fused-eager  cgcompile-static-whole-sq-fused with compiler="eager":
                    the whole-graph compile is the only compile (the prefill runs the pieces
                    as FX code)
    cgcompile-auto-sq-fused, cgcompile-auto-whole-sq-fused-eager  the settings of
                    cgcompile-static-sq-fused and cgcompile-static-whole-sq-fused-eager, handed
                    to generate()'s own compile instead: generate(cache_implementation="static",
                    compile_config=CompileConfig(backend=cgcompile.Backend(...), mode=None)).
                    generate() then compiles only the decode step, as in `static`; the prefill
                    runs eagerly
    cgcompile-auto-default  the same route under the default Config (no flags): generate()
                    compiles only the decode step with cgcompile.Backend(), the prefill runs eagerly
    static          the baseline: transformers' own fast path, generate(cache_implementation="static")
                    and nothing else. A static cache is compilable, so on CUDA generate() compiles
                    its decode step itself, torch.compile(model.__call__, **CompileConfig().to_dict())
                    (Inductor, mode="reduce-overhead"), and runs the prefill eagerly. Documented in
                    transformers/generation/configuration_utils.py (CompileConfig: "arguments relative
                    to torch.compile behavior, when using automatic compilation in generate", with a
                    cache_implementation="static" example; GenerationConfig.compile_config and
                    disable_compile); code in generation/utils.py (_valid_auto_compile_criteria;
                    _prefill calls self(...)) and modeling_utils.py (get_compiled_call).

Not a variant: the recipe of transformers' guide docs/source/en/llm_optims.md ("Static kv-cache
and torch.compile"): a static cache plus model.forward = torch.compile(model.forward,
mode="reduce-overhead", fullgraph=True). That compiles the prefill too, and StaticLayer allocates
its keys, values and cumulative_length on the first update, in the prefill: inside a CUDA graph
tree, where they become graph outputs that the next run overwrites (transformers' own comment in
StaticLayer.lazy_initialization: "As prefill should never be compiled ..."). With generate()'s
compile left on, the two reduce-overhead compilations also nest. On an H200 (torch 2.11,
transformers 5.17) the first generate() fails with "accessing tensor output of CUDAGraphs that
has been overwritten by a subsequent run" at cumulative_length.add_ in StaticLayer.update, with
generate()'s compile on or off (disable_compile=True), so it measures nothing.

    python benchmarks/hf_bench.py                                   # GPU machine, < 6 min
    python benchmarks/hf_bench.py --batches 1                       # half of it, if time is short
    python benchmarks/hf_bench.py --variants eager,cgcompile,breakable --rounds 3 --long-tokens 1000
    python benchmarks/hf_bench.py --loop --variants eager,cgcompile,breakable --long-tokens 1000  # no generate()
    python benchmarks/hf_bench.py --family qwen3_moe --variants static,cgcompile-static-default --rounds 3
    python benchmarks/hf_bench.py --model 8b --variants static,cgcompile-static-default --rounds 3
    python benchmarks/hf_bench.py --tiny --device cpu               # smoke test, CUDA-only variants skipped
    python benchmarks/hf_bench.py --tiny --device cpu --family gemma2 --variants eager,cgcompile-static-default

Method:
  - Warm-up, one variant after another: every variant starts cold, a freshly built model
    (same seed, same weights) and empty Inductor caches (so warm-up times are cold compiles
    and no variant reuses kernels another compiled; --warm-cache keeps the default cache).
    Its first call is the first generate(256 new tokens), with tracing, compilation, capture.
    That is also the largest call, so the static cache it sizes (prompt + 256) is reused by
    the shorter calls after it and nothing recompiles.
  - Timing, interleaved (benchmarks/harness.py, as every benchmark here): the host of the GPU
    machine drifts by up to 2x for seconds, so all variants of a batch stay loaded and are
    timed round-robin, --rounds times (a variant that fails drops out with its error): in each
    round every variant runs generate(max_new_tokens=1) (prefill and one token; eager
    prefill in `static`, where generate() compiles only the decode step) and
    generate(256 new tokens).
  - decode tokens/s: B * 255 / (t(256 new tokens) - t(1 new token)) per round; the median
    over rounds is the result (and the targets' ratios), the best round is shown too.
  - warm-up: first call - the median t(256 new tokens). The process's one-time start
    (CUDA context, Inductor's imports and compile workers) is paid before any variant, so
    it is not charged to whichever compiling variant happens to run first.
  - graphs: Dynamo graphs the variant's first call compiled; none may be added while timing.
  - tokens = eager: how many of the greedy tokens equal eager's (bf16, so near ties may
    part ways; informative only).
  - long run (--long-tokens N, for the --long-variants): after the rounds, one generate(N new
    tokens) with a clock read (after a synchronize) at every step; decode tokens/s in ten
    windows of the steps; "flat" is the last window's rate over the first's.
  - --log-info: cgcompile's loggers at INFO; with `--variants cgcompile-static --batches 1
    --rounds 1 --new-tokens 16`, it shows why a static-cache step ran piecewise.
  - --profile: per row, cProfile of a warm generate(64) and a torch.profiler table of a
    warm generate(8) (host and device time per op): where a decode step's time goes.
Targets (decode tokens/s): cgcompile >= 2.5x eager at batch 1; cgcompile >= 0.9x static at
every batch. Full graphs (issues 16 and 43): cgcompile-static and cgcompile-auto >= 1.2x static
at every batch, with a warm-up of at most 0.6x static's. Breakable (issue 15): >= 4x eager at
batch 1 and >= 3x at other batches; >= 0.7x cgcompile; warm-up < 3 s and < 0.2x cgcompile's; long run flat >= 0.8.
Each variant runs under try/except; a failure is a row with its error.
With OUT set, the results go to $OUT/hf_bench.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import logging
import os
import statistics
import time
import traceback
from typing import Callable

import torch
import transformers

import cgcompile
import harness
import hf_families
from cgcompile.testing.decode_model import MODEL_CONFIGS, ModelConfig
from harness import fresh_compile_cache

SHAPES = {"1b": ModelConfig(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000),
          "8b": MODEL_CONFIGS["8b"]}
TINY = ModelConfig(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=128)
TARGET_VS_EAGER = 2.5
TARGET_VS_STATIC = 0.9
BREAKABLE_VS_EAGER = {1: 4.0}  # other batches: BREAKABLE_VS_EAGER_ELSE
BREAKABLE_VS_EAGER_ELSE = 3.0
BREAKABLE_VS_CGCOMPILE = 0.7
BREAKABLE_VS_CGCOMPILE_LOOP = 0.8  # issue 32, with --loop
LONG_RUN_FLAT_LOOP = 0.9  # issue 32: flat within 10%
BREAKABLE_WARMUP_S = 3.0
BREAKABLE_WARMUP_VS_CGCOMPILE = 0.2
LONG_RUN_FLAT = 0.8
FULL_VS_STATIC = 1.2  # issue 16: cgcompile-static decode tokens/s over static's
READY_VS_STATIC = 0.6  # issue 43: a static-cache variant's warm-up over static's


@dataclasses.dataclass
class Row:
    variant: str
    batch: int
    prefill_ms: float | None = None
    decode_tok_s: float | None = None  # median over the timing rounds
    decode_tok_s_best: float | None = None
    decode_tok_s_rounds: list[float] | None = None
    first_call_s: float | None = None
    first_calls: int = 1  # generate() calls in first_call_s (3 with --keep-cache: see warm_up)
    warmup_s: float | None = None
    tokens_equal_eager: str | None = None
    dynamo_graphs: int | None = None
    cgcompile_stats: dict | None = None
    breakable_stats: dict | None = None
    long_tokens: int | None = None
    long_decode_tok_s_windows: list[float] | None = None
    long_flat: float | None = None  # last window's tokens/s over the first's
    error: str | None = None


@dataclasses.dataclass
class Loaded:
    """A warmed-up variant, kept for the interleaved timing rounds."""

    row: Row
    model: transformers.PreTrainedModel
    kwargs: dict
    backend: "cgcompile.Backend | cgcompile.GraphManager | None"
    full_s: list[float] = dataclasses.field(default_factory=list)
    one_s: list[float] = dataclasses.field(default_factory=list)
    output: torch.Tensor | None = None


# -- the variants: each prepares a fresh model; returns generate() kwargs and the backend --


def setup_eager(model, args) -> tuple[dict, None]:
    return {}, None


def setup_cgcompile(model, args, fused: bool | None = None) -> tuple[dict, cgcompile.Backend]:
    backend = cgcompile.Backend(cgcompile.Config(compiler=args.compiler, fuse_sibling_linears=fused))
    model.forward = torch.compile(model.forward, backend=backend)  # the one-line change
    return {}, backend


def setup_breakable(model, args) -> tuple[dict, cgcompile.GraphManager]:
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True)).install()  # the one-line change
    return {}, manager


# Dynamo settings a variant runs under (torch.compiler.config.patch), and nothing else does.
KV_CACHE_SOURCES = r".*past_key_values.*"  # the README's optional line for transformers users
VARIANT_COMPILER_CONFIG = {"cgcompile": {"dynamic_sources": KV_CACHE_SOURCES},
                           "cgcompile-fused": {"dynamic_sources": KV_CACHE_SOURCES},
                           "cgcompile-unfused": {"dynamic_sources": KV_CACHE_SOURCES}}


def setup_static(model, args) -> tuple[dict, None]:
    # generate() sees a compilable cache on CUDA and compiles its decode step itself.
    return {"cache_implementation": "static"}, None


def setup_cgcompile_static(model, args, whole: bool = False, small_query: bool = False,
                           fused: bool | None = None, compiler: str | None = None) -> tuple[dict, cgcompile.Backend]:
    # A static cache and attention declared capturable: each decode step one full CUDA graph.
    # disable_compile: generate() would otherwise compile the decode step itself around ours.
    config = cgcompile.Config(compiler=compiler or args.compiler, capturable_split_ops=("attention",),
                              full_graph_compile=whole,
                              small_query_attention=small_query, fuse_sibling_linears=fused)
    backend = cgcompile.Backend(config)
    model.forward = torch.compile(model.forward, backend=backend)
    return {"cache_implementation": "static", "disable_compile": True}, backend


def setup_cgcompile_static_default(model, args, fused: bool | None = None) -> tuple[dict, cgcompile.Backend]:
    # A static cache under the default Config: its automatic full graph, no flags.
    backend = cgcompile.Backend(cgcompile.Config(compiler=args.compiler, fuse_sibling_linears=fused))
    model.forward = torch.compile(model.forward, backend=backend)
    return {"cache_implementation": "static", "disable_compile": True}, backend


def setup_cgcompile_auto(model, args, whole: bool = False, compiler: str | None = None) -> tuple[dict, cgcompile.Backend]:
    # generate() compiles its decode step itself (prefill eager), with cgcompile as the backend.
    config = cgcompile.Config(compiler=compiler or args.compiler, capturable_split_ops=("attention",),
                              full_graph_compile=whole, small_query_attention=True, fuse_sibling_linears=True)
    backend = cgcompile.Backend(config)
    compile_config = transformers.CompileConfig(backend=backend, mode=None)
    return {"cache_implementation": "static", "compile_config": compile_config}, backend


def setup_cgcompile_auto_default(model, args) -> tuple[dict, cgcompile.Backend]:
    # generate()'s own compile of the decode step with the default Config: one Dynamo graph.
    backend = cgcompile.Backend(cgcompile.Config(compiler=args.compiler))
    compile_config = transformers.CompileConfig(backend=backend, mode=None)
    return {"cache_implementation": "static", "compile_config": compile_config}, backend


VARIANTS = {"eager": setup_eager, "cgcompile": setup_cgcompile, "cgcompile-3graphs": setup_cgcompile,
            "breakable": setup_breakable, "static": setup_static, "cgcompile-static": setup_cgcompile_static,
            "cgcompile-static-default": setup_cgcompile_static_default,
            "cgcompile-unfused": functools.partial(setup_cgcompile, fused=False),
            "cgcompile-static-default-unfused": functools.partial(setup_cgcompile_static_default, fused=False),
            "cgcompile-static-whole": functools.partial(setup_cgcompile_static, whole=True),
            "cgcompile-static-sq": functools.partial(setup_cgcompile_static, small_query=True),
            "cgcompile-static-whole-sq": functools.partial(setup_cgcompile_static, whole=True, small_query=True),
            "cgcompile-fused": functools.partial(setup_cgcompile, fused=True),
            "cgcompile-static-sq-fused": functools.partial(setup_cgcompile_static, small_query=True, fused=True),
            "cgcompile-static-whole-sq-fused": functools.partial(setup_cgcompile_static, whole=True, small_query=True,
                                                                 fused=True),
            "cgcompile-static-whole-sq-fused-eager": functools.partial(
                setup_cgcompile_static, whole=True, small_query=True, fused=True, compiler="eager"),
            "cgcompile-auto-sq-fused": setup_cgcompile_auto,
            "cgcompile-auto-default": setup_cgcompile_auto_default,
            "cgcompile-auto-whole-sq-fused-eager": functools.partial(setup_cgcompile_auto, whole=True, compiler="eager")}


# -- measuring ----------------------------------------------------------------------------


def shape(args) -> ModelConfig:
    return TINY if args.tiny else SHAPES[args.model]


def build_model(args, device: str | None = None) -> transformers.PreTrainedModel:
    """The --family model of the --model shape, random weights (the same for every variant);
    eos_token_id None: every generate() makes all its tokens."""
    window = hf_families.TINY_SLIDING_WINDOW if args.tiny else hf_families.SLIDING_WINDOW
    return hf_families.build(args.family, shape(args), device or args.device, getattr(torch, args.dtype),
                             max_positions=512 if args.tiny else 4096, window=window)


def make_prompt(args, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, args.prompt_len), generator=generator)  # [B, T]
    return ids.to(args.device), torch.ones_like(ids, device=args.device)


def timed(model, ids, mask, new_tokens: int, kwargs: dict) -> tuple[float, torch.Tensor]:
    """(wall seconds, output) of one greedy generate(new_tokens), or of `greedy_loop` with --loop."""
    if kwargs.get(LOOP):
        return harness.wall_s(lambda: greedy_loop(model, ids, new_tokens), ids.device)
    if "past_key_values" in kwargs:  # --keep-cache: the one cache, emptied in place
        kwargs["past_key_values"].reset()
    return harness.wall_s(
        lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kwargs),
        ids.device)


LOOP = "plain greedy loop"  # a key of a variant's kwargs under --loop (never passed to the model)


@torch.no_grad()  # as generate(): without it every cache step keeps the autograd graph of the ones before
def greedy_loop(model, ids: torch.Tensor, new_tokens: int, clock: Callable[[], None] | None = None) -> torch.Tensor:
    """A greedy decode loop written by hand, without generate(): the prompt, then one token a
    step, through a DynamicCache. No attention mask (the prompt has no padding). What serving
    code that drives the model itself pays per token: the model's forward and an argmax.
    clock: called after every decode step."""
    cache = transformers.DynamicCache(config=model.config)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    tokens = [ids]
    for step in range(new_tokens):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        if step + 1 == new_tokens:
            break
        logits = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        if clock is not None:
            clock()
    return torch.cat(tokens, dim=1)


def dynamo_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


def keep_one_cache(model, kwargs: dict, args) -> dict:
    """--keep-cache: one StaticCache for every generate() of the variant (reset before each,
    in `timed`) instead of generate()'s new cache per call."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=args.prompt_len + args.new_tokens)
    kwargs = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
    return {**kwargs, "past_key_values": cache}


def warm_up(variant: str, batch: int, args) -> Loaded:
    """Build the variant cold and make its first call (compiling, capturing)."""
    row = Row(variant, batch)
    graphs_before = dynamo_graphs()
    model = build_model(args)
    kwargs, backend = VARIANTS[variant](model, args)
    if args.loop:
        if kwargs:
            raise ValueError(f"--loop drives a DynamicCache by hand; {variant} needs generate() options {kwargs}")
        kwargs = {LOOP: True}
    if args.keep_cache and kwargs.get("cache_implementation") == "static":
        kwargs = keep_one_cache(model, kwargs, args)
    ids, mask = make_prompt(args, batch, model.config.vocab_size)
    row.first_call_s, _ = timed(model, ids, mask, args.new_tokens, kwargs)
    if "past_key_values" in kwargs:
        # A kept cache is initialised after the first call, so where the prefill is compiled
        # too, the second call's prefill is another Dynamo graph, whose full graph (a
        # static cache's prefill has one) the third call captures: warm those up as well.
        for _ in range(2):
            row.first_call_s += timed(model, ids, mask, args.new_tokens, kwargs)[0]
        row.first_calls = 3
    row.dynamo_graphs = dynamo_graphs() - graphs_before
    return Loaded(row, model, kwargs, backend)


def time_round(loaded: Loaded, args) -> None:  # appends to loaded: rates need both timings of a round
    """One timing round: generate(1 new token), then generate(all new tokens)."""
    ids, mask = make_prompt(args, loaded.row.batch, loaded.model.config.vocab_size)
    loaded.one_s.append(timed(loaded.model, ids, mask, 1, loaded.kwargs)[0])
    seconds, loaded.output = timed(loaded.model, ids, mask, args.new_tokens, loaded.kwargs)
    loaded.full_s.append(seconds)


def finish(loaded: Loaded, args, eager_output: torch.Tensor | None, graphs_after_warmup: int) -> Row:
    row, batch = loaded.row, loaded.row.batch
    rates = [batch * (args.new_tokens - 1) / (full - one) for full, one in zip(loaded.full_s, loaded.one_s)]
    row.decode_tok_s_rounds = [round(r, 1) for r in rates]
    row.decode_tok_s, row.decode_tok_s_best = statistics.median(rates), max(rates)
    row.prefill_ms = 1e3 * statistics.median(loaded.one_s)
    row.warmup_s = row.first_call_s - row.first_calls * statistics.median(loaded.full_s)
    if eager_output is not None and row.variant != "eager":
        row.tokens_equal_eager = f"{int((loaded.output == eager_output).sum())}/{loaded.output.numel()}"
    if isinstance(loaded.backend, cgcompile.GraphManager):
        row.breakable_stats = breakable_stats(loaded.backend)
    elif loaded.backend is not None:
        row.cgcompile_stats = dataclasses.asdict(loaded.backend.stats) | decode_graph_pieces(loaded.backend)
    if dynamo_graphs() != graphs_after_warmup:
        row.error = f"Dynamo compiled {dynamo_graphs() - graphs_after_warmup} graph(s) during the timing rounds"
    return row


def measure_batch(batch: int, variants: list[str], args) -> list[Row]:
    """Warm every variant up cold, then time them round-robin; one Row per variant."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    loaded, failed = [], []
    for variant in variants:
        row = run_guarded(variant, batch, args, lambda: warm_up(variant, batch, args))
        (loaded if isinstance(row, Loaded) else failed).append(row)
    graphs_after_warmup = dynamo_graphs()
    rounds = {(item.row.variant, batch): (lambda item=item: time_round(item, args)) for item in loaded}
    _, errors = harness.run_interleaved(rounds, args.rounds)
    for item in [item for item in loaded if item.row.variant in errors]:
        item.row.error = errors[item.row.variant][:500]
        failed.append(item.row)
        loaded.remove(item)
    eager_output = next((item.output for item in loaded if item.row.variant == "eager"), None)
    rows = [finish(item, args, eager_output, graphs_after_warmup) for item in loaded]
    for item in loaded:
        if args.long_tokens and item.row.variant in args.long_variants.split(","):
            long_run(item, args)
    if args.profile:
        for item in loaded:
            ids, mask = make_prompt(args, batch, item.model.config.vocab_size)
            write_profile(item.model, ids, mask, item.kwargs, f"{item.row.variant}_B{batch}")
    del loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    order = {v: i for i, v in enumerate(variants)}
    return sorted(rows + failed, key=lambda r: order[r.variant])


def write_profile(model, ids, mask, kwargs: dict, name: str, new_tokens: int = 64) -> None:
    """cProfile of one warm generate(), and a torch.profiler table of a short one: where the
    host time of a decode step goes, and what each op costs on host and device."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    timed(model, ids, mask, new_tokens, kwargs)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
    folder = os.environ.get("OUT", ".")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"profile_hf_{name}.txt"), "w") as f:
        f.write(text.getvalue())
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if ids.is_cuda else [])
    with torch.profiler.profile(activities=activities) as ops:
        timed(model, ids, mask, 8, kwargs)
    with open(os.path.join(folder, f"profile_hf_ops_{name}.txt"), "w") as f:
        f.write(f"generate(8 new tokens), {name}: ops by total host time\n")
        f.write(ops.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    ops.export_chrome_trace(os.path.join(folder, f"trace_hf_{name}.json"))


class StepClock:
    """A stopping criterion that never stops: records the time after every decode step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        harness.synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def long_run(loaded: Loaded, args, windows: int = 10) -> None:
    """generate(--long-tokens) with a clock at every step: does decode slow down as the cache grows?"""
    from transformers import StoppingCriteriaList

    row = loaded.row
    ids, mask = make_prompt(args, row.batch, loaded.model.config.vocab_size)
    clock = StepClock(ids.device)
    if loaded.kwargs.get(LOOP):
        greedy_loop(loaded.model, ids, args.long_tokens, clock=lambda: clock(ids, None))
    else:
        loaded.model.generate(ids, attention_mask=mask, max_new_tokens=args.long_tokens, do_sample=False,
                              stopping_criteria=StoppingCriteriaList([clock]), **loaded.kwargs)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]  # decode steps 2..N
    per = max(len(steps) // windows, 1)
    rates = [row.batch * per / sum(steps[i:i + per]) for i in range(0, per * windows, per) if steps[i:i + per]]
    row.long_tokens = args.long_tokens
    row.long_decode_tok_s_windows = [round(r, 1) for r in rates]
    row.long_flat = rates[-1] / rates[0] if rates else None


def breakable_stats(manager) -> dict:
    runners = manager.breakable.runners
    return {"runners": len(runners), "graphs": manager.breakable.graph_count(),
            "graph_segments": manager.session.graphs_captured, "graph_memory_bytes": manager.graph_memory()}


def decode_graph_pieces(backend) -> dict:
    last = backend.stats.graphs_seen - 1
    pieces = [p for p in backend.pieces if p.graph_index == last]
    return {"decode_graph_pieces": len(pieces), "decode_graph_capturable": sum(p.capturable for p in pieces)}


def warmup_parts(warmup_s: float, stats: dict) -> str:
    """A cgcompile warm-up taken apart by the Backend's own clocks: Inductor's piece compiles
    (AOT tracing included), the full graphs' compiles, and the rest (Dynamo's tracing, the
    split, the captures)."""
    pieces = stats.get("compile_s", 0.0) + stats.get("specialise_s", 0.0)
    full = stats.get("full_graph_compile_s", 0.0)
    return (f"piece compiles {pieces:.1f} s, full-graph compiles {full:.1f} s, "
            f"the rest (Dynamo, split, captures) {warmup_s - pieces - full:.1f} s")


def needs_cuda(variant: str) -> bool:
    """Whether generate() compiles the variant's decode step itself: it does so on accelerators
    only, and elsewhere would run it eagerly under the variant's name."""
    return variant == "static" or variant.startswith("cgcompile-auto")


def run_guarded(variant: str, batch: int, args, warm):
    """warm() under the variant's compile settings, or a Row with the error: one broken
    variant must not end the run."""
    if needs_cuda(variant) and args.device != "cuda":
        return Row(variant, batch, error="skipped: needs CUDA (generate() compiles a static cache on accelerators only)")
    try:
        settings = VARIANT_COMPILER_CONFIG.get(variant, {})
        with fresh_compile_cache(args.warm_cache), torch.compiler.config.patch(**settings):
            return warm()
    except Exception as e:
        traceback.print_exc()
        return Row(variant, batch, error=f"{type(e).__name__}: {e}"[:500])


# -- report -------------------------------------------------------------------------------


def rate(rows: list[Row], variant: str, batch: int) -> float | None:
    return next((r.decode_tok_s for r in rows if (r.variant, r.batch) == (variant, batch)), None)


def targets(rows: list[Row], batches: list[int], loop: bool = False) -> list[dict]:
    checks = [("cgcompile / eager", b, "eager", TARGET_VS_EAGER) for b in batches if b == 1]
    checks += [("cgcompile / static", b, "static", TARGET_VS_STATIC) for b in batches]
    result = []
    for name, batch, base, threshold in checks:
        ours, theirs = rate(rows, "cgcompile", batch), rate(rows, base, batch)
        result.append(judge(name, batch, ours / theirs if ours and theirs else None, threshold))
    if any(r.variant == "breakable" for r in rows):
        result += breakable_targets(rows, batches, loop)
    for full in sorted({r.variant for r in rows if r.variant.startswith(("cgcompile-static", "cgcompile-auto"))}):
        result += full_graph_targets(rows, batches, full)
    return result


def full_graph_targets(rows: list[Row], batches: list[int], full: str) -> list[dict]:
    """Issues 16 and 43: cgcompile's full graphs on a static cache against transformers' own
    static path, in tokens/s and in warm-up."""
    result = []
    for batch in batches:
        ours, theirs = rate(rows, full, batch), rate(rows, "static", batch)
        warm = [next((r.warmup_s for r in rows if (r.variant, r.batch) == (v, batch)), None)
                for v in (full, "static")]
        result += [
            judge(f"{full} / static", batch, ours / theirs if ours and theirs else None, FULL_VS_STATIC),
            judge(f"{full} warm-up / static's", batch,
                  warm[0] / warm[1] if warm[0] is not None and warm[1] else None, READY_VS_STATIC, higher=False),
        ]
    return result


def breakable_targets(rows: list[Row], batches: list[int], loop: bool = False) -> list[dict]:
    """Issue 15's targets for the breakable row (a missing baseline gives n/a); with --loop,
    issue 32's ratio to cgcompile and flatness."""
    result = []
    for batch in batches:
        ours, eager, compiled = (rate(rows, v, batch) for v in ("breakable", "eager", "cgcompile"))
        row = next((r for r in rows if (r.variant, r.batch) == ("breakable", batch)), None)
        compiled_row = next((r for r in rows if (r.variant, r.batch) == ("cgcompile", batch)), None)
        warmup = row.warmup_s if row else None
        compiled_warmup = compiled_row.warmup_s if compiled_row else None
        result += [
            judge("breakable / eager", batch, ours / eager if ours and eager else None,
                  BREAKABLE_VS_EAGER.get(batch, BREAKABLE_VS_EAGER_ELSE)),
            judge("breakable / cgcompile", batch, ours / compiled if ours and compiled else None,
                  BREAKABLE_VS_CGCOMPILE_LOOP if loop else BREAKABLE_VS_CGCOMPILE),
            judge("breakable warm-up s", batch, warmup, BREAKABLE_WARMUP_S, higher=False),
            judge("breakable warm-up / cgcompile's", batch,
                  warmup / compiled_warmup if warmup is not None and compiled_warmup else None,
                  BREAKABLE_WARMUP_VS_CGCOMPILE, higher=False),
        ]
        if row is not None and row.long_flat is not None:
            result.append(judge(f"breakable flat over {row.long_tokens}", batch, row.long_flat,
                                 LONG_RUN_FLAT_LOOP if loop else LONG_RUN_FLAT))
    return result


def judge(name: str, batch: int, ratio: float | None, threshold: float, higher: bool = True) -> dict:
    if ratio is None:
        status = "n/a"
    else:
        status = "PASS" if (ratio >= threshold if higher else ratio < threshold) else "FAIL"
    return {"target": name, "batch": batch, "ratio": ratio, "threshold": threshold,
            "better": "higher" if higher else "lower", "status": status}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def weight_floor(args) -> dict | None:
    """On CUDA: the bytes a token's decode step reads from the weights (a model on the meta
    device counts them), the measured copy bandwidth, and the decode tokens/s that reading
    them once a step allows at each batch (KV cache reads left out)."""
    info = hf_families.describe(build_model(args, device="meta"))
    if args.device != "cuda":
        return {"model": info}
    peak_gbs = harness.measure_peak_bandwidth(torch.device(args.device))
    step_ms = harness.floor_ms(info["step_weight_bytes"], peak_gbs)
    batches = [int(b) for b in args.batches.split(",")]
    return {"model": info, "peak_gbs": peak_gbs, "floor_step_ms": step_ms,
            "floor_tok_s": {b: b / step_ms * 1e3 for b in batches}}


def format_floor(floor: dict) -> str:
    info = floor["model"]
    text = f"{info['family']}, {info['parameters'] / 1e9:.2f}B parameters: {info}"
    if "floor_step_ms" not in floor:
        return text
    rates = ", ".join(f"{rate:.0f} at batch {b}" for b, rate in floor["floor_tok_s"].items())
    moe = (f" (only the {info['experts_per_token']} of {info['experts']} experts one token reads: a lower bound "
           "where a step's tokens route to more)") if "experts" in info else ""
    return (f"{text}\nweight-bytes floor: {info['step_weight_bytes'] / 1e9:.2f} GB a step{moe} at "
            f"{floor['peak_gbs']:.0f} GB/s: {floor['floor_step_ms']:.3f} ms a step, decode tok/s at most {rates}")


def print_table(rows: list[Row], checks: list[dict], floor: dict | None = None) -> None:
    if floor:
        print("\n== " + format_floor(floor))
    print(f"\n{'variant':<17} {'batch':>5} {'prefill ms':>10} {'decode tok/s':>12} {'(best)':>8} {'x eager':>8} "
          f"{'warm-up s':>9} {'first call s':>12} {'graphs':>6}  tokens = eager")
    for r in rows:
        eager = rate(rows, "eager", r.batch)
        ratio = r.decode_tok_s / eager if r.decode_tok_s and eager else None
        if r.error:
            print(f"{r.variant:<17} {r.batch:>5}  {r.error}")
            continue
        print(f"{r.variant:<17} {r.batch:>5} {fmt(r.prefill_ms, '10.1f')} {fmt(r.decode_tok_s, '12.1f')} "
              f"{fmt(r.decode_tok_s_best, '8.1f')} "
              f"{fmt(ratio, '7.2f')}x {fmt(r.warmup_s, '9.2f')} {fmt(r.first_call_s, '12.1f')} "
              f"{fmt(r.dynamo_graphs, '6d')}  {r.tokens_equal_eager or '-'}")
    for r in rows:
        if r.cgcompile_stats:
            print(f"cgcompile batch {r.batch}: {r.cgcompile_stats}")
            if r.warmup_s is not None:
                print(f"{r.variant} batch {r.batch} warm-up parts: {warmup_parts(r.warmup_s, r.cgcompile_stats)}")
        if r.breakable_stats:
            print(f"breakable batch {r.batch}: {r.breakable_stats}")
        if r.long_decode_tok_s_windows:
            print(f"{r.variant} batch {r.batch}, {r.long_tokens} new tokens, decode tok/s per tenth: "
                  f"{r.long_decode_tok_s_windows} (last / first {fmt(r.long_flat, '.2f')})")
    print()
    for c in checks:
        sign = ">=" if c.get("better", "higher") == "higher" else "<"
        print(f"target {c['target']:<32} batch {c['batch']}: {fmt(c['ratio'], '.2f')} ({sign} {c['threshold']}) "
              f"{c['status']}")


def environment(args) -> dict:
    return harness.environment(
        args.device, transformers=transformers.__version__, family=args.family,
        model="tiny" if args.tiny else args.model, shape=dataclasses.asdict(shape(args)), dtype=args.dtype,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, compiler=args.compiler, rounds=args.rounds,
        long_tokens=args.long_tokens, loop=args.loop, keep_cache=args.keep_cache, cudnn_attention=torch.backends.cuda.cudnn_sdp_enabled(),
        process_start_s=getattr(args, "process_start_s", None))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and short runs: a smoke test")
    parser.add_argument("--family", choices=hf_families.FAMILIES, default="llama",
                        help="the model's family, at the --model shape (hf_families.py)")
    parser.add_argument("--model", choices=sorted(SHAPES), default="1b", help="the layer shape (--tiny overrides it)")
    parser.add_argument("--variants", default="eager,cgcompile,static", help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --tiny)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (16 with --tiny)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5, 2 with --tiny)")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default=None,
                        help="cgcompile's piece compiler; default inductor on CUDA, eager on CPU")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--warm-cache", action="store_true", help="keep the default Inductor cache")
    parser.add_argument("--keep-cache", action="store_true",
                        help="static-cache variants pass one StaticCache to every generate() (reset in place) "
                             "instead of letting generate() make a new one per call; their warm-up is then three "
                             "calls, less three timed ones")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one warm generate() per row, and a torch.profiler op table "
                             "($OUT/profile_hf_*.txt)")
    parser.add_argument("--long-tokens", type=int, default=0,
                        help="after timing, one generate() of this many new tokens, timed per step (0: none)")
    parser.add_argument("--long-variants", default="breakable", help="comma-separated variants the long run covers")
    parser.add_argument("--log-info", action="store_true",
                        help="cgcompile's loggers at INFO: e.g. the first step of each reason a full graph "
                             "was not replayed names the input that differed from the captured one")
    parser.add_argument("--loop", action="store_true",
                        help="decode with a plain greedy loop over a DynamicCache (`greedy_loop`) instead of "
                             "generate(); for the variants that need no generate() options. The breakable "
                             "target is then issue 32's (>= 0.8x cgcompile)")
    parser.add_argument("--no-cudnn-attention", action="store_true",
                        help="turn off SDPA's cuDNN backend for every variant (it builds a plan per key length)")
    args = parser.parse_args(argv)
    if args.log_info:
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
        logging.getLogger("cgcompile").setLevel(logging.INFO)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    on_cuda = args.device == "cuda"
    args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (16 if args.tiny else 256)
    args.rounds = args.rounds or (2 if args.tiny else 5)
    args.compiler = args.compiler or ("inductor" if on_cuda else "eager")
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    if args.tiny and not on_cuda:
        # A tiny model on a small CPU: intra-op threads only contend (SDPA took 16 ms a call with
        # two threads, 9 us with one), and the noise made t(16 tokens) - t(1 token) negative.
        torch.set_num_threads(1)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    variants = args.variants.split(",")
    if "eager" in variants:  # eager first: its tokens are the reference
        variants = ["eager"] + [v for v in variants if v != "eager"]
    print(environment(args))
    process_s = args.process_start_s = start_process(args)
    print(f"process start-up (CUDA context, Inductor and Triton): {process_s:.1f} s, in no variant's warm-up")
    floor = weight_floor(args)
    print(format_floor(floor), flush=True)
    rows = []
    for batch in batches:
        for row in measure_batch(batch, variants, args):
            rows.append(row)
            print(row, flush=True)
        write_json(args, rows, targets(rows, batches, args.loop), floor)  # after every batch: a killed run keeps its rows
    checks = targets(rows, batches, args.loop)
    print_table(rows, checks, floor)
    if write_json(args, rows, checks, floor):
        print(f"wrote {os.environ['OUT']}/hf_bench.json")


def start_process(args) -> float:
    """Pay the process's one-time costs before any variant: the CUDA context and cuBLAS
    handles, and Inductor's start (imports, compile workers, Triton's launcher build).
    Whichever compiling variant came first would otherwise carry them in its warm-up."""
    def start() -> None:
        x = torch.ones(64, 64, device=args.device)
        x @ x
        if args.device == "cuda" or args.compiler == "inductor":  # on the CPU by default nothing runs Inductor
            with fresh_compile_cache(args.warm_cache):
                torch.compile(lambda a: torch.relu(a @ a) + 1)(x)
        torch._dynamo.reset()

    return harness.wall_s(start, args.device)[0]


def write_json(args, rows: list[Row], checks: list[dict], floor: dict) -> bool:
    if not os.environ.get("OUT"):
        return False
    harness.write_json(harness.default_out("hf_bench.json"), {
        "environment": environment(args), "rows": [dataclasses.asdict(r) for r in rows], "targets": checks,
        "floor": floor})
    return True


if __name__ == "__main__":
    main()
