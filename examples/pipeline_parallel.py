"""Greedy decoding on two pipeline stages, each compiled with cgcompile, two micro-batches
in flight; the tokens are compared with a single-process eager run.

    .venv/bin/torchrun --nproc-per-node 2 examples/pipeline_parallel.py --device cpu    # gloo
    .venv/bin/torchrun --nproc-per-node 2 examples/pipeline_parallel.py --device cuda   # NCCL, CUDA graphs
    .venv/bin/torchrun --nproc-per-node 4 examples/pipeline_parallel.py --tp 2          # 2 stages x TP=2

Stage 0 embeds and runs the first half of the layers, stage 1 the rest and picks the next
tokens, which go back to stage 0 (a ring). While stage 1 works on one micro-batch, stage 0
works on the other (`cgcompile.parallel.pipeline.ring_schedule`). What crosses each boundary is a
named set of tensors received into persistent buffers that the graphs read in place.

With --tp N, each stage's layers are sharded over N ranks (tensor parallel inside the stage):
a device mesh of (stages, N) gives every rank a pipeline group (the same tensor-parallel part
of every stage) and a tensor-parallel group (the ranks of its stage).
"""
# cgcompile-example: needs-torchrun

import argparse

import torch
import torch.distributed as dist

import cgcompile
from cgcompile.parallel.distributed import prepare_collectives, torchrun_worker
from cgcompile.parallel.pipeline import PipelineStage, TensorSpec, ring_schedule, stage_layers
from cgcompile.testing.decode_model import MODEL_CONFIGS
from cgcompile.testing.parallel_model import StageDecoder, greedy_reference, seeded_llama, stage_groups

FILL = 8  # cache positions filled before decoding (the "prompt")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--batch", type=int, default=4, help="sequences, split into one micro-batch per stage")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1, help="ranks per stage (tensor parallel inside each stage)")
    return parser.parse_args()


def run_stage(args, device):
    """This rank's stage over the ring schedule; returns the tokens stage 0 received: [steps, B]."""
    pp_group, tp_group = stage_groups(args.tp, device)
    rank, world = dist.get_rank(pp_group), dist.get_world_size(pp_group)  # this stage, and how many
    cfg = MODEL_CONFIGS[args.model]
    mb = args.batch // world  # rows per micro-batch; one micro-batch per stage
    model = StageDecoder(seeded_llama(args.model, device, FILL), stage_layers(cfg.layers, world, rank), tp_group)
    if tp_group is not None:
        prepare_collectives(device, tp_group)  # its communicator before any capture
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= mb) + ((mb,) if mb not in (1, 2, 4, 8, 16, 32, 64) else ())
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=["cgbench::decode_attention"], capture_sizes=sizes,
                                                 compiler="eager" if device.type == "cpu" else "inductor",
                                                 capture_error_mode="thread_local",  # NCCL watchdog threads
                                                 reuse_output_buffers=True))
    compiled = torch.compile(model, backend=backend)
    hidden = {"hidden": TensorSpec((cfg.hidden,), torch.float32)}
    tokens = {"tokens": TensorSpec((), torch.int64)}
    stage = PipelineStage(receives=tokens if rank == 0 else hidden, sends=tokens if rank == world - 1 else hidden,
                          max_rows=max(sizes), device=device, group=pp_group, backend=backend)
    stage.connect()
    first_ids = torch.randint(0, cfg.vocab, (args.batch,), generator=torch.Generator().manual_seed(1)).to(device)
    received, got = None, []
    for tick in ring_schedule(world, rank, args.tokens * world):
        outputs = None
        if tick.item is not None:
            micro, step = tick.item % world, tick.item // world
            x = first_ids[micro * mb:(micro + 1) * mb] if rank == 0 and step == 0 else received[stage_input(rank)]
            outputs = {stage_output(rank, world): compiled(x, FILL + step, micro * mb)}
        received = stage.exchange(outputs, mb if tick.receive else None)
        if rank == 0 and received is not None:
            got.append(received["tokens"].clone())
    return torch.stack(got).view(args.tokens, args.batch) if rank == 0 else None, backend


def stage_input(rank):
    return "tokens" if rank == 0 else "hidden"


def stage_output(rank, world):
    return "tokens" if rank == world - 1 else "hidden"


def main():
    args = parse_args()
    with torchrun_worker(args.device) as device, torch.inference_mode():
        tokens, backend = run_stage(args, device)
        if dist.get_rank() == 0:
            first_ids = torch.randint(0, MODEL_CONFIGS[args.model].vocab, (args.batch,),
                                      generator=torch.Generator().manual_seed(1)).to(device)
            reference = greedy_reference(seeded_llama(args.model, device, FILL), first_ids, FILL, args.tokens)
            print(f"stage 0: {backend.stats}")
            print(f"tokens match: {torch.equal(tokens.cpu(), reference.cpu())}")


if __name__ == "__main__":
    main()
