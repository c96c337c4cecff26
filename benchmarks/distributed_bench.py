"""Decode on N GPUs (issues 19, 41): tensor parallel and pipeline parallel with cgcompile.

    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py                 # 8b and 1b, bf16, NCCL
    torchrun --nproc-per-node 4 benchmarks/distributed_bench.py --models 70b --batches 1,8   # TP=4, 70B class
    torchrun --nproc-per-node 4 benchmarks/distributed_bench.py --models 8b --parts pp,tppp   # PP=4; 2 stages x TP=2
    torchrun --nproc-per-node 4 benchmarks/distributed_bench.py --models 8b --parts tp --tp-head both   # LM heads
    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py --device cpu --tiny   # smoke test (gloo)

TP runs over every rank (TP=N, variant names tpN-...); TP=1 is rank 0 alone. The 70B-class
shape (hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate 28672, vocab 128256) fits no
single GPU: each rank builds only its own shard (the full model on the meta device, sharded
there, materialised with random weights on the GPU), and only the TP variants run. The LM
head is split by vocabulary (--tp-head vocab, the default: each rank computes its 1/N of the
logits and one all-gather joins them) or replicated on every rank (--tp-head replicated; both:
each TP=N variant once per head, the replicated one's name ending in -replicated-head). Every
TP row carries the per-rank weight-bytes floor: the bytes of the rank's weights that a step
reads (its shard of every layer and its head, 1/N of the head or all of it; the embedding's
few rows left out) over the bandwidth of one device-to-device copy measured at start
(benchmarks/harness.py), and the step over that floor (target <= 1.3 for 70b TP=4 at batch 1).

Variants, each on the decode model of cgcompile/testing/decode_model.py with random weights:
    tpN-cgcompile   TensorParallelDecoder (one all-reduce per attention block and per MLP,
                    one all-gather of the logits with the vocab-parallel head) compiled with
                    cgcompile on both ranks: step time at batch 1, 8, 64
    tpN-eager       the same model, eager
    tp1-cgcompile   the unsharded model compiled with cgcompile on rank 0 alone
    tpN-cgcompile-full, tp1-cgcompile-full
                    the same with static attention (a device-side position, the whole
                    cache masked) declared capturable: one CUDA graph per step, the
                    all-reduces inside it (Config.capturable_split_ops)
    tpN-cgcompile-full-sq, tp1-cgcompile-full-sq
                    the same with that attention compiled as batched matmuls over the keys
                    (Config.small_query_attention; CUDA only)
    single          the unsharded model compiled with cgcompile on rank 0 alone at every
                    --pp-batches batch (tokens/s = batch / step); the batch of the most tokens/s
                    is the pipeline's micro-batch, as a server would size it
    ppN-cgcompile   N StageDecoders, one per rank, N micro-batches of that size in flight
                    (cgcompile.parallel.pipeline.ring_schedule): tokens/s
    ppN-eager       the same stages, eager
    tpTppS-cgcompile, tpTppS-eager (--parts tppp, --tp T)
                    S = N / T stages of T ranks each: each stage's layers tensor parallel
                    over its ranks (a (stages, T) device mesh), the same pipeline over them
    all-reduce      a TP step's 64 all-reduces of [batch, hidden] alone, captured in one CUDA
                    graph: microseconds per all-reduce (what TP=2 pays that TP=1 does not)
    all-reduce-fast the same through cgcompile's fast all-reduce (`cgcompile::all_reduce`,
                    torch symmetric memory where the group allows it; CUDA only)

--all-reduce auto|nccl sets Config.all_reduce for every compiled variant (docs/parallel.md),
--no-fuse-norm turns Config.fuse_all_reduce_norm off, --fuse-linear turns Config.fuse_linear_all_reduce on, --no-skinny Config.skinny_linears,
--no-decode-attention-kernel Config.decode_attention_kernel, --tp-head the LM head of the TP=N
variants (vocab, replicated or both);
--tp-variants picks TP variants (cgcompile, eager, full: both full-graph ones, full-sq: the
small-query one alone, full-whole-sq: that one with the whole graph compiled once more
(Config.full_graph_compile), tp1: rank 0 alone); --json writes rank 0's rows to a file. NVLink
multicast stays off in every run.

Method: one process per GPU; every variant is compiled, captured and warmed up on
--warmup steps before timing; TP step time is the median of --steps steps, each timed
with CUDA events by the shared harness (benchmarks/harness.py; both ranks run the same
steps, in lockstep through their all-reduces); PP throughput is batch x steps over the
wall time of --steps decode steps of both micro-batches, synchronised at both ends. The
cache holds FILL positions before the first step; each step writes the next position. Ratios, not absolute numbers, are the verdicts:
  TP: tp1-cgcompile / tp2-cgcompile >= 1.6 at batch 1 (8b), tp1 / tp4 >= 2.5; tpN-eager / tpN-cgcompile >= 4;
      70b tp4-cgcompile <= 1.3x the per-rank weight-bytes floor at batch 1
  PP: pp2-cgcompile / single at its best batch >= 1.6 (tokens/s; each micro-batch that batch)
Rank 0 prints one JSON line per measurement and the ratios at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cgcompile  # noqa: E402
from benchmarks import harness  # noqa: E402  (the method every benchmark here shares)
from cgcompile.parallel.distributed import prepare_collectives, torchrun_worker  # noqa: E402
from cgcompile.parallel.pipeline import PipelineStage, TensorSpec, ring_schedule, stage_layers  # noqa: E402
from cgcompile.testing.decode_model import (MODEL_CONFIGS, HostLengthDecoder, Llama, ModelConfig,  # noqa: E402
                                            StaticMaskDecoder, use_length_independent_attention_kernels)
from cgcompile.testing.parallel_model import StageDecoder, TensorParallelDecoder, stage_groups  # noqa: E402

CONFIGS = {**MODEL_CONFIGS, "8b": ModelConfig(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
           "70b": ModelConfig(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256)}
SHARD_ONLY = {"70b"}  # no rank can hold the whole model: TP variants only, each rank its shard
FILL = 256
ALL_REDUCE = "auto"  # Config.all_reduce of every compiled variant (--all-reduce)
MATVEC = False  # Config.matvec_as_reduction of every compiled variant on CUDA (--matvec-as-reduction)
FUSE_NORM = True  # Config.fuse_all_reduce_norm of every compiled variant (--no-fuse-norm)
FUSE_LINEAR = False  # Config.fuse_linear_all_reduce of every compiled variant (--fuse-linear)
SKINNY = True  # Config.skinny_linears of every compiled variant (--no-skinny)
DECODE_KERNEL = True  # Config.decode_attention_kernel of every compiled variant (--no-decode-attention-kernel)
HEAD_SUFFIX = {"vocab": "", "replicated": "-replicated-head"}  # TP=N variant names by TensorParallelDecoder head


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--models", default="8b,1b")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="smoke test: tiny model, fp32, 3 steps")
    p.add_argument("--all-reduce", default="auto", choices=["auto", "symm_mem", "nccl"], help="Config.all_reduce")
    p.add_argument("--matvec-as-reduction", action="store_true",
                   help="on CUDA, every compiled variant with Config(matvec_as_reduction=True) and Inductor's "
                        "coordinate-descent tuning: one-row linears as reductions (docs/performance.md)")
    p.add_argument("--no-fuse-norm", action="store_true",
                   help="Config(fuse_all_reduce_norm=False): each all-reduce, residual add and RMS norm apart")
    p.add_argument("--fuse-linear", action="store_true",
                   help="Config(fuse_linear_all_reduce=True): the one-row product before a fused all-reduce "
                        "writes its row into the peers' Lamport slots itself")
    p.add_argument("--no-skinny", action="store_true",
                   help="Config(skinny_linears=False): one-row linears keep cuBLAS")
    p.add_argument("--no-decode-attention-kernel", action="store_true",
                   help="Config(decode_attention_kernel=False): full-sq's attention as batched matmuls")
    p.add_argument("--json", default=None, help="write rank 0's rows here")
    p.add_argument("--tp-variants", default="cgcompile,eager,full,tp1",
                   help="TP variants: cgcompile, eager, full (both full-graph ones), full-sq (the small-query one), "
                        "full-whole-sq (that one compiled whole), tp1 (rank 0 alone)")
    p.add_argument("--parts", default="pp,tp,allreduce",
                   help="which of pp (pipeline), tppp (pipeline of tensor-parallel stages, --tp ranks each), "
                        "tp (tensor parallel) and allreduce (the step's all-reduces alone) to run")
    p.add_argument("--pp-batches", default="16,32,64,128",
                   help="batches one GPU runs alone (rank 0); the one of the most tokens/s is each pipeline "
                        "stage's micro-batch")
    p.add_argument("--tp", type=int, default=2, help="ranks per pipeline stage in --parts tppp")
    p.add_argument("--tp-head", default="vocab", choices=["vocab", "replicated", "both"],
                   help="the TP=N variants' LM head: split by vocabulary, replicated on every rank, or both side "
                        "by side (the replicated rows' names end in -replicated-head)")
    args = p.parse_args()
    if args.tiny:
        args.models, args.steps, args.warmup, args.pp_batches = "tiny", 3, 2, "2,4"
    args.tp_heads = ("vocab", "replicated") if args.tp_head == "both" else (args.tp_head,)
    return args


def make_backend(device, reuse=False, full=False, small_query=False, sizes=(1, 8, 32, 64), whole=False):
    """full: the static-attention model, attention declared capturable, so a decode step
    whose cache and position buffers stay put replays one CUDA graph (issue 16).
    small_query: that graph's attention compiled as batched matmuls (Config.small_query_attention).
    whole: the full graph compiled whole once more (Config.full_graph_compile)."""
    cuda = device.type == "cuda"
    split = {"capturable_split_ops": ("attention",)} if full else {"splitting_ops": ["cgbench::decode_attention"]}
    matvec = {"matvec_as_reduction": True, "inductor_options": {"coordinate_descent_tuning": True}} \
        if MATVEC and cuda else {}
    return cgcompile.Backend(cgcompile.Config(
        capture_sizes=tuple(sorted(set(sizes))), compiler="inductor" if cuda else "eager",
        capture_error_mode="thread_local",
        reuse_output_buffers=reuse, small_query_attention=small_query, full_graph_compile=whole, all_reduce=ALL_REDUCE,
        fuse_all_reduce_norm=FUSE_NORM, fuse_linear_all_reduce=FUSE_LINEAR, skinny_linears=SKINNY, decode_attention_kernel=DECODE_KERNEL,
        **split, **matvec))


def full_variants(device, variants) -> tuple[tuple[str, bool, bool], ...]:
    """(name suffix, small_query, whole) of the full-graph variants that --tp-variants names:
    "full" both, "full-sq" the small-query one alone, "full-whole-sq" the small-query one
    compiled whole (small-query ones need Inductor, which the CPU smoke run leaves out)."""
    chosen = (("full", False, False), ("full-sq", True, False)) if "full" in variants else \
        (("full-sq", True, False),) if "full-sq" in variants else ()
    chosen += (("full-whole-sq", True, True),) if "full-whole-sq" in variants else ()
    return tuple(v for v in chosen if device.type == "cuda" or not v[1])


def build_llama(cfg, device, dtype):
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            llama = Llama(cfg)
    finally:
        torch.set_default_dtype(previous)
    llama.fill_caches(FILL)
    return llama


def step_seconds(fn, device, batch, args, device_position=False):
    """Median seconds of one decode step fn(ids, start), timed by the shared harness (CUDA
    events around each step after untimed warm-up steps). Tensor-parallel ranks run in
    lockstep through their all-reduces, so no barrier is needed between steps.
    device_position: start is a [1] device tensor (made before timing), not a host int."""
    ids = torch.arange(batch, device=device) % 100
    starts = [FILL + k for k in range(max(args.steps, args.warmup))]
    if device_position:
        starts = [torch.tensor([s], device=device) for s in starts]
    ms = harness.time_steps(lambda k: fn(ids, starts[k]), args.steps, args.warmup, device)
    return statistics.median(ms) / 1e3


def full_graph_share(backend) -> str:
    stats = backend.stats
    return f"{stats.full_graph_calls}/{stats.full_graph_calls + stats.piecewise_calls}"


def tensor_parallel(llama, device, args, report, floor):
    for head in args.tp_heads:
        model = TensorParallelDecoder(llama, head=head)
        sharded_variants(model, device, args, report, floor, head)
        del model
    variants = args.tp_variants.split(",")
    if dist.get_rank() == 0 and "tp1" in variants:
        single = torch.compile(HostLengthDecoder(llama), backend=make_backend(device))
        for batch in map(int, args.batches.split(",")):
            report("tp1-cgcompile", batch, step_s=step_seconds(single, device, batch, args))
        del single
        torch._dynamo.reset()
        for suffix, small_query, whole in full_variants(device, variants):
            run_full(f"tp1-cgcompile-{suffix}", StaticMaskDecoder(llama), device, args, report, small_query,
                     whole=whole)
    dist.barrier()


def sharded_variants(model, device, args, report, floor, head):
    """The TP=N variants of --tp-variants on `model` (this rank's TensorParallelDecoder with
    LM head `head`), named tpN-<variant> and the head's suffix."""
    tp, variants, suffix = f"tp{dist.get_world_size()}", args.tp_variants.split(","), HEAD_SUFFIX[head]
    floor = functools.partial(floor, weight_bytes(model))
    prepare_collectives(device, all_reduce=ALL_REDUCE)
    compiled = torch.compile(model, backend=make_backend(device))
    for batch in map(int, args.batches.split(",")):
        for variant, fn in (("cgcompile", compiled), ("eager", model)):
            if variant in variants:
                step_s = step_seconds(fn, device, batch, args)
                report(f"{tp}-{variant}{suffix}", batch, step_s=step_s, **floor(step_s))
    del compiled
    torch._dynamo.reset()
    for full, small_query, whole in full_variants(device, variants):
        run_full(f"{tp}-cgcompile-{full}{suffix}", model, device, args, report, small_query, floor, whole)


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads on this rank: every parameter (the layers'
    shards, and the LM head's rows this rank holds: 1/N of it split by vocabulary, all of it
    replicated) but the embedding table, of which a step reads only its batch's rows."""
    return harness.parameter_bytes(model) - harness.parameter_bytes(model.embed)


