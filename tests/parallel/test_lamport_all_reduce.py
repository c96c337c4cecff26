"""The Lamport all-reduce: the slot layout and the sentinel rule (pure), the real Triton
kernel on 2 and 4 ranks under Triton's CPU interpreter (where Triton is installed), and on
2 GPUs inside captured graphs replayed in alternating orders against NCCL."""

import importlib.util
import sys

import pytest
import torch

from cgcompile.parallel.all_reduce_choice import LAMPORT_MAX_BYTES
from cgcompile.parallel.lamport_all_reduce import (
    MAX_WORLD, PHASES, SENTINEL_BITS, LamportLayout, lamport_problem, without_negative_zero,
)
from parallel_launch import ROOT, interpreted_ranks, torchrun, two_gpus


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slots_tile_the_buffer_without_overlap(dtype):
    layout = LamportLayout(world_size=4, element_size=torch.empty((), dtype=dtype).element_size())
    starts = sorted(layout.slot_offset(p, r) for p in range(PHASES) for r in range(4))
    assert starts == list(range(0, layout.numel, layout.slot_numel))
    assert layout.slot_numel * layout.element_size == LAMPORT_MAX_BYTES
    assert layout.programs(1) == 1 and layout.programs(layout.block + 1) == 2
    assert layout.programs(layout.slot_numel) == layout.max_programs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_negative_zero_is_published_as_positive_zero_and_nothing_else_changes(dtype):
    bits_dtype, sentinel = SENTINEL_BITS[dtype]
    x = torch.tensor([-0.0, 0.0, 1.5, -2.0, float("nan"), float("-inf"), -1e-30], dtype=dtype)
    assert x.view(bits_dtype)[0] == sentinel  # -0.0 is the sentinel
    published = without_negative_zero(x)
    assert not bool((published.view(bits_dtype) == sentinel).any())
    assert published.view(bits_dtype)[0] == 0
    assert torch.equal(published[1:].view(bits_dtype), x[1:].view(bits_dtype))


def test_lamport_problems_are_reasons():
    assert f"at most {MAX_WORLD}" in lamport_problem(MAX_WORLD + 1)


def test_without_triton_the_problem_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    assert "triton cannot be imported" in lamport_problem(2)


has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")


@has_triton
@pytest.mark.parametrize("world, dtype", [(2, "bf16"), (4, "fp32")])
def test_the_kernel_on_interpreted_ranks_sums_exactly_and_resets_its_slots(world, dtype):
    assert f"lamport kernel on {world} interpreted ranks" in interpreted_ranks(world, dtype)


@pytest.mark.cuda
@two_gpus
def test_cuda_lamport_all_reduce_equals_nccl_eager_and_in_graphs_replayed_in_any_order():
    out = torchrun(ROOT / "tests" / "parallel" / "lamport_cuda_worker.py", timeout=300)
    for rank in (0, 1):
        for check in ("lamport chosen", "eager calls equal nccl", "negative zeros equal nccl",
                      "one graph of 64 replayed equals nccl", "two graphs alternating equal nccl",
                      "compiled pieces equal nccl"):
            assert f"rank {rank}: {check}: ok" in out, out
