"""The test tools of cgcompile.testing: fake CUDA graphs through one seam, modules that a
pass-only test can import without transformers, and TF32 settings that every test restores."""

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import cgcompile
from cgcompile.run.capture import CaptureSession, CudaGraphs
from cgcompile.testing import fake_graphs, numerics
from cgcompile.testing.models import SILLY_OP, ToyLlama

TESTS = pathlib.Path(__file__).resolve().parent


def test_fake_graphs_replace_only_the_capture_seam():
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake_graphs.fake_cuda_graphs(monkeypatch)
        assert isinstance(CaptureSession.graphs, fake_graphs.FakeCudaGraphs)
        assert [(type(target), name) for target, name, _ in monkeypatch._setattr] == [(type, "graphs")]
    assert type(CaptureSession.graphs) is CudaGraphs


def test_fake_graphs_capture_and_replay_on_cpu(monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    torch.manual_seed(0)
    model = ToyLlama(2).requires_grad_(False)  # inference: with gradients on nothing is captured
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], capture_sizes=(4, 8)))
    compiled = torch.compile(model, backend=backend)
    for n in (5, 3, 7):  # sizes 8, 4, 8: the third call replays what the first captured
        ids = torch.randint(0, 64, (n,))
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids))  # padded rows change the matmuls' blocking
    assert fake_graphs.FakeGraph.captures == 2 * 3  # 3 capturable pieces at sizes 8 and 4
    assert fake_graphs.FakeGraph.replays == 3 * 3


@pytest.mark.parametrize("module", ["fake_graphs", "fx", "numerics", "gpu", "models"])
def test_pass_tests_tools_do_not_import_transformers(module):
    code = f"import sys, cgcompile.testing.{module}; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_exact_fp32_matmuls_restores_the_settings():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with numerics.exact_fp32_matmuls():
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def _unrestored_tf32(path: pathlib.Path) -> list[str]:
    """Test functions in `path` that set allow_tf32 without reading it first (to put it back)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        attributes = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "allow_tf32"]
        if any(isinstance(a.ctx, ast.Store) for a in attributes) and not any(isinstance(a.ctx, ast.Load) for a in attributes):
            found.append(f"{path.relative_to(TESTS)}::{node.name}")
    return found


def test_no_test_leaves_tf32_changed():
    unrestored = [f for path in sorted(TESTS.rglob("test_*.py")) for f in _unrestored_tf32(path)]
    assert not unrestored, f"expected the exact_fp32_matmuls fixture, got allow_tf32 set in {unrestored}"
