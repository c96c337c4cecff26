"""The mask-conversion pass: one float mask per boolean SDPA mask, and the same results."""

import pytest
import torch
import torch.nn.functional as F

from cgcompile.passes import hoist_mask_conversion
from cgcompile.passes.attention_mask import additive_attention_mask
from cgcompile.testing.fx import traced


def attention_inputs(length: int, dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8, dtype=dtype)
    k, v = torch.randn(2, 4, length, 8, dtype=dtype), torch.randn(2, 4, length, 8, dtype=dtype)
    mask = torch.rand(2, 1, 3, length) > 0.3
    mask[..., 0] = True  # no fully masked row
    return q, k, v, mask


@pytest.mark.parametrize("length", [7, 16, 37])
def test_converted_mask_gives_what_sdpa_computes_with_the_boolean_one(length):
    q, k, v, mask = attention_inputs(length)
    converted = additive_attention_mask(mask, q.dtype)
    assert converted.shape == mask.shape and converted.dtype == q.dtype
    assert converted.stride(-2) % 16 == 0  # rows aligned for the memory-efficient kernel
    assert torch.equal(converted == 0, mask) and torch.isneginf(converted[~mask]).all()
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=converted),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_broadcast_dimensions_stay_broadcast():
    q, k, v, mask = attention_inputs(37)
    expanded = mask[:, :1].expand(2, 4, 3, 37)  # over heads, as transformers' masks are
    converted = additive_attention_mask(expanded, q.dtype)
    assert converted.shape == expanded.shape and converted.stride(1) == 0
    assert converted.stride(-2) % 16 == 0
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=converted),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=expanded))


def layers(q, k, v, mask):
    out = q
    for _ in range(3):  # three "layers" share one mask, as a transformer's do
        out = F.scaled_dot_product_attention(out, k, v, attn_mask=mask) * 1.5
    return out


def sdpa_masks(gm):
    calls = [n for n in gm.graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    return [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in calls]


def test_one_conversion_serves_every_layer_and_results_stay_bit_equal():
    q, k, v, mask = attention_inputs(37)
    gm = traced(layers, q, k, v, mask)
    assert hoist_mask_conversion(gm) == 1
    converted = [n for n in gm.graph.nodes if n.target is additive_attention_mask]
    assert len(converted) == 1 and sdpa_masks(gm) == converted * 3
    assert converted[0].meta["example_value"].dtype == torch.float32
    assert torch.equal(gm(q, k, v, mask)[0], layers(q, k, v, mask))


def test_float_masks_and_calls_without_a_mask_are_left_alone():
    q, k, v, mask = attention_inputs(7)
    float_mask = additive_attention_mask(mask, q.dtype)
    gm = traced(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m) + F.scaled_dot_product_attention(q, k, v), q, k, v, float_mask)
    code = gm.code
    assert hoist_mask_conversion(gm) == 0
    assert gm.code == code


def test_queries_of_two_dtypes_get_a_conversion_each():
    q, k, v, mask = attention_inputs(7)

    def two_dtypes(q, k, v, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        return a, b

    gm = traced(two_dtypes, q, k, v, mask)
    assert hoist_mask_conversion(gm) == 2
    got, want = gm(q, k, v, mask), two_dtypes(q, k, v, mask)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
