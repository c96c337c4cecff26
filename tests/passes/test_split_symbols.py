"""Size symbols across a split: every piece gets each symbol its code needs as an input.

After a split op, a piece may see only tensors sized by an expression of the dynamic
size (2*s, 16*s, s+4). A compiler cannot recover s from those, so the split must hand
s over itself; Inductor otherwise stops with "expected [s] to have been codegen-ed".
"""

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import cgcompile
from cgcompile.run.recovery import Uncapturable, split_at_node
from cgcompile.passes import SplitReason, example_value, split_graph
from cgcompile.testing.models import SILLY_OP

silly = torch.ops.cgcompile_testing.silly_attention


def _after_silly(z):
    y = silly(z, z, z)
    return (y * 2).sin()


# name -> (model of x, trailing dims of x); the piece after the split op sees only the
# expression-sized tensor.
MODELS = {
    "repeat_2s": (lambda x: _after_silly(x.cos().repeat_interleave(2, 0)).view(-1, 2, 8).sum(1), (8,)),
    "flatten_16s": (lambda x: _after_silly(x.cos().flatten(0, 1)), (16, 4)),
    "pad_s_plus_4": (lambda x: _after_silly(F.pad(x.cos(), (0, 0, 0, 4))), (8,)),
}
SIZES = (3, 5, 3, 8)


def _input(n: int, trailing: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(n, *trailing)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def _plain_symbols(values) -> set:
    """Symbols a compiler binds from inputs: SymInts and tensor dims that are a symbol."""
    found = set()
    for value in values:
        sizes = value.shape if isinstance(value, torch.Tensor) else [value]
        found |= {s.node.expr for s in sizes if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol)}
    return found


def _symbols_in(value) -> set:
    if isinstance(value, (tuple, list)):
        return {s for v in value for s in _symbols_in(v)}
    if isinstance(value, torch.Tensor):
        return {s for size in (*value.shape, *value.stride()) for s in _symbols_in(size)}
    return set(value.node.expr.free_symbols) if isinstance(value, torch.SymInt) else set()


def _unbound_symbols(gm: torch.fx.GraphModule) -> set:
    """Symbols in the values of `gm`'s nodes that no placeholder carries as such and no
    node of `gm` binds (an unbacked size from `.item()`)."""
    placeholders = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    used = {s for n in gm.graph.nodes for s in _symbols_in(example_value(n))}
    bound = {s for n in gm.graph.nodes for s in n.meta.get("unbacked_bindings", {})}
    return used - _plain_symbols(placeholders) - bound


def _needed_a_size_input(gm: torch.fx.GraphModule) -> bool:
    """Whether the symbol reaches the piece only as a SymInt: no tensor input has it as a dim."""
    values = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = _plain_symbols(v for v in values if isinstance(v, torch.Tensor))
    return bool(_plain_symbols(values) - tensors)


@pytest.mark.parametrize("name", MODELS)
def test_pieces_after_an_expression_sized_cut_compile_with_inductor(name):
    fn, trailing = MODELS[name]
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", splitting_ops=[SILLY_OP]))
    compiled = torch.compile(fn, backend=backend)
    for n in SIZES:
        x = _input(n, trailing)
        torch.testing.assert_close(compiled(x), fn(x))
    assert backend.stats.graphs_seen == 1  # one dynamic graph for every size
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    assert all(_unbound_symbols(p.graph) == set() for p in backend.pieces)
    assert _needed_a_size_input(backend.pieces[2].graph)  # the case this file is about


@pytest.mark.parametrize("name", MODELS)
def test_padding_still_runs_pieces_with_a_size_input(name):
    fn, trailing = MODELS[name]
    config = cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], padding=True, capture_sizes=(1, 2, 4, 8))
    backend = cgcompile.Backend(config)
    compiled = torch.compile(fn, backend=backend)
    for n in SIZES:
        x = _input(n, trailing)
        torch.testing.assert_close(compiled(x), fn(x))
    # An expression of the capture dimension cannot be padded: exact sizes, as before.
    assert backend.pieces[0].sizes.startswith("exact sizes: ")


def test_padded_piece_takes_the_capture_size_as_a_size_input():
    # The piece after the cut reads the size as a shape from a SymInt input: padding
    # hands it the padded size (`piece_layout`'s size inputs), as the tensors' rows.
    def fn(x):
        y = silly(x, x, x)
        return torch.relu(y * 2) + torch.zeros(y.shape[0], 8)

    config = cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], padding=True, capture_sizes=(1, 2, 4, 8))
    backend = cgcompile.Backend(config)
    compiled = torch.compile(fn, backend=backend)
    for n in SIZES:
        x = _input(n, (8,))
        torch.testing.assert_close(compiled(x), fn(x))
    last = backend.pieces[-1]
    assert last.sizes == "padded to the capture sizes"
    assert any(isinstance(example_value(n), torch.SymInt) for n in last.graph.graph.nodes if n.op == "placeholder")
    assert all(_unbound_symbols(p.graph) == set() for p in backend.pieces)


def test_compile_sizes_specialise_a_piece_through_its_size_input():
    fn, trailing = MODELS["repeat_2s"]
    config = cgcompile.Config(compiler="inductor", splitting_ops=[SILLY_OP], compile_sizes=(8,))
    backend = cgcompile.Backend(config)
    compiled = torch.compile(fn, backend=backend)
    for n in SIZES:
        x = _input(n, trailing)
        torch.testing.assert_close(compiled(x), fn(x))
    # Both capturable pieces: the second is routed by its SymInt, having no plain dim.
    assert backend.stats.specialised_compilations == 2


