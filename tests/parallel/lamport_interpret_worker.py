"""The Lamport all-reduce's Triton kernel run by Triton's CPU interpreter on forked ranks
(run by tests/parallel/test_lamport_all_reduce.py with TRITON_INTERPRET=1):

    TRITON_INTERPRET=1 python tests/parallel/lamport_interpret_worker.py WORLD DTYPE

Every rank's buffer is shared memory mapped before the fork, so each child sees every
buffer at the same address, as P2P pointers are seen on GPUs; each child runs the real
kernel for its rank, at its own pace (seeded random pauses between calls), over sizes that
launch one to all programs, with -0.0 in the inputs. Each rank's results must equal the
sum in rank order of the inputs with -0.0 made +0.0, bit for bit, and every slot must hold
the sentinel again at the end."""

import multiprocessing
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from cgcompile.parallel.lamport_all_reduce import (  # noqa: E402
    SENTINEL_BITS, LamportBuffer, LamportLayout, without_negative_zero,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def messages(layout: LamportLayout, world: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Per rank, the inputs of each call: small integers, and -0.0 in the first and last call."""
    vec = 16 // layout.element_size
    sizes = [vec, layout.block, 3 * layout.block + vec, vec, 2 * vec, layout.slot_numel, layout.block, vec]
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randint(-8, 8, (n,), generator=generator).to(dtype) for n in sizes] for _ in range(world)]
    for rank in range(world):
        inputs[rank][0][: vec // 2] = -0.0
        inputs[rank][-1][:] = -0.0  # a message of -0.0 only: it must not look unwritten
    return inputs


def run_rank(rank, layout, dtype, buffers, peers, inputs, outputs):
    lamport = LamportBuffer(layout, rank, dtype, buffers[rank], peers, handle=None)
    pause = random.Random(rank)
    for x, out in zip(inputs[rank], outputs[rank]):
        time.sleep(pause.random() * 0.05)  # the ranks drift apart: a fast rank runs ahead
        out.copy_(lamport.all_reduce(x))


def main(world: int, dtype: torch.dtype) -> None:
    bits_dtype, sentinel = SENTINEL_BITS[dtype]
    layout = LamportLayout(world, torch.empty((), dtype=dtype).element_size())
    buffers = [torch.full((layout.numel,), sentinel, dtype=bits_dtype).share_memory_() for _ in range(world)]
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    inputs = messages(layout, world, dtype)
    outputs = [[torch.empty_like(x).share_memory_() for x in mine] for mine in inputs]
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=run_rank, args=(r, layout, dtype, buffers, peers, inputs, outputs))
             for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    assert all(p.exitcode == 0 for p in ranks), f"expected every rank to finish, got exit codes {[p.exitcode for p in ranks]}"
    for call in range(len(inputs[0])):
        want = sum(without_negative_zero(inputs[r][call]).float() for r in range(world)).to(dtype)
        for rank in range(world):
            got = outputs[rank][call]
            assert torch.equal(got.view(bits_dtype), want.view(bits_dtype)), f"call {call}, rank {rank}: {got} != {want}"
    assert all(bool((b == sentinel).all()) for b in buffers), "expected every slot back to the sentinel"
    print(f"lamport kernel on {world} interpreted ranks, {dtype}: ok", flush=True)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    main(int(sys.argv[1]), DTYPES[sys.argv[2]])
