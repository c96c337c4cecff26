"""benchmarks/hf_probe.py runs on CPU: the plain loop's host parts and generate()'s split."""

import importlib
import json
import pathlib

import pytest

PROBE = pathlib.Path(__file__).parent.parent / "benchmarks" / "hf_probe.py"


def test_hf_probe_smoke_on_cpu(tmp_path, bench_main):
    pytest.importorskip("transformers")
    out = tmp_path / "hf_probe.json"
    argv = ["--device", "cpu", "--model", "tiny", "--batches", "1", "--steps", "3", "--new-tokens", "4", "--dtype", "fp32",
            "--json", str(out)]
    assert bench_main("hf_probe", argv) == 0
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    assert case["variant"] == "hf-plain-loop" and case["step_plain_us"] > 0
    assert "runtime call" in case["parts_us"] and "outside the runtime / runner" in case["parts_us"]
    (generate,) = report["generate"]
    assert 0 < generate["forward_calls_ms_per_token"] < generate["wall_ms_per_token"]


# The families beside Llama (benchmarks/hf_families.py; Llama is the test above). Each runs
# in this process, where torch and transformers are already imported: a subprocess per
# family would spend most of its time importing them.
FAMILIES = ("qwen2", "mistral", "gemma2", "qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_probe_family_plain_loop_on_cpu(family, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(PROBE.parent))
    hf_probe = importlib.import_module("hf_probe")
    out = tmp_path / "hf_probe.json"
    argv = ["--device", "cpu", "--model", "tiny", "--family", family, "--batches", "1", "--steps", "2",
            "--new-tokens", "0", "--dtype", "fp32", "--json", str(out)]
    torch._dynamo.reset()
    try:
        assert hf_probe.main(argv) == 0
    finally:
        torch._dynamo.reset()
    report = json.loads(out.read_text())
    assert report["family"] == report["model_info"]["family"] == family
    (case,) = report["cases"]
    assert case["variant"] == "hf-plain-loop" and case["step_plain_us"] > 0
    assert report["generate"] == []  # --new-tokens 0: the plain loop only
