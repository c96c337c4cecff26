"""Padding safety: the pure pass on single ops, and padded runs on CPU (Config.padding=True)."""

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.passes import find_capture_dim, find_padding_hazards
from cgcompile.testing.models import SILLY_OP

W = torch.randn(8, 8)
TABLE = torch.randn(100, 8)


def _split(x):
    return torch.ops.cgcompile_testing.silly_attention(x, x, x)


def _clone_and_set(x, index):
    t = x.clone()
    t[index] = 0
    return t


# name -> (function of x: [n, 8], the op named in the hazard, or None when safe)
OPS = {
    "rowwise": (lambda x: F.silu(x @ W) * 2 + 1, None),
    "mean_last": (lambda x: x - x.mean(-1, keepdim=True), None),
    "softmax_last": (lambda x: torch.softmax(x, -1), None),
    "cumsum_last": (lambda x: x.cumsum(1), None),
    "topk_last": (lambda x: torch.topk(x, 2, dim=-1).values, None),
    "layer_norm": (lambda x: F.layer_norm(x, (8,)), None),
    "heads_view": (lambda x: x.view(x.shape[0], 2, 4).transpose(1, 2).reshape(x.shape[0], 8), None),
    "arange_positions": (lambda x: x + torch.arange(x.shape[0])[:, None], None),
    "position_table": (lambda x: x + TABLE[: x.shape[0]], None),
    "gather_last": (lambda x: torch.gather(x, 1, x.argmax(-1, keepdim=True)), None),
    "in_place": (lambda x: (x * 2).mul_(3).add_(1), None),
    "set_columns": (lambda x: _clone_and_set(x, (slice(None), slice(0, 2))), None),
    "cat_last": (lambda x: torch.cat([x, x * 2], 1), None),
    "one_hot": (lambda x: F.one_hot(x.argmax(-1), 8).float() * x, None),
    "zeros_of_size": (lambda x: x + torch.zeros(x.shape[0], 8), None),
    "size_as_value": (lambda x: torch.sin(x) + x.shape[0], "uses the capture size"),
    "divide_by_size": (lambda x: x / x.size(0), "uses the capture size"),
    "full_of_size": (lambda x: x + torch.full((x.shape[0], 8), x.shape[0]), "uses the capture size"),
    "reversed_arange": (lambda x: x + torch.arange(x.shape[0] - 1, -1, -1)[:, None], "uses the capture size"),
    "mean_rows": (lambda x: x - x.mean(0, keepdim=True), "mean reduces"),
    "amax_rows": (lambda x: x.amax(0, keepdim=True) * x, "amax reduces"),
    "max_rows": (lambda x: x.max(0).values, "max reduces"),
    "softmax_rows": (lambda x: torch.softmax(x, 0), "softmax mixes rows"),
    "cumsum_rows": (lambda x: x.cumsum(0), "cumsum mixes rows"),
    "sort_rows": (lambda x: x.sort(0).values, "sort mixes rows"),
    "flip_rows": (lambda x: x.flip(0), "flip mixes rows"),
    "normalize_rows": (lambda x: F.normalize(x, dim=0), "normalize mixes rows"),
    "gram": (lambda x: x.T @ x, "matmul reduces"),
    "scrambling_reshape": (lambda x: x.reshape(8, -1), "moves elements across rows"),
    "flatten_rows": (lambda x: x.unsqueeze(1).expand(-1, 3, -1).reshape(-1, 8), "inside an expression"),
    "cat_rows": (lambda x: torch.cat([x, x * 2], 0), "inside an expression"),
    "last_row": (lambda x: x - x[-1], "getitem reduces"),
    "index_rows": (lambda x: x[x[:, 0].long().clamp(0, 1)], "getitem picks rows"),
    "set_row": (lambda x: _clone_and_set(x, 0), "setitem picks rows"),
    "outer_rows": (lambda x: x[:, None, :] * x[None, :, :], "rows meet padding rows"),
}


