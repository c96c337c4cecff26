"""benchmarks/decode_bench.py runs on CPU (--tiny): every row, its checks against eager, the targets."""

import json

VARIANTS = ("eager", "cgcompile-eager", "breakable", "peer-breakable")


def test_decode_bench_smoke_on_cpu(tmp_path, bench_main):
    out = tmp_path / "decode_bench.json"
    argv = ["--device", "cpu", "--tiny", "--variants", ",".join(VARIANTS), "--out", str(out)]
    assert bench_main("decode_bench", argv) == 0
    model = json.loads(out.read_text())["models"]["tiny"]
    rows = model["variants"]
    assert list(rows) == list(VARIANTS)
    for name in ("eager", "cgcompile-eager", "breakable"):
        assert rows[name]["error"] is None, rows[name]["error"]
        assert sorted(rows[name]["ms_per_step"]) == ["1", "64", "8"]
        assert not any(check["flagged"] for check in rows[name]["checks"].values())
    # The peer library is optional: without it its row says how to install it.
    peer = rows["peer-breakable"]
    assert peer["error"] is None or peer["error"].startswith("not installed"), peer["error"]
    issue4 = [t for t in model["targets"] if t["issue"] == 4]
    assert [t["op"] for t in issue4] == [">=", "<=", "<"]
    assert issue4[2]["passed"] is None  # the capture-time target is for the 1b model, on CUDA


def test_host_probe_splits_a_step_into_parts_on_cpu(tmp_path, bench_main):
    out = tmp_path / "host_probe.json"
    argv = ["--device", "cpu", "--model", "tiny", "--dtype", "fp32", "--variants", "cgcompile-eager", "--batches", "1,3",
            "--steps", "3", "--json", str(out)]
    assert bench_main("host_probe", argv) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["variant"], c["batch"]) for c in cases] == [("cgcompile-eager", 1), ("cgcompile-eager", 3)]
    for case in cases:
        # Without CUDA graphs every piece runs as FX code, called from the stitch: 2 layers, 5 pieces.
        assert case["calls_per_step"]["pieces run eagerly"] == 5
        assert case["calls_per_step"]["stitch code"] == 1
        assert sum(case["parts_us"].values()) > 0
