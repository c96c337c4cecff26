"""Attention of a few query rows over a long cache, as batched matmuls that fill the GPU.

A decode step attends one token (or a few: a group of query heads that share a KV head,
see `grouped_query`) over every cached position. SDPA's fused kernels give each (batch,
head) one thread block that walks the whole key length, so at batch 1 a layer's attention
runs on a handful of blocks: on a static cache of 1,024 positions it takes 44 us per layer
on an H100 for 2 MB of keys and values, far below the bandwidth the GPU has. Written as a
batched matmul for the scores, a softmax and a batched matmul for the output, the two
matmuls split the key length over the whole GPU and Inductor fuses the scaling, masking
and softmax: 8 us for the same layer, 12 us at batch 8 against SDPA's 47
(benchmarks/HISTORY.md, "Which form": a form of float32 reductions measured 18 and 61).

`lower_small_query_attention` rewrites such calls in a graph that Inductor compiles
(`Config.small_query_attention`, full graphs only): never in pieces, where attention runs
eagerly and the matmuls and softmax would be several launches in place of one. Its caller
may hand it another form of the same attention: cgcompile hands it
`cgcompile.kernels.decode_attention` (split-K flash decoding in one or two launches), which
falls back to this module's matmuls where its kernels cannot serve.

Precision: that of Hugging Face's eager attention. The matmuls accumulate in float32 but
return the inputs' dtype, so half-precision scores are rounded once before the float32
softmax, and the probabilities once before the second matmul. A query row that every key
masks out gets zeros, as SDPA returns for such rows.

Left alone: more than `max_query` query rows or a symbolic row count, dropout, causal
calls (a few rows of a causal mask are a mask over their own positions; the model passes
one explicitly on a cache), a scale that is not a constant, query heads that are not a
multiple of the key heads.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .graph_values import contiguous_strides, example_value
from .sdpa import SDPA_FUNCTIONS, grouped_query_attention, sdpa_arguments

MAX_QUERY_ROWS = 16


def small_query_attention(query, key, value, attn_mask=None, scale=None, dim_order=None):
    """SDPA of query [..., H, T, D] over key/value [..., Hk, L, D] (H a multiple of Hk, query
    head h reading key head h // (H // Hk)) -> [..., H, T, Dv], as two batched matmuls with
    a float32 softmax between them; laid out densely in `dim_order` where given (see
    `traced_dim_order`)."""
    *lead, heads, rows, head_dim = query.shape
    key_heads, length = key.shape[-3], key.shape[-2]
    scale = head_dim ** -0.5 if scale is None else scale
    # The query heads of one key head become rows: [..., Hk, G*T, D]; no key is repeated.
    q = query.reshape(*lead, key_heads, heads // key_heads * rows, head_dim)
    scores = _at_least_float32(torch.matmul(q, key.transpose(-2, -1))) * scale  # [..., Hk, G*T, L]
    scores = scores.view(*lead, heads, rows, length)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if attn_mask is not None:  # a row every key masks out: zeros, not softmax's 0/0 (NaN inputs stay NaN)
        probs = probs.masked_fill(scores.isneginf().all(dim=-1, keepdim=True), 0.0)
    probs = probs.to(value.dtype).view(*lead, key_heads, -1, length)  # [..., Hk, G*T, L]
    out = torch.matmul(probs, value)  # [..., Hk, G*T, Dv]
    out = out.view(*lead, heads, rows, value.shape[-1]).to(query.dtype)
    return out if dim_order is None else in_dim_order(out, dim_order)


def traced_dim_order(value) -> tuple[int, ...] | None:
    """The order of a traced tensor's dims in memory, outermost first, where its layout is
    not the contiguous one (SDPA's fused kernels return [B, H, T, D] laid out as [B, T, H, D]);
    None where it is contiguous or a size or stride has no concrete value. Size-1 dims, whose
    strides mean nothing, go first."""
    if not isinstance(value, torch.Tensor):
        return None
    sizes, strides = [_concrete(s) for s in value.shape], [_concrete(s) for s in value.stride()]
    if None in sizes or None in strides or contiguous_strides(sizes, strides):
        return None
    wide = sorted((d for d, size in enumerate(sizes) if size > 1), key=lambda d: (-strides[d], d))
    return tuple([d for d, size in enumerate(sizes) if size <= 1] + wide)


def empty_in_dim_order(like, shape, dim_order):
    """An empty tensor of `shape` (`like`'s dtype and device) laid out densely with its dims
    in `dim_order`, outermost first: the layout `traced_dim_order` read."""
    inverse = sorted(range(len(dim_order)), key=dim_order.__getitem__)
    return like.new_empty([shape[d] for d in dim_order]).permute(*inverse)


def in_dim_order(x, dim_order):
    """`x`'s values in a fresh tensor laid out as `empty_in_dim_order` lays it out. Fresh, so
    its strides are the same for every `x` (an op's fake and real outputs must agree)."""
    return empty_in_dim_order(x, x.shape, dim_order).copy_(x)


def _concrete(size) -> int | None:
    return size.node.hint if isinstance(size, torch.SymInt) else size



def _at_least_float32(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def grouped_small_query_attention(query, key, value, attn_mask=None, scale=None, heads_outer=False):
    """`grouped_query_attention`'s contract ([B, Hk, G, D] out, rows outer in memory or,
    with `heads_outer`, contiguous) with `small_query_attention` in place of SDPA."""
    return grouped_layout(small_query_attention(query, key, value, attn_mask, scale), key.shape[1], heads_outer)


def grouped_layout(out, key_heads: int, heads_outer: bool = False):
    """One query row's attention [B, H, 1, Dv] in `grouped_query_attention`'s layout."""
    batch, heads, _, value_dim = out.shape
    grouped = out.reshape(batch, key_heads, heads // key_heads, value_dim)
    return grouped.contiguous() if heads_outer else grouped.transpose(1, 2).contiguous().transpose(1, 2)


def lower_small_query_attention(gm: GraphModule, max_query: int = MAX_QUERY_ROWS,
                                attention=small_query_attention, grouped_attention=grouped_small_query_attention) -> int:
    """Rewrite SDPA calls (and `grouped_query_attention` calls) of at most `max_query`
    static query rows to `attention` (and `grouped_attention`), which must keep the
    contracts of `small_query_attention` (and `grouped_small_query_attention`): another
    form of the same attention, such as a kernel's. An SDPA call traced with a layout other
    than the contiguous one passes it as `dim_order`. Returns how many; the graph is
    changed in place."""
    lowered = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = sdpa_arguments(node) if node.target in SDPA_FUNCTIONS else None
        if args is not None and _lowerable(args, max_query):
            node.target = attention
            node.args = (args["query"], args["key"], args["value"])
            node.kwargs = {"attn_mask": args.get("attn_mask"), "scale": args.get("scale")}
            # SDPA's traced layout, kept: a later piece was traced reading it, and would
            # copy any other layout into it at every call (one launch a layer).
            order = traced_dim_order(example_value(node))
            if order is not None:
                node.kwargs = {**node.kwargs, "dim_order": order}
            lowered += 1
        elif node.target is grouped_query_attention:
            node.target = grouped_attention
            lowered += 1
    if lowered:
        gm.graph.lint()
        gm.recompile()
    return lowered


def _lowerable(args: dict, max_query: int) -> bool:
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False) or isinstance(args.get("scale"), Node):
        return False
    if not all(isinstance(args.get(name), Node) for name in ("query", "key", "value")):
        return False
    query, key = example_value(args["query"]), example_value(args["key"])
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)) or not 3 <= query.dim() == key.dim():
        return False
    rows, heads, key_heads = query.shape[-2], query.shape[-3], key.shape[-3]
    if not all(type(x) is int for x in (rows, heads, key_heads)) or rows > max_query or heads % key_heads:
        return False
    return heads == key_heads or bool(args.get("enable_gqa", False))
