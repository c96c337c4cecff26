"""benchmarks/gemv_bench.py runs on CPU: every kernel choice computes the linear it stands for."""

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).parent.parent / "benchmarks" / "gemv_bench.py"


def test_gemv_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "gemv.json"
    command = [sys.executable, str(BENCH), "--device", "cpu", "--shapes", "tiny", "--rows", "3",
               "--variants", "cublas,reduction", "--dtype", "fp32", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["rows"]) for r in rows] == [("cublas", 3), ("reduction", 3)]
    assert all(r["max_rel_error"] < 1e-5 for r in rows), rows