def _hazards(fn) -> list[str]:
    found = {}

    def backend(gm, example_inputs):
        dim = find_capture_dim(gm, frozenset())
        found["hazards"] = [str(h) for h in find_padding_hazards(gm, dim.symbol).values()]
        return gm.forward

    x = torch.randn(5, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(fn, backend=backend, fullgraph=True)(x)
    return found["hazards"]


@pytest.mark.parametrize("name", OPS)
def test_padding_hazard_of_one_op(name):
    fn, expected = OPS[name]
    hazards = _hazards(fn)
    if expected is None:
        assert hazards == []
    else:
        assert any(expected in h and h.endswith("[padding_unsafe]") for h in hazards), hazards


def _compile(fn, **options):
    options = {"compiler": "eager", "capture_sizes": (1, 2, 4, 8), "padding": True,
               "splitting_ops": [SILLY_OP], **options}
    config = cgcompile.Config(**options)
    backend = cgcompile.Backend(config)
    return torch.compile(fn, backend=backend), backend


ISSUE_EXAMPLES = {
    "size_as_value": lambda x: _split(torch.sin(x)) + x.shape[0],
    "centre_before_split": lambda x: _split(x - x.mean(0, keepdim=True)),
    "centre_after_split": lambda x: (lambda y: y - y.mean(0, keepdim=True))(_split(x)),
    "amax_before_split": lambda x: _split(x.amax(0, keepdim=True) * x),
    "softmax_after_split": lambda x: torch.softmax(_split(x), 0),
}


@pytest.mark.parametrize("name", ISSUE_EXAMPLES)
def test_unsafe_graphs_run_at_exact_sizes_and_equal_eager(name):
    fn = ISSUE_EXAMPLES[name]
    compiled, backend = _compile(fn)
    for n in (3, 5, 6, 8, 37, 2, 7):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), fn(x))
    unsafe = [p for p in backend.pieces if p.padding_unsafe]
    assert unsafe and all(p.capturable for p in unsafe)
    assert all(p.sizes.startswith("exact sizes: ") for p in backend.pieces)
    assert backend.runtimes[-1].step.size is None or backend.runtimes[-1].step.size == 7


def test_row_independent_graphs_are_padded():
    def fn(x):
        return torch.relu(_split(x @ W)) + 1

    compiled, backend = _compile(fn)
    for n in (3, 5, 8, 11):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), fn(x))
        step = backend.runtimes[-1].step
        assert (step.n, step.size) == (n, {3: 4, 5: 8, 8: 8, 11: None}[n])
    assert all(p.padding_unsafe is None for p in backend.pieces)
    assert backend.pieces[0].sizes == "padded to the capture sizes"


def test_padding_off_runs_exact_sizes():
    compiled, backend = _compile(lambda x: _split(x) * 2, padding=False)
    x = torch.randn(3, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    assert backend.runtimes[-1].step.size == 3
    assert backend.pieces[0].sizes == "exact sizes: padding is off (Config.padding)"


def test_exact_size_limit_runs_new_sizes_without_graphs(caplog):
    compiled, backend = _compile(lambda x: _split(x - x.mean(0)), exact_size_limit=2)
    sizes = []
    for n in (3, 5, 6, 3):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), _split(x - x.mean(0)))
        sizes.append(backend.runtimes[-1].step.size)
    assert sizes == [3, 5, None, 3]
    assert "exact_size_limit" in caplog.text


def test_exact_sizes_always_admit_the_capture_sizes():
    # Ahead-of-time capture goes largest first: with the capture sizes counted against the
    # limit, the smallest (decode's) were left without graphs.
    from cgcompile.run.buffers import PaddingTable, SizePolicy

    sizes = cgcompile.Config().sizes.capture_sizes
    policy = SizePolicy(PaddingTable(sizes), exact=True, limit=2, name="g")
    assert [policy.size_for(n) for n in sorted(sizes, reverse=True)] == sorted(sizes, reverse=True)
    assert [policy.size_for(n) for n in (3, 5, 6, 3, 1, 300)] == [3, 5, None, 3, 1, None]


