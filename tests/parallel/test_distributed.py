"""Tensor and pipeline parallelism on 2 processes: over gloo on the CPU (torchrun started by
the test, with a hard timeout so a hang fails instead of blocking), and the pure parts
(stage split, ring schedule, in-place buffers, bad input without a process group)."""

import json
import subprocess
import sys

import pytest
import torch

import cgcompile
from cgcompile.run.capture import CaptureSession
from cgcompile.errors import DistributedError
from cgcompile.parallel.distributed import torchrun_worker
from cgcompile.parallel.pipeline import PipelineStage, TensorSpec, ring_schedule, stage_layers
from parallel_launch import ROOT, torchrun, two_gpus


# -- 2 processes over gloo -----------------------------------------------------------------


def test_pipeline_scenarios_on_two_gloo_ranks():
    out = torchrun(ROOT / "tests" / "parallel" / "distributed_worker.py")
    for name in ("buffers", "ring mismatch", "sender checks", "rows mismatch", "same rows", "connect first"):
        for rank in (0, 1):
            assert f"rank {rank}: {name}: ok" in out, out


@pytest.mark.parametrize("example", ["pipeline_parallel.py", "tensor_parallel.py"])
def test_example_tokens_equal_single_process_eager(example):
    # 8 tokens, as the 4-rank test: every graph that 32 make (2 for TP, 3 for PP) is compiled by then
    out = torchrun(ROOT / "examples" / example, "--device", "cpu", "--tokens", "8")
    assert "tokens match: True" in out.splitlines(), out


def test_pipeline_of_tensor_parallel_stages_on_four_gloo_ranks():
    """2 stages x TP=2: the stages talk over sub-groups (ranks 0-2 and 1-3), whose P2P peers
    are global ranks, and each stage's layers all-reduce over its own pair."""
    out = torchrun(ROOT / "examples" / "pipeline_parallel.py", "--device", "cpu", "--tp", "2", "--tokens", "8",
                   nproc=4, timeout=240)
    assert "tokens match: True" in out.splitlines(), out


def test_distributed_bench_runs_end_to_end_on_two_gloo_ranks():
    """The benchmark's smoke test (numbers on the CPU mean nothing): every variant reports."""
    out = torchrun(ROOT / "benchmarks" / "distributed_bench.py", "--device", "cpu", "--tiny")
    rows = [line for line in out.splitlines() if line.startswith("{")]
    variants = {json.loads(line)["variant"] for line in rows}
    assert variants == {"tp2-cgcompile", "tp2-eager", "tp1-cgcompile", "tp2-cgcompile-full", "tp1-cgcompile-full",
                        "pp2-cgcompile", "pp2-eager", "single", "all-reduce"}, out
    assert all(json.loads(line)["us_per_all_reduce"] > 0 for line in rows if '"all-reduce"' in line)
    assert "pp2-cgcompile" in out and "over one GPU at its best batch" in out, out
    singles = [json.loads(line) for line in rows if '"single"' in line]
    assert [row["batch"] for row in singles] == [2, 4], out  # every --pp-batches batch, best one sets the micro-batch
    pp = next(json.loads(line) for line in rows if '"pp2-cgcompile"' in line)
    best = max(singles, key=lambda row: row["tokens_per_s"])["batch"]
    assert (pp["micro_batch"], pp["batch"]) == (best, 2 * best), out
    full = [json.loads(line) for line in rows if json.loads(line)["variant"].endswith("-full")]
    assert all(row["full_graph_calls"].split("/")[0] != "0" for row in full), out  # the full path ran


# Slow (--run-slow): 4 ranks on CI's 2 cores. Its --parts tppp is distributed_bench.pipeline(tp=2):
# that function runs at tp=1 in test_distributed_bench_runs_end_to_end_on_two_gloo_ranks, and the
# tp=2 stages (stage_groups, StageDecoder over a TP group) in
# test_pipeline_of_tensor_parallel_stages_on_four_gloo_ranks; multi_gpu.sh's tppp_8b_n4 runs it on GPUs.
@pytest.mark.slow
def test_distributed_bench_tensor_parallel_stages_on_four_gloo_ranks():
    out = torchrun(ROOT / "benchmarks" / "distributed_bench.py", "--device", "cpu", "--tiny", "--parts", "tppp",
                   "--tp", "2", nproc=4, timeout=300)
    variants = {json.loads(line)["variant"] for line in out.splitlines() if line.startswith("{")}
    assert variants == {"single", "tp2pp2-cgcompile", "tp2pp2-eager"}, out


