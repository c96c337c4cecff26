"""benchmarks/gemv_bench.py runs on CPU: every kernel choice computes the linear it stands for."""

import json


def test_gemv_bench_smoke_on_cpu(tmp_path, bench_main):
    out = tmp_path / "gemv.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--rows", "3", "--variants", "cublas,reduction", "--dtype", "fp32",
            "--json", str(out)]
    assert bench_main("gemv_bench", argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["rows"]) for r in rows] == [("cublas", 3), ("reduction", 3)]
    assert all(r["max_rel_error"] < 1e-5 for r in rows), rows
