"""benchmarks/dtensor_guards.py runs on CPU: one gloo rank and all three variants, and with
--hf on two ranks."""

import pathlib
import re
import subprocess
import sys

import pytest

from parallel_launch import torchrun

PROBE = pathlib.Path(__file__).parent.parent.parent / "benchmarks" / "dtensor_guards.py"


def test_dtensor_guards_smoke_on_cpu():
    result = subprocess.run([sys.executable, str(PROBE), "--layers", "2", "--calls", "20"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    header, row = result.stdout.strip().splitlines()[-2:]
    assert header.split()[:2] == ["layers", "params"]
    layers, params, *times = row.split()
    assert (layers, params) == ("2", "4") and len(times) == 3 and all(float(t) > 0 for t in times)


def test_dtensor_guards_times_a_transformers_llama_whole_and_tp_plan_on_two_gloo_ranks():
    """--hf: every variant of the guard table is timed (the filters compose with the
    tp_plan model's hooks and with cgcompile's spec drop); rank 0 prints the one row."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' tp_plan needs it
    out = torchrun(PROBE, "--hf", "--layers", "2", "--calls", "10", "--guard-kinds", timeout=300)
    lines = out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["layers", "whole", "us"])
    layers, *times = lines[header + 1].split()
    assert layers == "2" and len(times) == 5 and all(float(t) > 0 for t in times), out
    # --guard-kinds: the filter's guards in the tp_plan frames, the TP hooks' wrapped forwards among them
    dropped, total = re.search(r"guards on torch.nn's modules: (\d+) of (\d+)", out).groups()
    assert 0 < int(dropped) < int(total), out
    assert "<module>.forward" in lines[header + 4], out