def floor_of(peak_gbs: float | None, nbytes: int, step_s: float) -> dict:
    """The per-rank weight-bytes floor of a step and the step over it (CUDA only)."""
    if not peak_gbs:
        return {}
    floor_ms = harness.floor_ms(nbytes, peak_gbs)
    return {"weight_gb": round(nbytes / 1e9, 2), "floor_ms": round(floor_ms, 3),
            "over_floor": round(step_s * 1e3 / floor_ms, 2)}


def build_shard(cfg, device, dtype, head="vocab"):
    """This rank's TensorParallelDecoder of `cfg` (LM head `head`) and nothing more: the whole
    model is built and sharded on the meta device (no memory), then the shard is materialised
    on `device` with random weights (ones for the norms) and caches filled to FILL positions."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = TensorParallelDecoder(Llama(cfg), head=head)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    for p in model.parameters():
        p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=generator)
    for layer in model.layers:
        for cache in (layer.k_cache, layer.v_cache):
            cache.zero_()
            cache[:, :, :FILL].normal_(generator=generator)
    return model


def run_full(name, model, device, args, report, small_query, floor=lambda step_s: {}, whole=False):
    """Time a full-graph variant at every batch (one static Dynamo graph per batch); floor:
    the step's weight-bytes floor fields, as `floor_of` makes them (none for TP=1)."""
    backend = make_backend(device, full=True, small_query=small_query, whole=whole)
    full = torch.compile(model, backend=backend, dynamic=False)
    for batch in map(int, args.batches.split(",")):
        step_s = step_seconds(full, device, batch, args, device_position=True)
        report(name, batch, step_s=step_s, full_graph_calls=full_graph_share(backend), **floor(step_s))
    del full, backend
    torch._dynamo.reset()


