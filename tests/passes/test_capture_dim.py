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
    assert "capture_input: expected the name of a tensor input as in forward, got 'tokens'; the graph's" in str(info.value)


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
    assert "capture_input: expected capture_input_dim below 2 for input 'x' of shape" in str(info.value)
    assert "got 2; pick a dimension the input has" in str(info.value)


def test_override_names_a_torch_nn_module_input_as_in_forward(tmp_path):
    # Dynamo traces a torch.nn module through a wrapper, so its inputs are L['args'][i];
    # capture_input still takes the forward's names (nn.Bilinear.forward(input1, input2)).
    x1, x2 = torch.randn(4, 3), torch.randn(4, 5)
    torch._dynamo.mark_dynamic(x1, 0)
    torch._dynamo.mark_dynamic(x2, 0)
    _, default = run(tmp_path / "default", torch.nn.Bilinear(3, 5, 2), (x1, x2))
    _, named = run(tmp_path / "named", torch.nn.Bilinear(3, 5, 2), (x1, x2), capture_input="input2")
    assert default.endswith("(dim 0 of L['args'][0])")
    assert named.endswith("(dim 0 of L['args'][1])")


def test_override_on_sequential_by_forward_name_and_by_dynamo_name(tmp_path):
    x = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    for name in ("input", "L['args'][0]"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        _, capture_dim = run(tmp_path / str(len(name)), model, (x,), capture_input=name)
        assert capture_dim.endswith("(dim 0 of L['args'][0])")


def test_unknown_override_on_sequential_lists_the_forward_name():
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_input="x"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(model, backend=backend)(torch.randn(3, 4))
    assert "got 'x'; the graph's tensor inputs other than parameters and buffers are [\"input (L['args'][0])\"]" in str(
        info.value
    )


def test_reason_in_a_graph_without_capture_dimension(tmp_path):
    def grow(x, cache):  # x: [1, 1], cache: [1, S]: S is dynamic, dim 0 fixed
        return torch.cat([cache, x], 1).sin()

    cache = torch.randn(1, 5)
    torch._dynamo.mark_dynamic(cache, 1)
    backend, capture_dim = run(tmp_path, grow, (torch.randn(1, 1), cache))
    assert capture_dim == "None"
    (piece,) = backend.pieces
    assert "depends on the dynamic size s" in piece.reason
    assert "(a graph without a capture dimension captures fixed shapes only) [dynamic_shape]" in piece.reason
    assert "not on the capture dimension" not in piece.reason
