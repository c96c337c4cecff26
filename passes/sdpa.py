"""The attention calls cgcompile's passes and split rule recognise, in the forms graphs hold them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# SDPA's Python-level forms in Dynamo graphs.
SDPA_FUNCTIONS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)

# SDPA's parameters, in order; Dynamo passes some positionally, some by keyword.
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(call) -> dict | None:
    """An SDPA call node's arguments by parameter name, or None for a signature this
    torch does not have (nothing to rewrite safely)."""
    if len(call.args) > len(SDPA_PARAMETERS) or not set(call.kwargs) <= set(SDPA_PARAMETERS):
        return None
    return dict(zip(SDPA_PARAMETERS, call.args)) | dict(call.kwargs)


def grouped_query_attention(query, key, value, attn_mask=None, scale=None, heads_outer=False):
    """SDPA of a one-token query [B, Hkv*G, 1, D] over un-repeated KV heads [B, Hkv, L, D],
    with the G query heads of each KV head as G query rows; returns [B, Hkv, G, D].

    `.unsqueeze(3).flatten(1, 2)` of the result is what SDPA over the keys and values
    repeated G times per head returns. A mask is either broadcast over heads or has one
    row per query head, viewed as [..., Hkv, G, L].

    The result's layout is fixed whichever kernel SDPA picks, so that compiled pieces that
    read it see one layout, at compile time (on fake tensors) and at run time:
      - rows outer ([B, G, Hkv, D] in memory), as the flash and memory-efficient kernels
        return it (another kernel's result is copied into that layout); the unflattening
        back to one row per query head is then a copy;
      - with `heads_outer` (a batch of one), contiguous: each KV head is a batch entry of
        one head whose G query rows SDPA attends, so every kernel returns the heads in
        order, and the unflattening is a view.
    """
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    per_head_mask = attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == heads != 1
    if heads_outer:
        if batch != 1:
            raise ValueError(f"grouped_query_attention(heads_outer=True) takes a batch of one, not {batch}")
        if per_head_mask:
            attn_mask = attn_mask.reshape(kv_heads, 1, groups, attn_mask.shape[-1])
        out = F.scaled_dot_product_attention(
            query.reshape(kv_heads, 1, groups, head_dim), key.squeeze(0).unsqueeze(1), value.squeeze(0).unsqueeze(1),
            attn_mask=attn_mask, scale=scale)
        return out.reshape(1, kv_heads, groups, out.shape[-1]).contiguous()
    grouped = query.view(batch, kv_heads, groups, head_dim)
    if per_head_mask:
        attn_mask = attn_mask.unflatten(-3, (kv_heads, groups)).squeeze(-2)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attn_mask, scale=scale)
    rows_outer = out.transpose(1, 2)
    return out if rows_outer.is_contiguous() else rows_outer.contiguous().transpose(1, 2)


# Calls whose attn_mask is SDPA's (same position, same meaning) and that run as attention.
ATTENTION_FUNCTIONS = (*SDPA_FUNCTIONS, grouped_query_attention)