def best_single_batch(cfg, device, dtype, args, report) -> int:
    """One GPU alone (rank 0) at every --pp-batches batch: the batch of the most tokens/s,
    which sets the pipeline's micro-batch (each stage then runs what one GPU runs best)."""
    batches = [int(b) for b in args.pp_batches.split(",")]
    best = [None]
    if dist.get_rank() == 0:
        llama = build_llama(dataclasses.replace(cfg, max_batch=max(batches)), device, dtype)
        single = torch.compile(HostLengthDecoder(llama), backend=make_backend(device, sizes=batches))
        tokens_per_s = {}
        for batch in batches:
            step_s = step_seconds(single, device, batch, args)
            tokens_per_s[batch] = batch / step_s
            report("single", batch, step_s=step_s, tokens_per_s=tokens_per_s[batch])
        best = [max(tokens_per_s, key=tokens_per_s.get)]
        del single, llama
        torch._dynamo.reset()
        harness.release_memory(device)
    dist.broadcast_object_list(best, src=0)
    return best[0]


def pipeline(cfg, device, dtype, args, report, mb: int, tp: int = 1):
    """PP over every rank's stage (tp ranks per stage, tensor parallel inside it), one
    micro-batch of `mb` rows per stage in flight: tokens/s of cgcompile and eager."""
    pp_group, tp_group = stage_groups(tp, device)
    stage, stages = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    batch = mb * stages  # rows in flight
    llama = build_llama(dataclasses.replace(cfg, max_batch=max(cfg.max_batch, batch)), device, dtype)
    model = StageDecoder(llama, stage_layers(cfg.layers, stages, stage), tp_group)
    del llama  # the stage keeps its layers (and, with tp, its shards)
    harness.release_memory(device)
    if tp_group is not None:
        prepare_collectives(device, tp_group, all_reduce=ALL_REDUCE)
    prefix = f"pp{stages}" if tp == 1 else f"tp{tp}pp{stages}"
    for name in (f"{prefix}-cgcompile", f"{prefix}-eager"):
        backend = make_backend(device, reuse=True, sizes=(mb,)) if name.endswith("-cgcompile") else None
        run = torch.compile(model, backend=backend) if backend else model
        hidden = {"hidden": TensorSpec((cfg.hidden,), dtype)}
        tokens = {"tokens": TensorSpec((), torch.int64)}
        stage_io = PipelineStage(receives=tokens if stage == 0 else hidden,
                                 sends=tokens if stage == stages - 1 else hidden,
                                 max_rows=mb, device=device, group=pp_group, backend=backend)
        stage_io.connect()
        first = torch.arange(batch, device=device) % 100

        def decode(steps, base):
            received = None
            for tick in ring_schedule(stages, stage, steps * stages):
                outputs = None
                if tick.item is not None:
                    micro, step = tick.item % stages, tick.item // stages
                    x = first[micro * mb:(micro + 1) * mb] if stage == 0 and step == 0 else \
                        received["tokens" if stage == 0 else "hidden"]
                    outputs = {"tokens" if stage == stages - 1 else "hidden": run(x, base + step, micro * mb)}
                received = stage_io.exchange(outputs, mb if tick.receive else None)

        def timed_steps():  # until every rank is done
            decode(args.steps, FILL + args.warmup)
            harness.synchronize(device)
            dist.barrier()

        decode(args.warmup, FILL)
        dist.barrier()
        seconds, _ = harness.wall_s(timed_steps, device)
        report(name, batch, tokens_per_s=batch * args.steps / seconds, micro_batch=mb)
        del run, stage_io, backend
        torch._dynamo.reset()
    del model
    harness.release_memory(device)
    dist.barrier()


