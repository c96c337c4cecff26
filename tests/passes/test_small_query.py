"""passes.small_query: attention of a few query rows as batched matmuls, against SDPA itself."""

import copy

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.errors import ConfigError
from cgcompile.kernels.decode_attention import attention_with_kernel
from cgcompile.passes import lower_small_query_attention
from cgcompile.passes.small_query import (grouped_small_query_attention, in_dim_order, small_query_attention,
                                          traced_dim_order)
from cgcompile.passes.sdpa import grouped_query_attention
from cgcompile.testing.models import StaticCacheDecoder


def repeated(x, groups):  # [B, Hk, L, D] -> [B, Hk*G, L, D], each key head G times in a row
    return x.repeat_interleave(groups, dim=1)


@pytest.mark.parametrize("seed", range(12))
def test_equals_sdpa_on_random_shapes_masks_and_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[torch.randint(len(options), (1,), generator=gen).item()]  # noqa: E731
    batch, key_heads, groups, rows = pick([1, 3]), pick([1, 2, 4]), pick([1, 2, 4]), pick([1, 2, 5, 16])
    length, head_dim = pick([1, 7, 64]), pick([8, 16])
    heads = key_heads * groups
    q = torch.randn(batch, heads, rows, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, key_heads, length, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, key_heads, length, head_dim, generator=gen, dtype=torch.float64)
    mask = pick([None, "bool", "float"])
    if mask == "bool":  # every row keeps at least its first key
        mask = torch.rand(batch, 1, rows, length, generator=gen) < 0.7
        mask[..., 0] = True
    elif mask == "float":
        mask = torch.randn(1, heads, rows, length, generator=gen, dtype=torch.float64)
    scale = pick([None, 0.3])
    expected = F.scaled_dot_product_attention(q, repeated(k, groups), repeated(v, groups), attn_mask=mask, scale=scale)
    got = small_query_attention(q, k, v, mask, scale)
    assert got.dtype == q.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # float32 inside: rounding only


def test_equals_sdpa_without_a_batch_dimension():
    q, k, v = torch.randn(4, 3, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 8)  # [H, T, D], [Hk, L, D]
    expected = F.scaled_dot_product_attention(q, repeated(k[None], 2)[0], repeated(v[None], 2)[0])
    torch.testing.assert_close(small_query_attention(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_a_row_every_key_masks_out_gives_zeros():
    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    mask[0, 0, 1] = False  # row 1 sees nothing
    got = small_query_attention(q, k, v, mask)
    assert torch.equal(got[:, :, 1], torch.zeros(1, 2, 8))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))  # SDPA: zeros too


def test_a_nan_input_stays_nan():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    k[0, 0, 3, 0] = float("nan")
    got = small_query_attention(q, k, v, torch.ones(1, 1, 1, 5, dtype=torch.bool))
    assert got[0, 0].isnan().all() and not got[0, 1].isnan().any()


def test_bfloat16_error_is_of_the_order_of_sdpas():  # rounded as Hugging Face's eager attention rounds
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1, 64, dtype=torch.bfloat16) for _ in range(3))
    k, v = torch.randn(2, 8, 300, 64, dtype=torch.bfloat16), torch.randn(2, 8, 300, 64, dtype=torch.bfloat16)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    ours = (small_query_attention(q, k, v).double() - exact).abs().max()
    sdpa = (F.scaled_dot_product_attention(q, k, v).double() - exact).abs().max()
    assert ours <= 2 * sdpa + 1e-3, (ours, sdpa)


def test_grouped_form_keeps_grouped_query_attentions_contract():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.rand(2, 1, 1, 9) < 0.8
    mask[..., 0] = True
    expected = grouped_query_attention(q, k, v, attn_mask=mask)
    got = grouped_small_query_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.shape == expected.shape == (2, 2, 4, 16)
    assert got.transpose(1, 2).is_contiguous()  # rows outer in memory, as grouped_query_attention returns


