"""TensorParallelDecoder's LM head split by vocabulary (one all-gather of the logits) and
replicated: on 2 gloo ranks, eager and compiled, each equals the single-process model, and
distributed_bench measures the two side by side."""

import json

import pytest

from cgcompile.testing.parallel_model import TensorParallelDecoder
from parallel_launch import ROOT, torchrun

SCENARIOS = ("vocab shard", "meta shard", "vocab eager", "vocab compiled", "vocab full graph", "vocab tokens",
             "replicated", "indivisible vocab")


def test_both_heads_equal_the_single_process_model_on_two_gloo_ranks():
    out = torchrun(ROOT / "tests" / "parallel" / "vocab_head_worker.py", timeout=180)
    for name in SCENARIOS:
        for rank in (0, 1):
            assert f"rank {rank}: {name}: ok" in out, out


def test_distributed_bench_runs_each_tensor_parallel_variant_with_both_heads():
    out = torchrun(ROOT / "benchmarks" / "distributed_bench.py", "--device", "cpu", "--tiny", "--parts", "tp",
                   "--tp-head", "both", "--tp-variants", "cgcompile,full", "--batches", "1")
    variants = {json.loads(line)["variant"] for line in out.splitlines() if line.startswith("{")}
    assert variants == {"tp2-cgcompile", "tp2-cgcompile-full", "tp2-cgcompile-replicated-head",
                        "tp2-cgcompile-full-replicated-head"}, out
    assert "tiny batch 1, tp2-cgcompile-full: replicated head" in out, out  # the ratio of the two


def test_an_unknown_head_names_the_choices():
    with pytest.raises(ValueError, match=r"TensorParallelDecoder: head: expected one of \('vocab', 'replicated'\), "
                                         r"got 'column'"):
        TensorParallelDecoder(None, head="column")
