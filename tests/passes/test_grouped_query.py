"""The grouped-query fold: one-token SDPA over repeated KV heads reads the un-repeated cache."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.passes import fold_grouped_query_attention
from cgcompile.passes.sdpa import grouped_query_attention
from cgcompile.testing.fx import traced

KV_HEADS, GROUPS, HEAD_DIM, LENGTH = 2, 4, 16, 37


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' repeat_kv: each KV head copied to the `groups` query heads that read it."""
    b, h, length, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


def attention(q, k, v, mask=None, **kwargs):
    out = F.scaled_dot_product_attention(q, repeat_kv(k, GROUPS), repeat_kv(v, GROUPS), attn_mask=mask, **kwargs)
    return out.transpose(1, 2) * 2


def inputs(query_len: int = 1, batch: int = 2):
    torch.manual_seed(0)
    q = torch.randn(batch, KV_HEADS * GROUPS, query_len, HEAD_DIM)
    k, v = (torch.randn(batch, KV_HEADS, LENGTH, HEAD_DIM) for _ in range(2))
    return q, k, v


def node_names(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def call_traced(gm, q, k, v, m=None):
    """Run a graph from `traced`: Dynamo orders its inputs by first use, not as passed."""
    by_name = {"L_q_": q, "L_k_": k, "L_v_": v, "L_m_": m}
    return gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))[0]


def boolean_mask(*shape):
    mask = torch.rand(*shape) > 0.3
    mask[..., 0] = True  # no fully masked row
    return mask


MASKS = {
    "none": lambda: None,
    "boolean, broadcast over heads": lambda: boolean_mask(2, 1, 1, LENGTH),
    "float, one per head": lambda: torch.randn(2, KV_HEADS * GROUPS, 1, LENGTH),
    "boolean, 2-d": lambda: boolean_mask(1, LENGTH),
}


@pytest.mark.parametrize("mask", MASKS)
def test_fold_removes_the_repeats_and_keeps_the_results(mask):
    q, k, v = inputs()
    m = MASKS[mask]()
    args = (q, k, v) if m is None else (q, k, v, m)
    gm = traced(lambda q, k, v, m=None: attention(q, k, v, m), *args)
    assert node_names(gm).count("reshape") == 2
    assert fold_grouped_query_attention(gm) == 1
    names = node_names(gm)
    assert "expand" not in names and "reshape" not in names
    assert names.count("flatten") == 1  # back to one row per query head
    assert "scaled_dot_product_attention" not in names
    grouped = next(n for n in gm.graph.nodes if n.target is grouped_query_attention)
    assert [a.meta["example_value"].shape[1] for a in grouped.args[1:3]] == [KV_HEADS, KV_HEADS]  # the cache itself
    assert grouped.meta["example_value"].shape == (2, KV_HEADS, GROUPS, HEAD_DIM)  # query heads as rows
    expected = attention(*args)
    torch.testing.assert_close(call_traced(gm, *args), expected, rtol=1e-5, atol=1e-6)