# -- split_graph itself, on graphs without SymInt placeholders ---------------------------------


def _traced(fn, trailing):
    """An ATen graph with symbolic sizes and no SymInt placeholder (make_fx lifts none)."""
    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(5, *trailing))
    assert not any(isinstance(example_value(n), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")
    return gm


def _split_at_silly(gm):
    reason = SplitReason("split_op", "silly attention", "silly")
    eager = {n: reason for n in gm.graph.nodes if n.target in (silly, silly.default)}
    return split_graph(gm, eager)


@pytest.mark.parametrize("name", MODELS)
def test_every_piece_of_split_graph_carries_its_symbols(name):
    fn, trailing = MODELS[name]
    split = _split_at_silly(_traced(fn, trailing))
    assert [p.capturable for p in split.pieces] == [True, False, True]
    for piece in split.pieces:
        assert _unbound_symbols(piece.graph) == set(), (piece.name, piece.graph.code)
        assert len(piece.inputs) == len([n for n in piece.graph.graph.nodes if n.op == "placeholder"])
    assert _needed_a_size_input(split.pieces[2].graph)
    for n in SIZES:  # the stitching graph reads the size from the input that has it
        x = torch.randn(n, *trailing)
        torch.testing.assert_close(split.stitch(x), fn(x))


def test_a_piece_split_again_hands_its_symbols_on():
    # capture_recovery splits a piece's own graph: its placeholders are the piece's inputs.
    fn, trailing = MODELS["repeat_2s"]
    piece = _split_at_silly(_traced(fn, trailing)).pieces[2]
    sin = next(n for n in piece.graph.graph.nodes if n.target is torch.ops.aten.sin.default)
    sub = split_at_node(piece.graph, Uncapturable(sin, "RuntimeError: not capturable"))
    assert [p.capturable for p in sub.pieces] == [True, False, True]
    for inner in sub.pieces:
        assert _unbound_symbols(inner.graph) == set(), (inner.name, inner.graph.code)
    for n in SIZES:
        args = (torch.randn(2 * n, 8), n)
        torch.testing.assert_close(sub.stitch(*args), piece.graph(*args))


def test_an_unbacked_size_is_handed_from_the_piece_that_binds_it():
    # u0 comes from .item() in the first eager piece; a later eager piece holds only a
    # tensor of 2*u0 rows, and gets u0 from the first piece's outputs.
    def fn(x, k):
        n = (k.sum() % 3 + 1).item()
        torch._check(n >= 0)
        t = torch.ones(2 * n, 8) * k
        y = (x * 2).sin()
        return y.sum(0) + t.sum(0)

    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    compiled = torch.compile(fn, backend=backend)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for n in SIZES:
            x, k = _input(n, (8,)), torch.tensor([n])
            torch.testing.assert_close(compiled(x, k), fn(x, k))
    assert backend.stats.graphs_seen == 1
    assert [p.capturable for p in backend.pieces][-3:] == [True, False, True]
    assert all(_unbound_symbols(p.graph) == set() for p in backend.pieces)
    assert _needed_a_size_input(backend.pieces[-2].graph)


# -- a symbol that Dynamo replaced by another ---------------------------------------------------


def _two_sized_inputs(x, m):
    # x and m: [n, 8] from two sources; Dynamo makes a symbol for each and, since they
    # must be equal, replaces one by the other. The piece after the split sees only 4*s.
    y = silly(*(((x * m).cos().repeat_interleave(4, 0)),) * 3)
    return (y + 1).sin()


@pytest.mark.parametrize("order", ["x_first", "m_first"])
def test_a_replaced_symbol_is_handed_as_the_symbol_it_binds(order):
    # The SymInt Dynamo made for the replaced symbol reads as the other one but binds its
    # own in Inductor ("For 4*s43, expected [s43] to have been codegen-ed": DeBERTa-v2's
    # input_ids and attention_mask on the GPU split).
    fn = _two_sized_inputs if order == "x_first" else (lambda m, x: _two_sized_inputs(x, m))
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", splitting_ops=[SILLY_OP]))
    compiled = torch.compile(fn, backend=backend)
    for n in (3, 5):
        x, m = _input(n, (8,)), _input(n, (8,))
        torch.testing.assert_close(compiled(x, m), fn(x, m))
    for piece in backend.pieces:
        symints = [example_value(n) for n in piece.graph.graph.nodes
                   if n.op == "placeholder" and isinstance(example_value(n), torch.SymInt)]
        bound = {s.node._expr for s in symints} | _plain_symbols(
            example_value(n) for n in piece.graph.graph.nodes if n.op == "placeholder"
            and isinstance(example_value(n), torch.Tensor))
        used = {s for n in piece.graph.graph.nodes for s in _symbols_in(example_value(n))}
        assert used <= bound, (piece.name, piece.graph.code)


@pytest.mark.cuda
def test_deberta_v2_encoder_at_several_sizes_equals_eager():
    # On the GPU, DeBERTa's relative positions (CPU tensors) split it finely; a piece
    # then held only [4*s, 16, 16] and the SymInt of the symbol Dynamo had replaced.
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(
        vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        relative_attention=True, position_buckets=16, max_relative_positions=64, pos_att_type=["p2c", "c2p"])
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(config).cuda().eval()
    compiled = torch.compile(model.forward, backend=cgcompile.Backend(cgcompile.Config()))
    with torch.inference_mode():
        for n in (1, 3, 8, 1):
            ids = torch.randint(3, 512, (n, 16), device="cuda")
            mask = (torch.arange(16) < 16 - torch.arange(n)[:, None] % 16).long().cuda()  # right-padded
            got, expected = compiled(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask)
            torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-4)