def dynamo_graph(fn, *args, **dynamo):
    """The FX graph Dynamo captures for fn(*args)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(fn, backend=keep, **dynamo)(*args)
    (gm,) = graphs
    return gm


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


def test_the_pass_rewrites_few_query_rows_and_leaves_prefill_alone():
    k, v = torch.randn(1, 4, 32, 8), torch.randn(1, 4, 32, 8)
    mask = torch.ones(1, 1, 1, 32, dtype=torch.bool)
    decode = torch.randn(1, 4, 1, 8)
    gm = dynamo_graph(attend, decode, k, v, mask)
    assert lower_small_query_attention(gm) == 1
    torch.testing.assert_close(gm(decode, k, v, mask)[0], attend(decode, k, v, mask))
    prefill = torch.randn(1, 4, 17, 8)  # 17 rows > 16
    gm = dynamo_graph(attend, prefill, k, v, torch.ones(1, 1, 17, 32, dtype=torch.bool))
    assert lower_small_query_attention(gm) == 0


def test_the_pass_keeps_sdpas_traced_layout():
    """SDPA's output here is laid out as its query is, [B, T, H, D] in memory; the lowered
    form returns the same strides, so nothing after it sees another layout."""
    k, v = torch.randn(2, 4, 32, 8), torch.randn(2, 4, 32, 8)
    q = torch.randn(2, 3, 4, 8).transpose(1, 2)  # [B, H, T, D], rows outer in memory
    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert lower_small_query_attention(gm) == 1
    (node,) = [n for n in gm.graph.nodes if n.target is small_query_attention]
    assert node.kwargs["dim_order"] == (0, 2, 1, 3)
    (got,) = gm(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert got.stride() == expected.stride() == (96, 8, 32, 1)
    torch.testing.assert_close(got, expected)


def test_traced_dim_order_reads_only_layouts_other_than_the_contiguous_one():
    assert traced_dim_order(torch.empty(2, 4, 3, 8)) is None
    assert traced_dim_order(torch.empty(2, 1, 4, 8).transpose(1, 2)) is None  # [B, H, 1, D]: contiguous all the same
    assert traced_dim_order(torch.empty(2, 3, 4, 8).transpose(1, 2)) == (0, 2, 1, 3)
    assert traced_dim_order(torch.empty(1, 3, 4, 8).transpose(1, 2)) == (0, 2, 1, 3)  # size-1 dims first
    assert traced_dim_order(torch.empty(3, 2, 4, 8).permute(1, 2, 0, 3)) == (2, 0, 1, 3)
    x = torch.randn(3, 2, 4, 8).permute(1, 2, 0, 3)
    laid_out = in_dim_order(x.contiguous(), traced_dim_order(x))
    assert laid_out.stride() == x.stride() and torch.equal(laid_out, x)


@pytest.mark.parametrize("call", [
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5),
])
def test_the_pass_leaves_causal_and_dropout_calls_alone(call):
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    assert lower_small_query_attention(dynamo_graph(call, q, k, v)) == 0


def test_the_pass_leaves_a_symbolic_row_count_alone():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    torch._dynamo.mark_dynamic(q, 2)
    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert lower_small_query_attention(gm) == 0


def test_small_query_attention_needs_inductor():
    with pytest.raises(ConfigError, match='small_query_attention: expected compiler="inductor" or full_graph_comp'):
        cgcompile.Config(compiler="eager", capturable_split_ops=("attention",), small_query_attention=True)
    cgcompile.Config(compiler="eager", capturable_split_ops=("attention",), small_query_attention=True,
                     full_graph_compile=True)  # compiled whole


@pytest.mark.parametrize("whole, compiler", [(True, "inductor"), (False, "inductor"), (True, "eager")])
@torch.no_grad()
def test_full_graphs_with_small_query_attention_equal_eager(whole, compiler):
    """whole: lowered inside the whole-graph compile; else the eager attention pieces are
    compiled, lowered, for the full graph: the two layers' pieces share one compile."""
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    calls = [(torch.arange(1, 5), torch.arange(4))] + [(torch.tensor([s]), torch.tensor([4 + s])) for s in range(5)]
    reference = copy.deepcopy(model)
    expected = [reference(*c).clone() for c in calls]
    config = cgcompile.Config(compiler=compiler, capturable_split_ops=("attention",), full_graph_compile=whole,
                              small_query_attention=True)
    backend = cgcompile.Backend(config)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    for step, (c, e) in enumerate(zip(calls, expected)):
        torch.testing.assert_close(compiled(*c), e, rtol=1e-5, atol=1e-5, msg=lambda m: f"call {step}: {m}")
    assert backend.stats.full_graph_calls == 4 and backend.stats.full_graph_compilations == 1
    if whole:
        decode = backend.runtimes[-1].full.code
        # Both layers, to the kernel's form (Config.decode_attention_kernel), which runs the
        # matmuls on the CPU.
        assert sum(n.target is attention_with_kernel for n in decode.gm.graph.nodes) == 2
    # The piecewise calls (each graph's first) ran SDPA as it was: nothing lowered there.
    assert all(n.target not in (small_query_attention, attention_with_kernel)
               for p in backend.pieces for n in p.graph.graph.nodes)