def test_hf_tp_bench_tokens_equal_eager_on_two_gloo_ranks(tmp_path):
    """The tp_plan benchmark's smoke test: transformers' own tensor parallel (DTensor) on gloo,
    compiled with cgcompile; every variant reports and the greedy tokens equal eager's. One
    Config.all_reduce (the default's second, nccl, is what auto falls back to over gloo:
    test_all_reduce.py's gloo test checks that choice)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' tp_plan needs it
    out = torchrun(ROOT / "benchmarks" / "hf_tp_bench.py", "--device", "cpu", "--shape", "tiny", "--check",
                   "--compiler", "eager", "--tokens", "6", "--repeats", "1", "--all-reduce", "auto",
                   "--module-guards", "both", "--save-dir", str(tmp_path / "model"), timeout=300)
    variants = {json.loads(line)["variant"] for line in out.splitlines() if line.startswith("{")}
    assert variants == {"tp2-cgcompile", "tp2-cgcompile-nn-guards-skipped", "tp2-eager", "tp1-cgcompile",
                        "tp1-cgcompile-nn-guards-skipped", "tp1-eager"}, out
    assert "tokens match: True" in out.splitlines(), out


# -- one process ---------------------------------------------------------------------------


def test_stage_layers_are_contiguous_and_balanced():
    assert [stage_layers(32, 2, s) for s in range(2)] == [range(0, 16), range(16, 32)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(cgcompile.ArgumentError, match="stage_layers: num_stages: expected between 1 and 2 layers"):
        stage_layers(2, 3, 0)


def test_ring_schedule_keeps_every_stage_busy_once_full():
    items = 6
    stage0, stage1 = ring_schedule(2, 0, items), ring_schedule(2, 1, items)
    assert [t.item for t in stage0] == [0, 1, 2, 3, 4, 5, None]
    assert [t.item for t in stage1] == [None, 0, 1, 2, 3, 4, 5]
    # stage 0 receives on the ticks stage 1 computes, and stage 1 on the ticks stage 0 does
    assert [t.receive for t in stage0] == [t.item is not None for t in stage1]
    assert [t.receive for t in stage1] == [t.item is not None for t in stage0]
    # stage 0's input for item i (stage 1's result for item i - 2) arrives on the tick before
    for k, tick in enumerate(stage0):
        if tick.item is not None and tick.item >= 2:
            assert stage1[k - 1].item == tick.item - 2


def test_a_registered_buffer_and_its_leading_slices_are_read_in_place():
    session = CaptureSession((1, 2, 4))
    buffer = torch.zeros(4, 3)
    session.live.add_persistent(buffer)
    assert session.live.holds(buffer[:2], (2, 3))
    assert session.live.holds(buffer[:1], (4, 3))  # a call of 1 row padded to 4
    assert not session.live.holds(buffer[1:], (2, 3))  # not where the buffer starts
    assert not session.live.holds(buffer[:2], (8, 3))  # more rows than the buffer has
    assert not session.live.holds(torch.zeros(4, 3), (4, 3))


def run_under_deadline(body: str) -> subprocess.CompletedProcess:
    code = ("import time\nfrom cgcompile.parallel.distributed import teardown_deadline\n"
            f"with teardown_deadline(0.5, 'rank 1'):\n    {body}\ntime.sleep(1.5)\nprint('exited normally')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_teardown_that_hangs_ends_the_process_with_a_message():
    result = run_under_deadline("time.sleep(30)")  # stands for a destroy_process_group that never returns
    assert result.returncode == 3, result.stderr[-2000:]
    assert "cgcompile: rank 1: tearing the process group down has not finished after 0.5 s" in result.stderr
    assert "pytorch#115388" in result.stderr
    assert "Thread" in result.stderr  # every thread's stack, to see where it hung
    assert "exited normally" not in result.stdout


def test_a_teardown_that_finishes_cancels_the_deadline():
    result = run_under_deadline("pass")
    assert result.returncode == 0 and "exited normally" in result.stdout, result.stderr[-2000:]
    assert "tearing the process group down" not in result.stderr


def test_without_a_process_group_the_error_says_to_initialise_one():
    with pytest.raises(DistributedError, match=r"PipelineStage: expected an initialised torch.distributed process "
                                               r"group, got none; call torch.distributed.init_process_group"):
        PipelineStage(receives={}, sends={"x": TensorSpec((2,), torch.float32)}, max_rows=4, device="cpu")


def test_torchrun_worker_without_torchrun_says_how_to_run(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedError, match=r"^torchrun_worker: expected the environment torchrun sets for each "
                                               r"rank, got no RANK, .*; run it under torchrun, e.g. torchrun "
                                               r"--nproc-per-node 2 "):
        with torchrun_worker("cpu"):
            pass
    assert not torch.distributed.is_initialized()


# -- 2 GPUs, NCCL, CUDA graphs ---------------------------------------------------------------

@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("example", ["pipeline_parallel.py", "tensor_parallel.py"])
def test_cuda_example_tokens_equal_eager_with_graphs(example):
    out = torchrun(ROOT / "examples" / example, "--device", "cuda", "--model", "small", timeout=400)
    assert "tokens match: True" in out.splitlines(), out
    stats = next(line for line in out.splitlines() if line.startswith(("rank 0:", "stage 0:")))
    assert "graphs_captured=0" not in stats, stats


@pytest.mark.cuda
@two_gpus
def test_cuda_collectives_are_captured_and_buffers_read_in_place():
    out = torchrun(ROOT / "tests" / "parallel" / "distributed_cuda_worker.py", timeout=400)
    assert "rank 0: all-reduces captured: ok" in out and "rank 1: buffers read in place: ok" in out, out
