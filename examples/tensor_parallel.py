"""Greedy decoding with the layers sharded over two ranks (tensor parallel), compiled with
cgcompile; the tokens are compared with a single-process eager run.

    .venv/bin/torchrun --nproc-per-node 2 examples/tensor_parallel.py --device cpu    # gloo, no graphs
    .venv/bin/torchrun --nproc-per-node 2 examples/tensor_parallel.py --device cuda   # NCCL, CUDA graphs

Each layer is Megatron style: q/k/v and gate/up split by head and unit across ranks,
o_proj and down by input, one functional all-reduce after each of those two; the LM head
is split by vocabulary, its logits joined by one functional all-gather. Nothing else is
needed: the collectives are ordinary ops of the capturable pieces (captured in the CUDA
graphs on NCCL); `prepare_collectives` makes the communicator before capture.
"""
# cgcompile-example: needs-torchrun

import argparse

import torch
import torch.distributed as dist

import cgcompile
from cgcompile.parallel.distributed import check_same_rows, prepare_collectives, torchrun_worker
from cgcompile.testing.decode_model import MODEL_CONFIGS
from cgcompile.testing.parallel_model import TensorParallelDecoder, greedy_reference, seeded_llama

FILL = 8


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    return parser.parse_args()


def decode(args, device):
    """Greedy tokens [steps, B] from the sharded, compiled model, and its backend."""
    model = TensorParallelDecoder(seeded_llama(args.model, device, FILL))
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=["cgbench::decode_attention"],
                                                 capture_sizes=(1, 2, 4, 8),
                                                 compiler="eager" if device.type == "cpu" else "inductor",
                                                 capture_error_mode="thread_local"))  # NCCL watchdog threads
    compiled = torch.compile(model, backend=backend)
    prepare_collectives(device)
    check_same_rows("tensor_parallel", args.batch)
    ids = first_ids(args, device)
    out = []
    for step in range(args.tokens):
        ids = compiled(ids, FILL + step).argmax(-1)
        out.append(ids)
    return torch.stack(out), backend


def first_ids(args, device):
    return torch.randint(0, MODEL_CONFIGS[args.model].vocab, (args.batch,),
                         generator=torch.Generator().manual_seed(1)).to(device)


def main():
    args = parse_args()
    with torchrun_worker(args.device) as device, torch.inference_mode():
        tokens, backend = decode(args, device)
        if dist.get_rank() == 0:
            reference = greedy_reference(seeded_llama(args.model, device, FILL), first_ids(args, device), FILL, args.tokens)
            eager = sum(not p.capturable for p in backend.pieces)
            collectives_eager = sum(not p.capturable and "all_reduce" in p.graph.code for p in backend.pieces)
            print(f"rank 0: {backend.stats}; eager pieces {eager}, eager pieces with an all-reduce {collectives_eager}")
            print(f"tokens match: {torch.equal(tokens.cpu(), reference.cpu())}")


if __name__ == "__main__":
    main()
