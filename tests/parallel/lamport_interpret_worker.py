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
sums with the residual bit for bit, the norms to rounding, against the unfused torch ops.
With `linear`, the product that publishes its row itself and the gather after it
(`LamportNormBuffer.linear_add_rms_norm`), plain and gated, with and without a bias, in
turn with the fused kernel on the same buffer, and in some calls one rank on the fused
kernel while the others publish from the product: every rank's results must equal the skinny
kernel's product of each rank, run through the fused kernel's sum, bit for bit."""

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


# Each call of the `linear` mode: (features N, input K, gated, bias, who publishes from the
# product); the last call's product is -0.0.
LINEAR_CALLS = [(64, 48, False, False, "all"), (128, 256, True, False, "all"), (64, 32, False, True, "none"),
                (96, 64, True, True, "all"), (64, 48, False, False, "rank 0"), (128, 256, True, False, "all but rank 0"),
                (64, 32, False, False, "all")]


def linear_messages(world: int, dtype: torch.dtype) -> list[list[dict]]:
    """Per rank, each call's operands: the rank's own row and weight shard, the residual and
    the norm's weight the same on every rank; small integers scaled so sums are exact."""
    generator = torch.Generator().manual_seed(2)

    def small(*shape):
        return (torch.randint(-4, 5, shape, generator=generator) / 4).to(dtype)

    calls = []
    for rank in range(world):
        mine = []
        for n, k, gated, bias, who in LINEAR_CALLS:
            mine.append(dict(x=small(1, k), up=small(1, k) if gated else None, matrix=small(n, k),
                             bias=small(n) if bias else None, publish=who == "all" or who == f"rank {rank}"
                             or (who == "all but rank 0" and rank != 0)))
        # the last product -0.0 everywhere (its float32 sums, -2^-135, round to -0.0 in bf16):
        # published as such it would look unwritten
        mine[-1].update(x=torch.full_like(mine[-1]["x"], -2.0 ** -70), matrix=torch.full_like(mine[-1]["matrix"], 2.0 ** -70))
        calls.append(mine)
    shared = [(small(1, n), torch.rand(n, generator=generator).to(dtype)) for n, *_ in LINEAR_CALLS]
    for mine in calls:
        for call, (residual, weight) in zip(mine, shared):
            call.update(residual=residual, weight=weight, eps=1e-6)
    return calls


def product(call: dict) -> torch.Tensor:
    """The skinny kernel's own product of one call (the reference the published row must equal)."""
    from cgcompile.kernels.silu_mul_linear import silu_mul_kernel_call
    from cgcompile.kernels.skinny_linear import skinny_linear_kernel_call

    if call["up"] is None:
        return skinny_linear_kernel_call(call["x"], call["matrix"], call["bias"])
    return silu_mul_kernel_call(call["x"], call["up"], call["matrix"], call["bias"])


def run_linear_rank(rank, layout, dtype, buffers, peers, calls, outputs, publishing):
    lamport = LamportNormBuffer(layout, rank, dtype, buffers[rank], peers, handle=None)
    pause = random.Random(rank)
    for call, (total, normed) in zip(calls[rank], outputs[rank]):
        time.sleep(pause.random() * 0.05)
        rest = (call["residual"], call["weight"], call["eps"])
        if publishing and call["publish"]:
            got = lamport.linear_add_rms_norm(call["x"], call["up"], call["matrix"], call["bias"], *rest)
        else:
            got = lamport.add_rms_norm(product(call), *rest)
        total.copy_(got[0])
        normed.copy_(got[1])


def main_linear(world: int, dtype: torch.dtype) -> None:
    """The calls twice on fresh buffers: as `LINEAR_CALLS` says, then every rank on the fused
    kernel with the skinny kernel's product (the reference, the same kernel arithmetic: so
    the two agree bit for bit, rounding ties included)."""
    bits_dtype, sentinel = SENTINEL_BITS[dtype]
    layout = LamportNormBuffer.layout_for(world, torch.empty((), dtype=dtype).element_size())
    calls = linear_messages(world, dtype)
    runs = []
    for publishing in (True, False):
        buffers = [torch.full((layout.numel,), sentinel, dtype=bits_dtype).share_memory_() for _ in range(world)]
        peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        outputs = [[(torch.empty_like(c["residual"]).share_memory_(), torch.empty_like(c["residual"]).share_memory_())
                    for c in mine] for mine in calls]
        run_forked_ranks(world, run_linear_rank, layout, dtype, buffers, peers, calls, outputs, publishing)
        assert all(bool((b == sentinel).all()) for b in buffers), "expected every slot back to the sentinel"
        runs.append(outputs)
    published, fused = runs
    for i in range(len(LINEAR_CALLS)):
        total = sum(without_negative_zero(product(calls[r][i])).float() for r in range(world)).to(dtype)
        want_total, want_normed = add_rms_norm(total, calls[0][i]["residual"], calls[0][i]["weight"], 1e-6)
        for rank in range(world):
            for got, want, what in zip(published[rank][i], fused[rank][i], ("sums", "norms")):
                assert torch.equal(got.view(bits_dtype), want.view(bits_dtype)), f"call {i}, rank {rank}: {what}"
            # and both near the torch ops' (an interpreted bf16 cast may round a tie otherwise, and
            # the residual add cancels: an absolute bound of a few bf16 steps at these magnitudes)
            near = {"atol": 0.1, "rtol": 0.02} if dtype == torch.bfloat16 else {}
            torch.testing.assert_close(published[rank][i][0], want_total, msg=f"call {i}, rank {rank}: sums", **near)
            torch.testing.assert_close(published[rank][i][1], want_normed, msg=f"call {i}, rank {rank}: norms", **near)
    print(f"publishing product and gather on {world} interpreted ranks, {dtype}: ok", flush=True)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    mains = {"norm": main_norm, "linear": main_linear}
    mains.get(sys.argv[3] if sys.argv[3:] else "", main)(int(sys.argv[1]), DTYPES[sys.argv[2]])
