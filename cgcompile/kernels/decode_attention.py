"""`cgcompile::decode_attention`: attention of a few query rows over a cache, in one or two launches.

`Config.small_query_attention` lowers decode attention inside a full graph to two batched
matmuls around a softmax (`cgcompile.passes.small_query`): those spread over the GPU where
SDPA's kernels walk the keys with one block per head. They are still five to seven launches
a layer (the two products, the softmax, the query and key layouts), each a few
microseconds at batch 1. This op does the same attention as split-K flash decoding:
`decode_attention_kernel` attends each (batch, key head)'s query rows over one split of the
positions, and `combine_splits_kernel` adds the splits up (see there).

The op takes any operands: it runs the kernels where `kernel_problem` finds nothing against
them and `small_query_attention`'s batched matmuls otherwise, so a graph that calls it is
valid at every size. `attention_with_kernel` is what the lowering calls in the graph: the op
where the traced operands suit the kernel, the batched matmuls where they never will.

`cgcompile::grouped_decode_attention` is the same attention in `grouped_query_attention`'s
contract (one token, the query heads of a key head as rows, the result laid out rows outer,
or contiguous with `heads_outer`): the kernels write that layout directly, where the
matmuls' result is copied into it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..passes.matvec_reduction import HALF_DTYPES
from ..passes.small_query import (empty_in_dim_order, grouped_small_query_attention, in_dim_order,
                                  small_query_attention)
from .skinny_linear import cdiv, dependent_launch, next_power_of_2, triton_available

MAX_ROWS = 64  # query rows of one key head (query heads per key head x tokens) in one program
# Cache positions: the longest measured (benchmarks/decode_attention_bench.py, RESULTS.md),
# where the kernels were level with the matmuls or ahead at every shape.
MAX_LENGTH = 4096
MAX_HEAD_DIM = 256
BLOCK_L = 64  # positions a program attends per step of its loop
MIN_DOT = 16  # tl.dot's smallest block


def kernel_problem(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None, dim_order: Sequence[int] | None = None) -> str | None:
    """Why `decode_attention` runs the batched matmuls for these operands (None: the kernels).
    Reads only what a fake tensor has (device, dtype, shapes), and compares no symbolic size
    (that would add a guard)."""
    if dim_order is not None and (sorted(dim_order) != list(range(query.dim())) or dim_order[-1] != query.dim() - 1):
        return f"an output laid out in dim order {tuple(dim_order)}; the kernels write the last dim innermost"
    if query.dtype not in HALF_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype}; the kernels take bf16 or fp16, all alike"
    if not 3 <= query.dim() <= 4 or key.dim() != query.dim() or value.dim() != query.dim():
        return f"query of {query.dim()} dims, key {key.dim()}, value {value.dim()}; the kernels take 3 or 4, all alike"
    heads, tokens, head_dim = query.shape[-3:]
    key_heads = key.shape[-3]
    if heads % key_heads or key.shape[-1] != head_dim or value.shape[-3] != key_heads:
        return (f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                "the kernels take [B, H, T, D], [B, Hk, L, D], [B, Hk, L, Dv] with H a multiple of Hk")
    if query.dim() == 4 and not (query.shape[0] == key.shape[0] == value.shape[0]):
        return f"batch {query.shape[0]}, {key.shape[0]}, {value.shape[0]}: the kernels take one batch for all"
    length = key.shape[-2]
    if not isinstance(length, int) or length > MAX_LENGTH:
        return f"a cache of {length} positions; the kernels take a static length of up to {MAX_LENGTH}"
    if heads // key_heads * tokens > MAX_ROWS:
        return f"{heads // key_heads * tokens} query rows a key head; the kernels take up to {MAX_ROWS}"
    if max(head_dim, value.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims {head_dim} and {value.shape[-1]}; the kernels take up to {MAX_HEAD_DIM}"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "the query, key or value does not have unit stride along its last dim"
    if attn_mask is not None and (attn_mask.device != query.device or attn_mask.dim() > query.dim()
                                  or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point())):
        return f"a mask of {attn_mask.dtype} and {attn_mask.dim()} dims on {attn_mask.device}"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, attn_mask)):
        return "an input requires grad; the kernels have no backward"
    if query.device.type != "cuda":
        return f"the query is on {query.device.type}, the kernels run on CUDA"
    if not triton_available():
        return "triton cannot be imported"
    return None


def choose_splits(programs: int, length: int, device: torch.device) -> int:
    """Positions per split: `BLOCK_L` (one block a program, the most splits), unless that
    makes more than 8 programs per multiprocessor; then as few blocks more a split as bring
    it under. On an H200 that was the best split length measured or within 5% of it, at
    every shape measured (benchmarks/decode_attention_bench.py)."""
    blocks = cdiv(length, BLOCK_L)
    per_split = max(1, cdiv(programs * blocks, 8 * _multiprocessors(device)))
    return min(blocks, per_split) * BLOCK_L


def decode_attention_kernel_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None, scale: float,
                                 chunk: int | None = None, grouped: bool = False,
                                 dim_order: Sequence[int] | None = None, heads_outer: bool = False) -> torch.Tensor:
    """The kernels on operands that `kernel_problem` accepts; `chunk` (positions a split, a
    multiple of `BLOCK_L`) overrides the choice. Returns [..., H, T, Dv], contiguous or laid
    out as `in_dim_order(out, dim_order)` lays it out, written there by the kernels; with
    `grouped` (a query of one token) [B, Hk, G, Dv] in `grouped_layout`'s layout."""
    from .decode_attention_kernel import combine_splits_kernel, decode_attention_kernel

    lead = query.shape[:-3]
    q, k, v = (t if t.dim() == 4 else t.unsqueeze(0) for t in (query, key, value))
    batch, heads, tokens, head_dim = q.shape
    key_heads, length, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = heads // key_heads
    if grouped:
        out = grouped_output(q, key_heads, value_dim, heads_outer)
        out_strides = (out.stride(0), out.stride(1), out.stride(2), 0)
    else:
        result = ordered_output(query, value_dim, dim_order)
        out = result if result.dim() == 4 else result.unsqueeze(0)
        out_strides = (out.stride(0), group * out.stride(1), out.stride(1), out.stride(2))
    mask = None if attn_mask is None else attn_mask.expand(batch, heads, tokens, length)
    programs = batch * key_heads
    chunk = chunk or choose_splits(programs, length, q.device)
    splits = cdiv(length, chunk)
    block_r = max(MIN_DOT, next_power_of_2(group * tokens))
    block_dv = max(MIN_DOT, next_power_of_2(value_dim))
    parts = [None, None, None]
    if splits > 1:
        parts = [torch.empty(programs, splits, block_r, block_dv, dtype=torch.float32, device=q.device),
                 torch.empty(programs, splits, block_r, dtype=torch.float32, device=q.device),
                 torch.empty(programs, splits, block_r, dtype=torch.float32, device=q.device)]
    pdl = dependent_launch(q.device)
    launch = dict(num_warps=4 if block_r <= 32 else 8, **({"launch_pdl": True} if pdl else {}))
    decode_attention_kernel[(programs, splits)](
        q, k, v, mask if mask is not None else q, out, *[p if p is not None else out for p in parts],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *(mask.stride() if mask is not None else (0, 0, 0, 0)),
        *out_strides, key_heads, tokens, group, length, chunk, head_dim, value_dim, scale,
        BLOCK_R=block_r, BLOCK_L=BLOCK_L, BLOCK_D=max(MIN_DOT, next_power_of_2(head_dim)), BLOCK_DV=block_dv,
        HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.bool,
        SPLIT=splits > 1, PDL=pdl, **launch)
    if splits > 1:
        combine_splits_kernel[(programs, group * tokens)](
            out, *parts, *out_strides, splits, key_heads, tokens, value_dim, BLOCK_R=block_r,
            BLOCK_S=next_power_of_2(splits), BLOCK_DV=block_dv, PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}))
    return out if grouped else result


