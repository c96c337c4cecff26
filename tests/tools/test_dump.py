"""Dumps for people: files per graph, `python -m cgcompile.inspect`, and depyf."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import cgcompile
from cgcompile.tools import dump
from cgcompile.testing.models import SILLY_OP, ToyLlama


def compile_toy(dump_dir=None):
    torch.manual_seed(0)
    model = ToyLlama(2)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], dump_dir=dump_dir))
    ids = torch.randint(0, 64, (5,))
    torch._dynamo.mark_dynamic(ids, 0)
    assert torch.equal(torch.compile(model, backend=backend)(ids), model(ids))
    return backend


def test_dump_dir_files(tmp_path):
    backend = compile_toy(str(tmp_path))
    folder = tmp_path / "graph_0"
    expected = {"original.py", "split.py", "summary.json", "summary.txt"} | {f"piece_{i}.py" for i in range(5)}
    assert set(os.listdir(folder)) == expected
    assert "silly_attention" in (folder / "piece_1.py").read_text()
    assert "self.piece_4(" in (folder / "split.py").read_text()
    assert "torch.ops.cgcompile_testing.silly_attention" in (folder / "original.py").read_text()

    summary = json.loads((folder / "summary.json").read_text())
    assert summary["graph_index"] == 0
    assert summary["capture_dim"].endswith("(dim 0 of L['ids'])")
    assert [p["piece"] for p in summary["pieces"]] == [p.name for p in backend.pieces]
    assert [p["capturable"] for p in summary["pieces"]] == [True, False, True, False, True]
    assert [p["nodes"] for p in summary["pieces"]] == [p.node_count for p in backend.pieces]
    assert summary["pieces"][1]["inputs"][0].startswith("float32[s")  # shapes keep their symbols
    assert summary["pieces"][1]["reason"] == backend.pieces[1].reason
    assert (folder / "summary.txt").read_text() == dump.format_summary(summary)


def test_inspect_prints_the_summary(tmp_path):
    compile_toy(str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "cgcompile.inspect", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("graph0: capture dimension s")
    assert lines[2].split() == ["piece", "kind", "nodes", "inputs", "sizes", "reason"]
    assert lines[4].split()[:3] == ["graph0.piece_1", "eager", "1"]
    assert "split_op at" in lines[4]


def test_inspect_without_a_dump(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cgcompile.inspect", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "no cgcompile dump in" in result.stderr and "CGCOMPILE_DUMP_DIR" in result.stderr


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CGCOMPILE_DUMP_DIR", str(tmp_path))
    assert cgcompile.Config().resolved_dump_dir() == str(tmp_path)
    assert cgcompile.Config(dump_dir="elsewhere").resolved_dump_dir() == "elsewhere"
    compile_toy()
    assert os.path.exists(tmp_path / "graph_0" / "summary.json")


def test_no_dump_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("CGCOMPILE_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cgcompile.Config().resolved_dump_dir() is None
    compile_toy()
    assert os.listdir(tmp_path) == []


def test_pieces_show_up_in_depyf_dump(tmp_path):
    depyf = pytest.importorskip("depyf")
    out = tmp_path / "depyf"
    with depyf.prepare_debug(str(out)):
        compile_toy()
    pieces = sorted(glob.glob(str(out / "__compiled_fn_*.cgcompile_piece_*.py")))
    assert len(pieces) == 5, os.listdir(out)
    assert any("silly_attention(" in open(p).read() for p in pieces)
    assert glob.glob(str(out / "__compiled_fn_*.cgcompile_split_graph.*.py"))
    assert glob.glob(str(out / "full_code_for_forward_*.py"))


def test_backend_by_name_dumps_every_graph(tmp_path, monkeypatch):
    def f(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()

    monkeypatch.setenv("CGCOMPILE_DUMP_DIR", str(tmp_path))
    x = torch.randn(3)
    assert torch.equal(torch.compile(f, backend="cgcompile", options={"compiler": "eager"})(x), f(x))
    originals = [p.read_text() for p in sorted(tmp_path.glob("graph_*/original.py"))]
    assert len(originals) == 2
    assert "sin()" in originals[0] and "cos()" in originals[1]