def all_reduce_latency(cfg, device, dtype, args, report, per_step: int = 64):
    """What the all-reduces of one tensor-parallel decode step cost alone: `per_step` of
    them (two per layer) on a [batch, hidden] tensor, captured in one CUDA graph as the
    pieces hold them (eager on CPU), timed like a step; reported per all-reduce."""
    for batch in map(int, args.batches.split(",")):
        x = torch.ones(batch, cfg.hidden, device=device, dtype=dtype)
        dist.all_reduce(x)  # creates the communicator outside any capture
        step = lambda k: [dist.all_reduce(x) for _ in range(per_step)]  # noqa: E731
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step(0)  # warm-up on the side stream, as before any capture
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                step(0)
            step = lambda k: graph.replay()  # noqa: E731
        ms = harness.time_steps(step, args.steps, args.warmup, device)
        report("all-reduce", batch, us_per_all_reduce=statistics.median(ms) * 1e3 / per_step)
        if device.type == "cuda":
            graph.reset()  # before teardown: a live graph holding NCCL work blocks it
            report("all-reduce-fast", batch, us_per_all_reduce=fast_all_reduce_us(x, device, args, per_step))
    dist.barrier()


def fast_all_reduce_us(x, device, args, per_step: int) -> float:
    """`all_reduce_latency`'s graph with cgcompile's fast all-reduce in place of NCCL's."""
    prepare_collectives(device, all_reduce=ALL_REDUCE)
    name = dist.group.WORLD.group_name
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    step = lambda k: [torch.ops.cgcompile.all_reduce(x, "sum", name) for _ in range(per_step)]  # noqa: E731
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(0)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        step(0)
    ms = harness.time_steps(lambda k: graph.replay(), args.steps, args.warmup, device)
    graph.reset()
    return statistics.median(ms) * 1e3 / per_step


