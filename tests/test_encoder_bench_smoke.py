"""benchmarks/encoder_bench.py runs on CPU (--tiny): every variant timed with the shared
harness, outputs checked against eager, the JSON with its environment."""

import json


def test_encoder_bench_smoke_on_cpu(tmp_path, bench_main):
    out = tmp_path / "encoder.json"
    argv = ["--device", "cpu", "--tiny", "--parts", "throughput", "--rounds", "2", "--iters", "2", "--json", str(out)]
    assert bench_main("encoder_bench", argv) == 0
    report = json.loads(out.read_text())
    assert report["environment"]["torch"]
    rows = [row for row in report["rows"] if row["part"] == "throughput"]
    # CPU has no reduce-overhead variant (no CUDA graphs); eager and cgcompile at every size.
    assert {(row["variant"], row["images"]) for row in rows} == {
        (variant, n) for variant in ("eager", "cgcompile") for n in (1, 8, 32)
    }
    for row in rows:
        assert row["ms"] > 0 and row["best_window_ms"] <= row["ms"] * 2
        assert row["max_abs_err"] < 1e-4, row