def test_padding_reason_in_dump_and_inspect(tmp_path, capsys):
    compiled, _ = _compile(lambda x: _split(x - x.mean(0)), dump_dir=str(tmp_path))
    x = torch.randn(5, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    from cgcompile import inspect as inspect_cli

    assert inspect_cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exact sizes: piece_0 is unsafe to pad" in out
    assert "mean reduces or indexes over the capture dimension (dim 0 of [s" in out


class _Cache(torch.nn.Module):
    def __init__(self, write):
        super().__init__()
        self.register_buffer("cache", torch.ones(16, 8))
        self.write = write

    def forward(self, x):  # x: [n, 8]
        self.write(self.cache, x)
        return _split(self.cache * 1.0)


WRITES = {
    "setitem_prefix": lambda cache, x: cache.__setitem__(slice(None, x.shape[0]), x.sin()),
    "copy_into_prefix": lambda cache, x: cache[: x.shape[0]].copy_(x.sin()),
    "index_copy_rows": lambda cache, x: cache.index_copy_(0, torch.arange(x.shape[0]), x.sin()),
}


@pytest.mark.parametrize("name", WRITES)
def test_writes_of_rows_into_a_buffer_are_not_padded(name):
    model = _Cache(WRITES[name])
    reference = _Cache(WRITES[name])
    compiled, backend = _compile(model)
    for n in (3, 5):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), reference(x))
    op = {"setitem_prefix": "setitem", "copy_into_prefix": "copy_", "index_copy_rows": "index_copy_"}[name]
    assert any((p.padding_unsafe or "").startswith(op) for p in backend.pieces)


def test_in_place_write_into_an_earlier_piece_result_is_kept():
    def fn(x):
        t = _split(x)  # an eager piece makes t
        t.mul_(2.0)  # a write into it, in the next piece
        return t

    compiled, backend = _compile(fn)
    for n in (3, 8):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), fn(x))
    assert any("which an earlier piece made [input_mutation]" in (p.reason or "") for p in backend.pieces)


def test_view_made_in_a_graph_and_written_later_aliases_the_real_tensor():
    def fn(x):
        t0 = _split(x)  # an eager piece makes t0
        t2 = t0[:, :2]  # a view of t0, in the next (padded) piece
        t4 = _split(torch.relu(t0))
        t2.add_(1.0)  # written through in a later piece: t0 must see it
        return t0, t4

    compiled, backend = _compile(fn)
    for n in (3, 5):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), fn(x))
    assert any("and an op writes into [input_mutation]" in (p.reason or "") for p in backend.pieces)


def _row_scale(x):
    return x * 2.0


@pytest.mark.parametrize("target", [(0.5).__eq__, divmod, _row_scale], ids=["method_wrapper", "builtin", "function"])
def test_a_target_that_is_no_op_gets_a_reason(target):
    # aten has attributes of these names that are no op packets (aten.__eq__ is the
    # namespace's own method-wrapper): the pass once asked them for their overloads.
    def backend(gm, example_inputs):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        original, node.target = node.target, target
        dim = find_capture_dim(gm, frozenset())
        found["hazards"] = [str(h) for h in find_padding_hazards(gm, dim.symbol).values()]
        node.target = original  # Dynamo prints the graph afterwards: it wants a real target
        return gm.forward

    found = {}
    x = torch.randn(5, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda x: torch.sin(x) * 2, backend=backend, fullgraph=True)(x)
    name = target.__name__
    assert any(h.startswith(f"sin: {name} is not known to keep rows apart") for h in found["hazards"]), found


# -- ops proven by their schema: pointwise tags, or a decomposition into tagged ops -------