class FewQueryRows(torch.nn.Module):
    """Attention of T query rows laid out as a projection makes them, [B, T, H, D] in memory,
    over a fixed cache: SDPA's traced output has that layout too."""

    def __init__(self):
        super().__init__()
        self.q, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.register_buffer("k", torch.randn(1, 4, 16, 8))
        self.register_buffer("v", torch.randn(1, 4, 16, 8))

    def forward(self, x):  # x: [B, T, 32]
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)  # [B, H, T, D]
        out = F.scaled_dot_product_attention(q, self.k.expand(b, -1, -1, -1), self.v.expand(b, -1, -1, -1))
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


@torch.no_grad()
def test_a_lowered_attention_piece_hands_the_next_piece_its_traced_layout():
    """The attention piece's output reaches the piece after it in the layout that piece was
    traced with: nothing is copied at the boundary (before, one copy a call)."""
    torch.manual_seed(0)
    model = FewQueryRows().eval()
    config = cgcompile.Config(compiler="inductor", capturable_split_ops=("attention",), full_graph_compile=False,
                              small_query_attention=True)
    backend = cgcompile.Backend(config)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(2, 4, 32)
    for call in range(4):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5, msg=lambda m: f"call {call}: {m}")
    assert backend.stats.full_graph_calls == 3
    assert backend.stats.layout_copies == 0


def test_eager_piece_compiles_are_shared_by_shape_and_aliasing(monkeypatch):
    from cgcompile.build.compiler import EagerPieceCompiles

    compiled = []

    def compile_as_fx(gm, args, options):
        compiled.append(tuple(a.shape for a in args))
        return gm

    monkeypatch.setattr("cgcompile.build.compiler.inductor_compile", compile_as_fx)
    mask = torch.ones(1, 1, 1, 32, dtype=torch.bool)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 32, 8), torch.randn(1, 4, 32, 8)
    compiles = EagerPieceCompiles({}, cudnn_attention=True)
    piece = compiles.for_piece(dynamo_graph(attend, q, k, v, mask))
    assert compiles.for_piece(dynamo_graph(lambda x: x * 2, q)) is None  # no attention: runs as it is
    for _ in range(2):  # another layer: other tensors, the same shapes
        torch.testing.assert_close(piece(q, k.clone(), v.clone(), mask)[0], attend(q, k, v, mask))
    piece(q, k, k, mask)  # keys and values one tensor: another compile
    piece(torch.randn(1, 4, 2, 8), k, v, torch.ones(1, 1, 2, 32, dtype=torch.bool))  # two query rows
    assert len(compiled) == compiles.compiles.compilations == 3
