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


def test_override_of_a_static_dim_gives_a_static_graph(tmp_path):
    # Dynamo compiles a model's first call with every size fixed; the override must accept that.
    x, y = dynamic_pair()
    backend, capture_dim = run(tmp_path, two_streams, (x, y), capture_input="x", capture_input_dim=1)
    assert capture_dim == "None"
    assert "sin:" in eager_nodes(backend) and "cos:" in eager_nodes(backend)


def test_override_names_a_missing_dim():
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_input="x", capture_input_dim=2))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(two_streams, backend=backend)(*dynamic_pair())
    assert "capture_input: input 'x' has shape" in str(info.value)
    assert "no dim 2; pick a dim below 2" in str(info.value)