PRELU_CHANNELS = torch.nn.PReLU(4)
with torch.no_grad():
    PRELU_CHANNELS.weight.copy_(torch.tensor([0.1, -0.5, 2.0, 0.3]))

# name -> (function of x: [n, 4, 3]); hardswish and prelu carry no pointwise tag, silu
# does, and special_erfcx is in none of the pass's tables: only its tag proves it.
ELEMENTWISE = {
    "hardswish": lambda x: F.hardswish(x),
    "hardswish_in_place": lambda x: torch.nn.Hardswish(inplace=True)(x * 2),
    "prelu_channels": lambda x: PRELU_CHANNELS(x),  # weight [4] over dim 1
    "prelu_one": lambda x: F.prelu(x, torch.tensor([0.25])),
    "silu": lambda x: F.silu(x),
    "erfcx_by_tag": lambda x: torch.special.erfcx(x),
    "dropout_eval": lambda x: F.dropout(x, 0.5, training=False),
}


def _hazards_of(fn, shape) -> list[str]:
    found = {}

    def backend(gm, example_inputs):
        dim = find_capture_dim(gm, frozenset())
        found["hazards"] = [str(h) for h in find_padding_hazards(gm, dim.symbol).values()]
        return gm.forward

    x = torch.randn(*shape)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(fn, backend=backend, fullgraph=True)(x)
    return found["hazards"]


def test_erfcx_is_proven_by_its_tag_alone():
    assert torch.Tag.pointwise in torch.ops.aten.special_erfcx.default.tags


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_ops_keep_rows_apart(name):
    assert _hazards_of(ELEMENTWISE[name], (5, 4, 3)) == []


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_padded_rows_of_elementwise_ops_equal_unpadded(name):
    # Differential, with real numbers: garbage padding rows leave the real rows as they were.
    # Not bit for bit: a vectorized CPU kernel may round its tail elements (which move with
    # the row count) one ulp apart; a leak of the 100x garbage would be far larger.
    fn, x = ELEMENTWISE[name], torch.randn(3, 4, 3)
    padded = torch.cat([x, 100 * torch.randn(5, 4, 3)])
    torch.testing.assert_close(fn(padded)[:3], fn(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["hardswish", "prelu_channels", "silu", "erfcx_by_tag"])
def test_elementwise_graphs_run_padded_and_equal_eager(name):
    op = ELEMENTWISE[name]

    def fn(x):
        return op(_split(x.reshape(x.shape[0], 12)).reshape(x.shape[0], 4, 3) - 0.5)

    compiled, backend = _compile(fn)
    for n in (3, 5):
        x = torch.randn(n, 4, 3)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), fn(x))
        assert backend.runtimes[-1].step.size == {3: 4, 5: 8}[n]
    assert all(p.padding_unsafe is None for p in backend.pieces)


# name -> (function of x: [n, 4, 3], what the hazard says)
NOT_ELEMENTWISE = {
    "softmin_rows": (lambda x: F.softmin(x, 0), "softmin decomposes into aten._softmax.default, and _softmax mixes rows"),
    "rand_like": (lambda x: x + torch.rand_like(x), "rand_like draws random numbers"),
    "dropout_training": (lambda x: F.dropout(x, 0.5, training=True), "dropout decomposes into"),
    "rrelu_training": (lambda x: F.rrelu(x, training=True), "draws random numbers"),
    "local_response_norm_rows": (lambda x: F.local_response_norm(x.transpose(0, 1), 2), "local_response_norm decomposes"),
}


@pytest.mark.parametrize("name", NOT_ELEMENTWISE)
def test_ops_that_mix_rows_or_draw_randoms_are_refused(name):
    fn, expected = NOT_ELEMENTWISE[name]
    hazards = _hazards_of(fn, (5, 4, 3))
    assert any(expected in h and h.endswith("[padding_unsafe]") for h in hazards), hazards


def test_softmin_along_other_dims_is_proven():
    assert _hazards_of(lambda x: F.softmin(x, 1), (5, 4, 3)) == []
