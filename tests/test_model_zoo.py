"""benchmarks/model_zoo.py: a CPU subset of the zoo, its failure reporting, --list; the whole zoo on a GPU.

The CPU subset runs the size sequence (batch 1, a non-capture batch, a capture batch,
batch 1 again, each call another prompt) on one compiled model of a few cheap
architectures (dense, sliding-window, mixed-layer, MoE, state-space, text encoder, vision,
seq2seq), with compiler="eager" (pieces run as FX code: the split is the same as with
Inductor, and Inductor's C++ compiles would take minutes on CI's two cores), both as
the zoo compiles and with Config(padding=True), so that the padded path runs on CPU.
"""

import dataclasses
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

ZOO_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "model_zoo.py"


def load_zoo():
    spec = importlib.util.spec_from_file_location("model_zoo", ZOO_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there (Python 3.12)
    spec.loader.exec_module(module)
    return module


zoo = load_zoo()
CPU = zoo.Options(device="cpu", compiler="eager", new_tokens=8, lm_sequence=(1, 3, 4, 1), encoder_sequence=(1, 3, 8, 1))
# (name, Config.padding): None as the zoo compiles (no padding without CUDA graphs), True
# pads the non-capture batch 3 to 4 on CPU. Sliding windows (mistral, gemma3's mix of
# sliding and full layers), MoE, a state-space decoder, a text encoder, vision, seq2seq.
SUBSET = [("llama", None), ("gemma3", None), ("mamba", None), ("bert", None), ("vit", None), ("t5", None),
          ("mistral", True), ("mixtral", True), ("mamba", True), ("vit", True)]
# Slow (--run-slow): mamba as the zoo compiles. Its compile and scan pieces are mamba-padded's,
# the unpadded path runs on five other families here, and gpu_verify.sh's zoo_ssm_a and
# zoo_eager_moe_ssm jobs run mamba as the zoo compiles on the GPU.
# Slow too: mistral padded. Its windowed cache and mask, padded, on one compiled model at
# batches 1, 3, 1, 4, 1, are test_hf_generate.py's
# test_one_compiled_model_at_changing_batches_equals_eager[mistral] (a window of 5 under 8 new
# tokens); the zoo's padded rows run on mixtral, mamba and vit here, and gpu_verify.sh's zoo_a
# runs mistral on the GPU.
SLOW_ROWS = {("mamba", None), ("mistral", True)}
CASES = [pytest.param(name, padding, id=f"{name}-{'padded' if padding else 'default'}",
                      marks=[pytest.mark.slow] if (name, padding) in SLOW_ROWS else [])
         for name, padding in SUBSET]


@pytest.mark.parametrize("name, padding", CASES)
def test_cpu_subset_matches_eager_through_the_sequence(name, padding):
    options = dataclasses.replace(CPU, padding=padding)
    rows = zoo.run_zoo([name], options)
    sequence = zoo.sequence(zoo.BY_NAME[name], options)
    assert [(row.call, row.size) for row in rows] == list(enumerate(sequence))
    for row in rows:
        assert (row.status, row.error) == ("ok", None), f"call {row.call}: {row.note}"
        assert row.max_err <= 1e-4
        if row.tokens_total is not None:
            assert row.tokens_equal == row.tokens_total == row.size * CPU.new_tokens
        # Attention (and what else cannot be captured) split the graph: some pieces run
        # eagerly, the others are capturable.
        assert 0 < row.capturable < row.pieces
        assert row.graphs_captured == 0  # no CUDA graphs on CPU
    # One compiled model: the stats grow call by call, and batch 1 again reuses its graphs.
    assert [row.graphs for row in rows] == sorted(row.graphs for row in rows)
    assert rows[-1].graphs == rows[-2].graphs
    # Without CUDA graphs cgcompile pads only when told; told, graphs dynamic in the batch pad.
    assert (rows[-1].padded_graphs > 0) == bool(padding)


def test_an_encoder_with_a_padding_mask_pads():
    # cgcompile's own mask rewrite (passes/attention_mask.py) keeps rows apart: it pads.
    rows = zoo.run_zoo(["bert"], dataclasses.replace(CPU, padding=True))
    assert [row.status for row in rows] == ["ok"] * 4, [row.note for row in rows]
    assert rows[-1].padded_graphs > 0


def test_calls_at_one_size_get_different_inputs():
    arch, config = zoo.BY_NAME["llama"], zoo.transformers.LlamaConfig(**zoo.BY_NAME["llama"].kwargs)
    first, again = (zoo.make_inputs(arch, config, zoo.Row("llama", "decoder", 1, call), CPU) for call in (0, 3))
    assert not torch.equal(first["input_ids"], again["input_ids"])
    batch = zoo.make_inputs(arch, config, zoo.Row("llama", "decoder", 4, 2), CPU)
    assert batch["attention_mask"][:, 0].tolist() == [1, 0, 0, 0]  # left padding: row i has i pads


def test_fresh_per_size_compiles_each_call_anew():
    options = dataclasses.replace(CPU, lm_sequence=(1, 3), fresh_per_size=True)
    rows = zoo.run_zoo(["qwen2"], options)
    assert [row.status for row in rows] == ["ok", "ok"], [row.note for row in rows]
    # Prefill and decode, at each size from nothing (one compiled model would count 2, then 4).
    assert [row.graphs for row in rows] == [2, 2]


def test_a_failing_model_is_a_row_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    build = zoo.build

    def build_or_fail(arch, options):
        if arch.name == "bert":
            raise RuntimeError("no bert today\nsecond line")
        return build(arch, options)

    monkeypatch.setattr(zoo, "build", build_or_fail)
    out = tmp_path / "zoo.json"
    assert zoo.main(["--device", "cpu", "--models", "bert,distilbert", "--sequence", "1,3", "--json", str(out)]) == 1
    rows = {(row["model"], row["call"]): row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == [(name, call) for name in ("bert", "distilbert") for call in (0, 1)]
    assert rows["bert", 0]["status"] == "FAIL"
    assert rows["bert", 0]["error"] == "build: RuntimeError: no bert today"
    assert all(rows["distilbert", call]["status"] == "ok" for call in (0, 1))
    assert "FAIL bert call 0 size 1: build: RuntimeError: no bert today" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fields, note",
    [
        (dict(max_err=2e-4), "max err 2.00e-04 > 0.0001"),
        (dict(max_err=float("nan")), "max err nan > 0.0001"),
        (dict(max_err=0.0, tokens_equal=31, tokens_total=32), "tokens 31/32 equal eager's"),
        (dict(error="CaptureError: capturing graph0.piece_2 failed"), "CaptureError: capturing graph0.piece_2 failed"),
    ],
)
def test_judge_fails_a_row(fields, note):
    row = zoo.Row("llama", "decoder", 1, **fields)
    zoo.judge(row, zoo.Options())
    assert (row.status, row.note) == ("FAIL", note)


def test_judge_lets_bfloat16_tokens_part_ways():
    row = zoo.Row("llama", "decoder", 1, max_err=1e-2, tokens_equal=20, tokens_total=32)
    zoo.judge(row, zoo.Options(dtype=torch.bfloat16))
    assert row.status == "ok"


def test_list_names_every_architecture():
    result = subprocess.run([sys.executable, str(ZOO_PATH), "--list"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert names == [arch.name for arch in zoo.ARCHS]
    kinds = {arch.kind for arch in zoo.ARCHS}
    assert len(names) >= 60 and kinds == set(zoo.KINDS)


def test_unknown_model_name_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        zoo.parse_args(["--models", "llama,gpt5"])
    assert exit_info.value.code == 2


def test_speed_columns_at_batch_1():
    options = zoo.Options(device="cpu", compiler="eager", new_tokens=8, lm_sequence=(1,), encoder_sequence=(1,),
                          speed=True, rounds=2)
    rows = zoo.run_zoo(["gpt2", "distilbert"], options)
    for row in rows:
        assert row.status == "ok", row.note  # and no Dynamo graph compiled while timing
        assert math.isfinite(row.eager_ms) and math.isfinite(row.cgcompile_ms)
    # A decode step's time is a difference of two generate() times, which noise on a busy
    # CI host can make negative; a forward's time cannot be.
    assert rows[1].eager_ms > 0 and rows[1].cgcompile_ms > 0
    assert "x" in zoo.HEADER.split() and len(zoo.format_row(rows[0])) <= zoo.TABLE_WIDTH


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [arch.name for arch in zoo.ARCHS])
def test_zoo_on_cuda_in_float32(name):
    rows = zoo.run_zoo([name], zoo.Options(device="cuda", compiler="inductor"))
    failed = [f"call {row.call}, size {row.size}: {row.note}" for row in rows if row.status == "FAIL"]
    assert not failed, "\n".join(failed)
    assert all(row.graphs_captured > 0 for row in rows if row.status == "ok")