def test_fold_with_a_symbolic_cache_length_and_scale():
    q, k, v = inputs()
    mask = boolean_mask(2, 1, 1, LENGTH)
    for t in (k, v, mask):
        torch._dynamo.mark_dynamic(t, t.dim() - 2 if t is not mask else 3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        assert fold_grouped_query_attention(gm) == 1
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, m: attention(q, k, v, m, scale=0.3), backend=backend)
    torch.testing.assert_close(compiled(q, k, v, mask), attention(q, k, v, mask, scale=0.3), rtol=1e-5, atol=1e-6)
    longer = [torch.cat([t, t[..., :5, :] if t is not mask else t[..., :5]], dim=-2 if t is not mask else -1) for t in (k, v, mask)]
    torch.testing.assert_close(compiled(q, *longer), attention(q, *longer, scale=0.3), rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1  # the longer cache ran the same folded graph


def shared_repeat(q, k, v):
    keys = repeat_kv(k, GROUPS)
    return F.scaled_dot_product_attention(q, keys, repeat_kv(v, GROUPS)) + keys.sum()


@pytest.mark.parametrize(
    "case, fn, query_len",
    [
        ("a query of two tokens", attention, 2),
        ("causal", lambda q, k, v: attention(q, k, v, is_causal=True), 1),
        ("the repeat has another user", lambda q, k, v: shared_repeat(q, k, v), 1),
        ("keys and values repeated differently", lambda q, k, v: F.scaled_dot_product_attention(
            q, repeat_kv(torch.cat([k, k], dim=1), GROUPS // 2), repeat_kv(v, GROUPS)), 1),
    ],
)
def test_calls_that_cannot_be_folded_are_left_alone(case, fn, query_len):
    q, k, v = inputs(query_len)
    gm = traced(fn, q, k, v)
    code = gm.code
    assert fold_grouped_query_attention(gm) == 0, case
    assert gm.code == code


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_the_backend_folds_by_default_and_the_config_turns_it_off(compiler):
    # With Inductor, the piece after attention is compiled against the folded call's
    # example value: its layout must be the one SDPA really returns.
    q, k, v = inputs()
    mask = boolean_mask(2, 1, 1, LENGTH)
    expected = attention(q, k, v, mask)
    for fold in (True, False):
        torch._dynamo.reset()
        backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, fold_grouped_query=fold))
        out = torch.compile(attention, backend=backend)(q, k, v, mask)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        names = {name for piece in backend.pieces for name in node_names(piece.graph)}
        assert ("reshape" in names) is not fold


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_attention_on_cuda_matches_eager(dtype):
    # On CUDA with a mask, SDPA takes the memory-efficient kernel with G query rows per
    # KV head (and the boolean mask converted by cgcompile); eager repeats the cache. The
    # Inductor piece after it reads the kernel's layout (rows head-minor) as compiled for.
    q, k, v = (t.to("cuda", dtype) for t in inputs(batch=2))
    mask = boolean_mask(2, 1, 1, LENGTH).cuda()
    torch._dynamo.reset()
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor"))
    out = torch.compile(attention, backend=backend)(q, k, v, mask)
    assert not any({"expand", "reshape"} & set(node_names(p.graph)) for p in backend.pieces)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, attention(q, k, v, mask), **tolerance)


@pytest.mark.parametrize("backend", ["math", "default"])
def test_result_layout_does_not_depend_on_the_kernel(backend):
    # Compiled pieces after the call are compiled for one layout: rows outer, whatever
    # kernel SDPA picks (the math kernel returns heads outer, and is copied).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = inputs()
    mask = boolean_mask(2, 1, 1, LENGTH)
    context = sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext()
    with context:
        out = grouped_query_attention(q, k, v, attn_mask=mask)
    assert out.shape == (2, KV_HEADS, GROUPS, HEAD_DIM) and out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.unsqueeze(3).flatten(1, 2).transpose(1, 2) * 2, attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_piece_after_the_fold_survives_a_kernel_change_on_cuda():
    # Compiled (no CUDA graphs, so the Inductor code reads the result itself) while SDPA
    # picks the memory-efficient kernel (rows outer); run with only the math kernel
    # allowed (heads outer): the call copies into its one layout, and Inductor's
    # stride check on its input passes.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to("cuda", torch.bfloat16) for t in inputs(batch=2))
    mask = boolean_mask(2, 1, 1, LENGTH).cuda()
    torch._dynamo.reset()
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", cudagraphs=False))
    compiled = torch.compile(attention, backend=backend)
    expected = attention(q, k, v, mask)
    torch.testing.assert_close(compiled(q, k, v, mask), expected, rtol=2e-2, atol=2e-2)
    with sdpa_kernel(SDPBackend.MATH):
        torch.testing.assert_close(compiled(q, k, v, mask), expected, rtol=2e-2, atol=2e-2)
    assert backend.stats.graphs_seen == 1


ONE_SEQUENCE_MASKS = {
    "none": lambda: None,
    "boolean, broadcast over heads": lambda: boolean_mask(1, 1, 1, LENGTH),
    "float, one per head": lambda: torch.randn(1, KV_HEADS * GROUPS, 1, LENGTH),
    "float, one per head, 3-d": lambda: torch.randn(KV_HEADS * GROUPS, 1, LENGTH),
    "boolean, 2-d": lambda: boolean_mask(1, LENGTH),
}


@pytest.mark.parametrize("mask", ONE_SEQUENCE_MASKS)
def test_a_batch_of_one_folds_to_the_heads_in_order_and_unflattens_by_a_view(mask):
    q, k, v = inputs(batch=1)
    m = ONE_SEQUENCE_MASKS[mask]()
    args = (q, k, v) if m is None else (q, k, v, m)
    gm = traced(lambda q, k, v, m=None: attention(q, k, v, m), *args)
    assert fold_grouped_query_attention(gm) == 1
    grouped = next(n for n in gm.graph.nodes if n.target is grouped_query_attention)
    assert grouped.kwargs["heads_outer"] is True
    result = grouped.meta["example_value"]
    assert result.shape == (1, KV_HEADS, GROUPS, HEAD_DIM) and result.is_contiguous()
    flat = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "flatten")
    assert flat.meta["example_value"].is_contiguous()  # the next piece reads it as it is: no copy
    torch.testing.assert_close(call_traced(gm, *args), attention(*args), rtol=1e-5, atol=1e-6)


def test_larger_batches_keep_the_rows_outer_layout():
    q, k, v = inputs(batch=2)
    gm = traced(lambda q, k, v: attention(q, k, v), q, k, v)
    assert fold_grouped_query_attention(gm) == 1
    grouped = next(n for n in gm.graph.nodes if n.target is grouped_query_attention)
    assert "heads_outer" not in grouped.kwargs
    with pytest.raises(ValueError, match="batch of one"):
        grouped_query_attention(q, k, v, heads_outer=True)


@pytest.mark.parametrize("backend", ["math", "default"])
def test_heads_outer_layout_does_not_depend_on_the_kernel(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = inputs(batch=1)
    mask = torch.randn(1, KV_HEADS * GROUPS, 1, LENGTH)
    context = sdpa_kernel(SDPBackend.MATH) if backend == "math" else contextlib.nullcontext()
    with context:
        out = grouped_query_attention(q, k, v, attn_mask=mask, heads_outer=True)
    assert out.shape == (1, KV_HEADS, GROUPS, HEAD_DIM) and out.is_contiguous()
    torch.testing.assert_close(out.unsqueeze(3).flatten(1, 2).transpose(1, 2) * 2, attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-6)
