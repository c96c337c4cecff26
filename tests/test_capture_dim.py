"""The capture dimension: the default rule, the override, and how it decides what is captured."""

import json

import pytest
import torch

import cgcompile


def two_streams(x, y):  # x: [A, 8], y: [B, 8]
    return x.sin().sum(0) + y.cos().sum(0)  # [8]


def run(tmp_path, fn, args, **fields):
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", dump_dir=str(tmp_path), **fields))
    assert torch.equal(torch.compile(fn, backend=backend)(*args), fn(*args))
    with open(tmp_path / "graph_0" / "summary.json") as f:
        return backend, json.load(f)["capture_dim"]


def dynamic_pair(dim_y: int = 0):
    x, y = torch.randn(4, 8), torch.randn(6, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, dim_y)
    return x, y


def eager_nodes(backend) -> str:
    return " ".join(p.reason for p in backend.pieces if not p.capturable)


def test_default_rule_takes_the_first_dynamic_input(tmp_path):
    backend, capture_dim = run(tmp_path, two_streams, dynamic_pair())
    assert capture_dim.endswith("(dim 0 of L['x'])")
    # Work over x is captured; work over y depends on another size and runs eagerly.
    assert "cos:" in eager_nodes(backend) and "sin:" not in eager_nodes(backend)


def test_default_rule_skips_static_inputs(tmp_path):
    def scaled(mask, x):  # mask: [8] static, x: [T, 8]
        return x * mask

    x = torch.randn(5, 8)
    torch._dynamo.mark_dynamic(x, 0)
    backend, capture_dim = run(tmp_path, scaled, (torch.randn(8), x))
    assert capture_dim.endswith("(dim 0 of L['x'])")
    assert [p.capturable for p in backend.pieces] == [True]


def test_static_graph_has_no_capture_dim(tmp_path):
    backend, capture_dim = run(tmp_path, two_streams, (torch.randn(4, 8), torch.randn(6, 8)))
    assert capture_dim == "None"
    assert [p.capturable for p in backend.pieces] == [True]


def test_override_input(tmp_path):
    backend, capture_dim = run(tmp_path, two_streams, dynamic_pair(), capture_input="y")
    assert capture_dim.endswith("(dim 0 of L['y'])")
    assert "sin:" in eager_nodes(backend) and "cos:" not in eager_nodes(backend)


def test_override_input_and_dim(tmp_path):
    def f(x, y):  # x: [A, 8], y: [8, B]
        return x.sin().sum(0) + y.cos().sum(1)

    x, y = torch.randn(4, 8), torch.randn(8, 6)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 1)
    backend, capture_dim = run(tmp_path, f, (x, y), capture_input="y", capture_input_dim=1)
    assert capture_dim.endswith("(dim 1 of L['y'])")
    assert "sin:" in eager_nodes(backend) and "cos:" not in eager_nodes(backend)


def test_override_names_no_input():
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_input="tokens"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(two_streams, backend=backend)(*dynamic_pair())
    assert isinstance(info.value.inner_exception, cgcompile.ConfigError)
    assert "capture_input: no graph input named 'tokens'; the tensor inputs are" in str(info.value)


def test_override_names_a_static_dim():
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_input="x", capture_input_dim=1))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(two_streams, backend=backend)(*dynamic_pair())
    message = str(info.value)
    assert "dim 1 of input 'x' (shape" in message
    assert "is not a dynamic size; mark it with torch._dynamo.mark_dynamic(tensor, 1)" in message