def whole_model_parts(cfg, device, dtype, args, report, floor):
    """--parts on a model every rank builds whole (each keeps its part of it)."""
    parts = args.parts.split(",")
    if "pp" in parts or "tppp" in parts:
        mb = best_single_batch(cfg, device, dtype, args, report)
        if "pp" in parts:
            pipeline(cfg, device, dtype, args, report, mb)
        if "tppp" in parts:
            pipeline(cfg, device, dtype, args, report, mb, tp=args.tp)
    llama = build_llama(cfg, device, dtype)
    if "tp" in parts:
        tensor_parallel(llama, device, args, report, floor)
    if "allreduce" in parts:
        all_reduce_latency(cfg, device, dtype, args, report)


def main():
    args = parse_args()
    global ALL_REDUCE, MATVEC, FUSE_NORM, FUSE_LINEAR, SKINNY, DECODE_KERNEL
    ALL_REDUCE, MATVEC, FUSE_NORM = args.all_reduce, args.matvec_as_reduction, not args.no_fuse_norm
    FUSE_LINEAR = args.fuse_linear
    SKINNY, DECODE_KERNEL = not args.no_skinny, not args.no_decode_attention_kernel
    dtype = torch.float32 if args.tiny or args.device == "cpu" else torch.bfloat16
    rows = []
    with torchrun_worker(args.device) as device:
        peak_gbs = None
        if device.type == "cuda":
            use_length_independent_attention_kernels()
            peak_gbs = harness.measure_peak_bandwidth(device)
            if dist.get_rank() == 0:
                print(json.dumps({"device_copy_gbs": round(peak_gbs, 1), "gpus": dist.get_world_size(),
                                  "device_name": torch.cuda.get_device_name(device),
                                  "inductor_pdl": cgcompile.Config().compile.inductor_patches().get("triton.enable_pdl")}),
                      flush=True)
        floor = functools.partial(floor_of, peak_gbs)
        for model_name in args.models.split(","):
            cfg = CONFIGS[model_name]

            def report(variant, batch, **values):
                row = {"model": model_name, "variant": variant, "batch": batch, **values}
                rows.append(row)
                if dist.get_rank() == 0:
                    print(json.dumps(row), flush=True)

            with torch.inference_mode():
                if model_name in SHARD_ONLY:
                    for head in args.tp_heads:
                        sharded_variants(build_shard(cfg, device, dtype, head), device, args, report, floor, head)
                        harness.release_memory(device)
                else:
                    whole_model_parts(cfg, device, dtype, args, report, floor)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print_ratios(rows)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


