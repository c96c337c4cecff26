"""The Lamport all-reduce's Triton kernel run by Triton's CPU interpreter on forked ranks
(run by tests/parallel/test_lamport_all_reduce.py with TRITON_INTERPRET=1):

    TRITON_INTERPRET=1 python tests/parallel/lamport_interpret_worker.py WORLD DTYPE [norm]

Every rank's buffer is shared memory mapped before the fork, so each child sees every
buffer at the same address, as P2P pointers are seen on GPUs; each child runs the real
kernel for its rank, at its own pace (seeded random pauses between calls), over sizes that
launch one to all programs, with -0.0 in the inputs. Each rank's results must equal the
sum in rank order of the inputs with -0.0 made +0.0, bit for bit, and every slot must hold
the sentinel again at the end. With `norm`, the fused kernel (all-reduce + residual add + RMS
norm, `LamportNormBuffer`) over row counts and hidden sizes that differ from call to call: the
sums with the residual bit for bit, the norms to rounding, against the unfused torch ops."""

import multiprocessing
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from cgcompile.parallel.all_reduce_norm import add_rms_norm  # noqa: E402
from cgcompile.parallel.lamport_all_reduce import (  # noqa: E402
    NORM_ROW, NORM_ROWS, SENTINEL_BITS, LamportBuffer, LamportLayout, LamportNormBuffer, without_negative_zero,
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


def run_forked_ranks(world: int, target, *args) -> None:
    """target(rank, *args) in one forked process per rank (the buffers mapped before the fork
    sit at the same address in each), all of which must finish."""
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
    assert all(p.exitcode == 0 for p in ranks), f"expected every rank to finish, got exit codes {[p.exitcode for p in ranks]}"


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
    run_forked_ranks(world, run_rank, layout, dtype, buffers, peers, inputs, outputs)
    for call in range(len(inputs[0])):
        want = sum(without_negative_zero(inputs[r][call]).float() for r in range(world)).to(dtype)
        for rank in range(world):
            got = outputs[rank][call]
            assert torch.equal(got.view(bits_dtype), want.view(bits_dtype)), f"call {call}, rank {rank}: {got} != {want}"
    assert all(bool((b == sentinel).all()) for b in buffers), "expected every slot back to the sentinel"
    print(f"lamport kernel on {world} interpreted ranks, {dtype}: ok", flush=True)


def norm_messages(world: int, dtype: torch.dtype) -> list[list[tuple]]:
    """Per rank, each call's (x, residual, weight, eps): residual and weight the same on every
    rank (as a replicated residual stream and norm weight are), x of -0.0 in the last call."""
    shapes = [(1, 64), (NORM_ROWS, 128), (3, NORM_ROW), (2, 24), (1, 64), (NORM_ROWS, 8)]
    generator = torch.Generator().manual_seed(1)
    shared = [(torch.randint(-8, 8, shape, generator=generator).to(dtype), torch.rand(shape[-1], generator=generator).to(dtype))
              for shape in shapes]
    calls = [[(torch.randint(-8, 8, shape, generator=generator).to(dtype), residual, weight, 1e-6)
              for shape, (residual, weight) in zip(shapes, shared)] for _ in range(world)]
    for rank in range(world):
        calls[rank][-1] = (torch.full(shapes[-1], -0.0, dtype=dtype), *calls[rank][-1][1:])
    return calls


def run_norm_rank(rank, layout, dtype, buffers, peers, calls, outputs):
    lamport = LamportNormBuffer(layout, rank, dtype, buffers[rank], peers, handle=None)
    pause = random.Random(rank)
    for args, (total, normed) in zip(calls[rank], outputs[rank]):
        time.sleep(pause.random() * 0.05)
        got = lamport.add_rms_norm(*args)
        total.copy_(got[0])
        normed.copy_(got[1])


def main_norm(world: int, dtype: torch.dtype) -> None:
    bits_dtype, sentinel = SENTINEL_BITS[dtype]
    layout = LamportNormBuffer.layout_for(world, torch.empty((), dtype=dtype).element_size())
    buffers = [torch.full((layout.numel,), sentinel, dtype=bits_dtype).share_memory_() for _ in range(world)]
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    calls = norm_messages(world, dtype)
    outputs = [[(torch.empty_like(x).share_memory_(), torch.empty_like(x).share_memory_()) for x, *_ in mine]
               for mine in calls]
    run_forked_ranks(world, run_norm_rank, layout, dtype, buffers, peers, calls, outputs)
    for call in range(len(calls[0])):
        total = sum(without_negative_zero(calls[r][call][0]).float() for r in range(world)).to(dtype)
        want_total, want_normed = add_rms_norm(total, *calls[0][call][1:])
        for rank in range(world):
            got_total, got_normed = outputs[rank][call]
            assert torch.equal(got_total.view(bits_dtype), want_total.view(bits_dtype)), f"call {call}, rank {rank}: sums"
            torch.testing.assert_close(got_normed, want_normed, msg=f"call {call}, rank {rank}: norms")
    assert all(bool((b == sentinel).all()) for b in buffers), "expected every slot back to the sentinel"
    print(f"fused lamport kernel on {world} interpreted ranks, {dtype}: ok", flush=True)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    (main_norm if sys.argv[3:] == ["norm"] else main)(int(sys.argv[1]), DTYPES[sys.argv[2]])
