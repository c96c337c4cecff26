"""benchmarks/hf_probe.py runs on CPU: the plain loop's host parts and generate()'s split."""

import json
import pathlib
import subprocess
import sys

import pytest

PROBE = pathlib.Path(__file__).parent.parent / "benchmarks" / "hf_probe.py"


def test_hf_probe_smoke_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf_probe.json"
    command = [sys.executable, str(PROBE), "--device", "cpu", "--model", "tiny", "--batches", "1", "--steps", "3",
               "--new-tokens", "4", "--dtype", "fp32", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    assert case["variant"] == "hf-plain-loop" and case["step_plain_us"] > 0
    assert "runtime call" in case["parts_us"] and "outside the runtime / runner" in case["parts_us"]
    (generate,) = report["generate"]
    assert 0 < generate["forward_calls_ms_per_token"] < generate["wall_ms_per_token"]