def ordered_output(query: torch.Tensor, value_dim: int, dim_order: Sequence[int] | None) -> torch.Tensor:
    """An empty [..., H, T, Dv] for a query [..., H, T, D]: contiguous, or laid out in
    `dim_order` (`empty_in_dim_order`). The kernels write their rows along Dv, so
    an order that does not keep Dv innermost is refused (`kernel_problem`)."""
    shape = (*query.shape[:-1], value_dim)
    return query.new_empty(shape) if dim_order is None else empty_in_dim_order(query, shape, dim_order)


def grouped_output(query: torch.Tensor, key_heads: int, value_dim: int, heads_outer: bool = False) -> torch.Tensor:
    """An empty [B, Hk, G, Dv] for a query [B, H, 1, D], laid out rows outer ([B, G, Hk, Dv] in
    memory) or, with `heads_outer`, contiguous, as `grouped_layout` makes it: the layout every
    form of grouped attention returns."""
    batch, heads = query.shape[:2]
    if heads_outer:
        return query.new_empty(batch, key_heads, heads // key_heads, value_dim)
    return query.new_empty(batch, heads // key_heads, key_heads, value_dim).transpose(1, 2)


@torch.library.custom_op("cgcompile::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None, scale: float, dim_order: list[int] | None = None) -> torch.Tensor:
    """`small_query_attention(query, key, value, attn_mask, scale, dim_order)`: by the kernels
    where `kernel_problem` allows, else by its batched matmuls; contiguous without
    `dim_order`. Put in graphs by the lowering for inference only (`kernel_problem` refuses
    inputs that require grad), so it has no backward."""
    if kernel_problem(query, key, value, attn_mask, dim_order) is None:
        return decode_attention_kernel_call(query, key, value, attn_mask, scale, dim_order=dim_order)
    out = small_query_attention(query, key, value, attn_mask, scale)
    return out.contiguous() if dim_order is None else in_dim_order(out, dim_order)


@decode_attention.register_fake
def _(query, key, value, attn_mask, scale, dim_order=None):
    return ordered_output(query, value.shape[-1], dim_order)


@torch.library.custom_op("cgcompile::grouped_decode_attention", mutates_args=())
def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attn_mask: torch.Tensor | None, scale: float, heads_outer: bool = False) -> torch.Tensor:
    """`grouped_small_query_attention(query, key, value, attn_mask, scale, heads_outer)` of a
    query [B, H, 1, D]: [B, Hk, G, Dv] laid out rows outer, or contiguous with `heads_outer`.
    The kernels write that layout themselves, where the other forms copy into it (one
    launch a layer)."""
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"grouped decode attention takes a query [B, H, 1, D], not {tuple(query.shape)}: "
                         "call cgcompile::decode_attention for several tokens")
    if kernel_problem(query, key, value, attn_mask) is None:
        return decode_attention_kernel_call(query, key, value, attn_mask, scale, grouped=True, heads_outer=heads_outer)
    out = grouped_output(query, key.shape[1], value.shape[-1], heads_outer)
    return out.copy_(small_query_attention(query, key, value, attn_mask, scale).reshape(out.shape))


@grouped_decode_attention.register_fake
def _(query, key, value, attn_mask, scale, heads_outer=False):
    return grouped_output(query, key.shape[1], value.shape[-1], heads_outer)


def attention_with_kernel(query, key, value, attn_mask=None, scale=None, dim_order=None):
    """`small_query_attention`'s contract, as the lowering puts it in a graph: the op where the
    traced operands suit the kernels, the batched matmuls (which Inductor fuses) where not."""
    return _with_kernel(torch.ops.cgcompile.decode_attention, small_query_attention,
                        query, key, value, attn_mask, scale, dim_order)


def grouped_attention_with_kernel(query, key, value, attn_mask=None, scale=None, heads_outer=False):
    """`grouped_small_query_attention`'s contract, as `attention_with_kernel` chooses."""
    return _with_kernel(torch.ops.cgcompile.grouped_decode_attention, grouped_small_query_attention,
                        query, key, value, attn_mask, scale, extra=(heads_outer,))


def _with_kernel(op, matmuls, query, key, value, attn_mask, scale, dim_order=None, extra=()):
    """`op` where the traced operands suit the kernels (its scale made explicit), else `matmuls`;
    `dim_order` (or the `extra` layout arguments) passed on to either where given."""
    layout = extra if dim_order is None else (list(dim_order),)
    if kernel_problem(query, key, value, attn_mask, dim_order) is not None:
        return matmuls(query, key, value, attn_mask, scale, *layout)
    return op(query, key, value, attn_mask, query.shape[-1] ** -0.5 if scale is None else scale, *layout)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter on the CPU: a few splits, to run the combine kernel
    return torch.cuda.get_device_properties(device).multi_processor_count
