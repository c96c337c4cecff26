"""Partition correctness on tiny models: piece counts, what lands where, exact outputs."""

import operator

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.testing.models import SILLY_OP, ToyLayer, ToyLlama

silly = torch.ops.cgcompile_testing.silly_attention


@torch.library.custom_op("cgcompile_tests::split_pair", mutates_args=())
def split_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@split_pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def eager_backend(**fields) -> cgcompile.Backend:
    return cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], **fields))


def dynamic(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    torch._dynamo.mark_dynamic(t, dim)
    return t


def test_silly_attention_op_is_exact():
    q, k, v = torch.randn(3, 4, 8).unbind(0)
    assert torch.equal(silly(q, k, v), q + k * v)


def test_silly_attention_splits_only_when_listed():
    def f(x):
        return silly(x.sin(), x, x).cos()

    x = torch.randn(4, 8)
    plain = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    assert torch.equal(torch.compile(f, backend=plain)(x), f(x))
    assert [p.capturable for p in plain.pieces] == [True]

    torch._dynamo.reset()
    split = eager_backend()
    assert torch.equal(torch.compile(f, backend=split)(x), f(x))
    assert [p.capturable for p in split.pieces] == [True, False, True]
    assert split.pieces[1].reason.endswith(f"{SILLY_OP}.default is listed in Config.splitting_ops [split_op]")


@pytest.mark.parametrize("n_layers", [1, 3])
def test_toy_llama_pieces(n_layers):
    torch.manual_seed(0)
    model = ToyLlama(n_layers)
    backend = eager_backend()
    ids = dynamic(torch.randint(0, 64, (7,)))
    assert torch.equal(torch.compile(model, backend=backend)(ids), model(ids))

    stats = backend.stats
    assert (stats.graphs_seen, stats.pieces, stats.capturable_pieces) == (1, 2 * n_layers + 1, n_layers + 1)
    assert (stats.compilations, stats.graphs_captured) == (0, 0)  # compiler="eager", CPU
    assert [p.capturable for p in backend.pieces] == [i % 2 == 0 for i in range(2 * n_layers + 1)]
    assert [p.name for p in backend.pieces] == [f"graph0.piece_{i}" for i in range(2 * n_layers + 1)]
    for piece in backend.pieces:
        assert isinstance(piece.graph, torch.fx.GraphModule)
        assert (piece.reason is None) == piece.capturable
        targets = [n.target for n in piece.graph.graph.nodes if n.op == "call_function"]
        assert (silly.default in targets or silly in targets) != piece.capturable


def test_mark_dynamic_runs_many_sizes_without_recompiling():
    torch.manual_seed(0)
    model = ToyLlama(2)
    backend = eager_backend()
    compiled = torch.compile(model, backend=backend)
    for n in (5, 2, 17, 64, 3):  # not 1: Dynamo specializes sizes 0 and 1 and would recompile
        ids = dynamic(torch.randint(0, 64, (n,)))
        assert torch.equal(compiled(ids), model(ids))
    assert backend.stats.graphs_seen == 1
    assert all("s" in p.input_shapes[0] for p in backend.pieces)  # e.g. "int64[s23]"


def test_adjacent_split_ops_merge_into_one_eager_piece():
    def f(x):
        y = silly(x.sin(), x, x)
        y = silly(y, y, x)
        return y.cos()

    x = torch.randn(4, 8)
    backend = eager_backend()
    assert torch.equal(torch.compile(f, backend=backend)(x), f(x))
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    eager = backend.pieces[1]
    assert eager.node_count == 2
    assert eager.reason.count("[split_op]") == 2


def test_getitem_stays_with_its_producer():
    def f(x):
        a, b = torch.ops.cgcompile_tests.split_pair(x.sin())
        return (a * b).cos()

    x = torch.randn(4, 8)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=["cgcompile_tests::split_pair"]))
    assert torch.equal(torch.compile(f, backend=backend)(x), f(x))
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    eager_targets = [n.target for n in backend.pieces[1].graph.graph.nodes if n.op == "call_function"]
    assert eager_targets.count(operator.getitem) == 2
    # The piece after it receives the two tensors, not the tuple.
    assert backend.pieces[2].input_shapes == ("float32[4, 8]", "float32[4, 8]")


def test_no_size_crosses_a_piece_boundary():
    def f(x, w):  # x: [T, 8]
        shape = x.shape  # a torch.Size taken before the split...
        h = x @ w
        y = silly(h, h, h)
        return y.view(shape[0], 2, -1).reshape(shape) * 2  # ...and used after it

    x, w = dynamic(torch.randn(6, 8)), torch.randn(8, 8)
    backend = eager_backend()
    assert torch.equal(torch.compile(f, backend=backend)(x, w), f(x, w))
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    for piece in backend.pieces:
        for node in piece.graph.graph.nodes:
            if node.op == "placeholder":
                value = node.meta.get("example_value", node.meta.get("val"))
                assert isinstance(value, (torch.Tensor, torch.SymInt)), (piece.name, node.name, value)
        assert not any("Size" in s or s.startswith("(") for s in piece.input_shapes), piece.input_shapes


def test_two_compiled_modules_in_one_model():
    class TwoBlocks(nn.Module):
        def __init__(self, backend):
            super().__init__()
            self.first = torch.compile(ToyLayer(16), backend=backend)
            self.second = torch.compile(ToyLayer(16), backend=backend)

        def forward(self, x):
            return self.second(self.first(x).relu())

    torch.manual_seed(0)
    backend = eager_backend()
    model = TwoBlocks(backend)
    x = torch.randn(5, 16)
    expected = model.second._orig_mod(model.first._orig_mod(x).relu())
    assert torch.equal(model(x), expected)
    assert backend.stats.graphs_seen == 2
    assert [p.name for p in backend.pieces] == [f"graph{g}.piece_{i}" for g in (0, 1) for i in range(3)]
    assert [p.capturable for p in backend.pieces] == [True, False, True] * 2
    assert (backend.stats.pieces, backend.stats.capturable_pieces) == (6, 4)


def test_graph_break_gives_two_graphs():
    def f(x):
        x = silly(x.sin(), x, x)
        torch._dynamo.graph_break()
        return silly(x, x, x).cos()

    x = torch.randn(4, 8)
    backend = eager_backend()
    assert torch.equal(torch.compile(f, backend=backend)(x), f(x))
    assert backend.stats.graphs_seen == 2
    assert [(p.graph_index, p.capturable) for p in backend.pieces] == [(0, True), (0, False), (1, False), (1, True)]