def print_ratios(rows):
    tp = f"tp{dist.get_world_size()}"
    for model in dict.fromkeys(r["model"] for r in rows):
        for suffix in HEAD_SUFFIX.values():
            print_tensor_parallel_ratios(rows, model, tp, suffix)
        print_head_ratios(rows, model, tp)
        for batch in sorted({r["batch"] for r in rows if r["variant"] == "all-reduce" and r["model"] == model}):
            us = value(rows, model, "all-reduce", batch, "us_per_all_reduce")
            fast = value(rows, model, "all-reduce-fast", batch, "us_per_all_reduce")
            print(f"{model} batch {batch}: one all-reduce {us:.1f} us; a TP step's 64 take {us * 64 / 1e3:.2f} ms"
                  + (f"; fast all-reduce {fast:.1f} us" if fast else ""))
        print_pipeline_ratios([r for r in rows if r["model"] == model], model)


def value(rows, model, variant, batch, key):
    return next((r.get(key) for r in rows if (r["model"], r["variant"], r["batch"]) == (model, variant, batch)), None)


def print_tensor_parallel_ratios(rows, model, tp, head):
    """The TP=N variants whose names end in `head` (a HEAD_SUFFIX) against TP=1 and eager."""
    cg = f"{tp}-cgcompile{head}"
    for batch in sorted({r["batch"] for r in rows if r["variant"] == cg and r["model"] == model}):
        tpn, eager, tp1 = (value(rows, model, v, batch, "step_s") for v in (cg, f"{tp}-eager{head}", "tp1-cgcompile"))
        over = value(rows, model, cg, batch, "over_floor")
        parts = [f"{cg} {tpn * 1e3:.3f} ms"]
        if tp1:
            parts.append(f"tp1-cgcompile/{cg} {tp1 / tpn:.2f}x (target at 8b batch 1: >= 1.6 at TP=2, >= 2.5 at TP=4)")
        if eager:
            parts.append(f"{tp}-eager{head}/{cg} {eager / tpn:.2f}x (target >= 4)")
        if over:
            parts.append(f"{over:.2f}x the per-rank weight-bytes floor of "
                         f"{value(rows, model, cg, batch, 'floor_ms'):.3f} ms (target <= 1.3 at 70b TP=4)")
        print(f"{model} batch {batch}: " + "; ".join(parts))
        for suffix in ("full", "full-sq", "full-whole-sq"):
            tpn_full, tp1_full = (value(rows, model, f"{t}-cgcompile-{suffix}{h}", batch, "step_s")
                                  for t, h in ((tp, head), ("tp1", "")))
            if tpn_full and tp1_full:
                print(f"{model} batch {batch}, {suffix}{head}: tp1/{tp} {tp1_full / tpn_full:.2f}x, fastest TP=1 / "
                      f"fastest {tp} {min(tp1, tp1_full) / min(tpn, tpn_full):.2f}x"
                      + (f", {tp}-eager{head}/{tp}-cgcompile-{suffix}{head} {eager / tpn_full:.2f}x" if eager else ""))


