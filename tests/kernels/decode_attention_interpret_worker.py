"""The decode attention kernels under Triton's interpreter, on the CPU (run by
tests/kernels/test_decode_attention.py with TRITON_INTERPRET=1): every path of the kernels
(one split and several, bool and additive masks and none, blocks every row masks out, rows
every position masks out, grouped heads, several tokens, head dims that are not powers of
two, strided queries, NaN where no row looks, the grouped layout, outputs laid out in a
given dim order) against float64 SDPA over repeated keys and values. In float16 only: the
interpreter's tl.dot multiplies bfloat16 operands as raw integers (Triton 3.9), so bfloat16
is checked on the GPU (test_decode_attention.py)."""

import os

import torch
import torch.nn.functional as F

from cgcompile.kernels.decode_attention import BLOCK_L, decode_attention_kernel_call
from cgcompile.passes.small_query import grouped_layout, in_dim_order


def reference(q, k, v, mask, scale):
    groups = q.shape[-3] // k.shape[-3]
    k, v = (t.double().repeat_interleave(groups, dim=-3) for t in (k, v))
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    out = F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale)
    if mask is not None:  # rows every position masks out: zeros (SDPA's math path gives NaN)
        hidden = (mask if mask.dtype == torch.bool else mask > float("-inf")).logical_not().all(-1, keepdim=True)
        out = out.masked_fill(hidden.expand(out.shape[:-1] + (1,)), 0.0)
    return out


def case(gen, dtype, batch, key_heads, group, tokens, length, head_dim, value_dim, mask_kind, chunk, strided_query,
         grouped=False, dim_order=None, heads_outer=False):
    heads = key_heads * group
    if strided_query:  # [B, T, H, D] transposed, as a model's projection makes it
        q = torch.randn(batch, tokens, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(batch, heads, tokens, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, key_heads, length, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, key_heads, length, value_dim, generator=gen).to(dtype)
    mask = None
    if mask_kind == "bool":  # a static cache: the first positions only, less for some rows
        mask = torch.zeros(batch, 1, tokens, length, dtype=torch.bool)
        mask[..., : max(1, length // 3)] = True
        mask[..., -1, : max(1, length // 3) - 1] = True
        mask[0, 0, 0] = False  # batch 0's first token sees nothing
    elif mask_kind == "float":
        mask = torch.randn(1, heads, tokens, length, generator=gen).to(dtype)
        mask[..., length // 2:] = float("-inf")
    scale = 0.3 if head_dim % 2 else None
    want = reference(q, k, v, mask, scale)
    if mask_kind == "bool":  # what no row may read: NaN would reach the output if read
        k, v = k.clone(), v.clone()
        k[:, :, max(1, length // 3):] = float("nan")
        v[:, :, max(1, length // 3):] = float("nan")
    got = decode_attention_kernel_call(q, k, v, mask, head_dim ** -0.5 if scale is None else scale, chunk, grouped,
                                       dim_order, heads_outer)
    if dim_order is not None:  # written in the layout in_dim_order makes, as the op's fake promises
        expected_strides = in_dim_order(want, dim_order).stride()
        assert got.stride() == expected_strides, (got.stride(), expected_strides)
    if grouped:  # [B, Hk, G, Dv], rows outer or heads outer: the layout grouped_layout makes of want
        expected_strides = grouped_layout(want, key_heads, heads_outer).stride()
        assert got.stride() == expected_strides, (got.stride(), expected_strides)
        got = got.reshape(batch, heads, 1, value_dim)
    assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    gen = torch.Generator().manual_seed(0)
    cases = [
        # dtype, batch, key heads, group, tokens, length, head dim, value dim, mask, chunk, strided query[, grouped,
        # dim order, heads outer]
        (torch.float16, 1, 2, 2, 1, 200, 32, 32, "bool", None, True),  # several splits, the last partial
        (torch.float16, 2, 1, 4, 1, 70, 16, 16, None, None, False),
        (torch.float16, 2, 2, 1, 3, 130, 24, 40, "float", BLOCK_L, False),  # dims not powers of two
        (torch.float16, 1, 1, 8, 2, 50, 16, 16, "bool", 4 * BLOCK_L, True),  # one split: no combine
        (torch.float16, 1, 2, 2, 1, 300, 16, 16, "bool", BLOCK_L, False),  # splits every row masks out
        (torch.float16, 2, 2, 4, 1, 150, 32, 32, "bool", None, True, True),  # grouped layout, several splits
        (torch.float16, 2, 3, 2, 1, 40, 16, 24, "float", None, False, True),  # grouped layout, one split
        (torch.float16, 1, 2, 4, 1, 150, 32, 32, "bool", None, True, True, None, True),  # heads outer, several splits
        (torch.float16, 1, 3, 2, 1, 40, 16, 24, "float", None, False, True, None, True),  # heads outer, one split
        (torch.float16, 2, 2, 2, 3, 150, 16, 16, "bool", None, True, False, (0, 2, 1, 3)),  # [B, T, H, D] in memory
        (torch.float16, 1, 2, 4, 2, 60, 16, 16, None, BLOCK_L, False, False, (2, 0, 1, 3)),  # [T, B, H, D]
    ]
    for args in cases:
        case(gen, *args)
    print("decode_attention interpreted: ok")


if __name__ == "__main__":
    main()