def print_head_ratios(rows, model, tp):
    """Each TP=N variant measured with both LM heads (--tp-head both): replicated over vocab."""
    replicated = HEAD_SUFFIX["replicated"]
    for row in rows:
        name = row["variant"]
        if row["model"] != model or not name.startswith(f"{tp}-") or not name.endswith(replicated):
            continue
        twin, step_s = name.removesuffix(replicated), row["step_s"]
        vocab = value(rows, model, twin, row["batch"], "step_s")
        if vocab:
            print(f"{model} batch {row['batch']}, {twin}: replicated head {step_s * 1e3:.3f} ms / vocab-parallel "
                  f"head {vocab * 1e3:.3f} ms {step_s / vocab:.2f}x")


def print_pipeline_ratios(rows, model):
    """Each pipeline variant's tokens/s against its eager twin and one GPU at its best batch."""
    singles = [r for r in rows if r["variant"] == "single"]
    best = max(singles, key=lambda r: r["tokens_per_s"]) if singles else None
    for row in rows:
        name = row["variant"]
        if "pp" not in name or not name.endswith("-cgcompile"):
            continue
        eager = next((r["tokens_per_s"] for r in rows if r["variant"] == name.replace("-cgcompile", "-eager")), None)
        parts = [f"{name} {row['tokens_per_s']:.0f} tok/s ({row['batch']} rows in flight, micro-batch "
                 f"{row['micro_batch']})"]
        if eager:
            parts.append(f"over its eager twin {row['tokens_per_s'] / eager:.2f}x")
        if best:
            parts.append(f"over one GPU at its best batch ({best['batch']}: {best['tokens_per_s']:.0f} tok/s) "
                         f"{row['tokens_per_s'] / best['tokens_per_s']:.2f}x (target >= 1.6 for pp2)")
        print(f"{model}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
