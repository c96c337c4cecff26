"""The Triton kernels of `decode_attention`; imported only where Triton is (see `decode_attention`).

Split-K attention of a few query rows: the cache's positions are cut into `chunk`-long
splits, and each program attends the query rows of one (batch, key head) over one split,
an online softmax over `BLOCK_L` positions at a time. With more than one split, each
program writes its unnormalised output and its softmax statistics (the running maximum and
sum) to float32 buffers, and `combine_splits_kernel` rescales and adds them; with one, the
program writes the output itself.

Rows: the G query heads of a key head times the T query tokens, G * T rows of one program
(row r is query head hk * G + r // T, token r % T), so the keys and values are read once per
key head, never repeated per query head. A position that the mask hides from every row of
the program is never read (a static cache's positions past the current length cost the
mask's bytes only, and a block of them is skipped whole), so whatever lies there, NaN
included, cannot reach the output.

The output's strides are arguments, as two per query head (its key head and its place in
the group): `grouped_decode_attention`'s layout, rows outer, is no strided [B, H, T, DV].

Precision: the scores are float32 products of the half-precision inputs, as SDPA's fused
kernels compute them; the probabilities are rounded to the values' dtype before the second
product, as flash attention does. A row that every position masks out gets zeros.

With `PDL` (Hopper and later) each kernel may be launched while the kernel before it runs:
it waits for it (`gdc_wait`) before its first load.
"""

import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr,  # mask: any pointer when not HAS_MASK
    out_ptr,  # [B, H, T, DV] at the strides below; written when not SPLIT
    part_out_ptr,  # [B * Hk, splits, BLOCK_R, BLOCK_DV] float32; written when SPLIT
    part_max_ptr, part_sum_ptr,  # [B * Hk, splits, BLOCK_R] float32 each; written when SPLIT
    sq_b, sq_h, sq_t,  # strides of q [B, H, T, D] (unit along D)
    sk_b, sk_h, sk_l,  # of k [B, Hk, L, D]
    sv_b, sv_h, sv_l,  # of v [B, Hk, L, DV]
    sm_b, sm_h, sm_t, sm_l,  # of the mask broadcast to [B, H, T, L] (0 where broadcast)
    so_b, so_hk, so_g, so_t,  # of out, for query head hk * group + g (see above)
    key_heads, tokens, group, length, chunk, head_dim, value_dim,
    scale,
    BLOCK_R: tl.constexpr,  # >= group * tokens, >= 16 (tl.dot)
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,  # True keeps a position; else the mask is added to the scores
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)  # b * Hk + hk
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = pid // key_heads
    hk = pid % key_heads
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < group * tokens
    head = hk * group + rows // tokens  # [BLOCK_R]
    token = rows % tokens
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + token[:, None] * sq_t + d[None, :],
                mask=row_ok[:, None] & (d < head_dim)[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
    row_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    for l0 in range(start, end, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        pos_ok = pos < end
        keep = row_ok[:, None] & pos_ok[None, :]  # [BLOCK_R, BLOCK_L]
        bias = tl.zeros((BLOCK_R, BLOCK_L), tl.float32)
        if HAS_MASK:
            m_ptrs = mask_ptr + b * sm_b + head[:, None] * sm_h + token[:, None] * sm_t + pos[None, :] * sm_l
            if MASK_BOOL:
                keep = keep & (tl.load(m_ptrs, mask=keep, other=0) != 0)
            else:
                bias = tl.load(m_ptrs, mask=keep, other=float("-inf")).to(tl.float32)
                keep = keep & (bias != float("-inf"))
        read = tl.max(keep.to(tl.int32), axis=0) > 0  # [BLOCK_L]: positions some row attends to
        if tl.max(read.to(tl.int32)) > 0:  # else skip the block's keys and values
            k = tl.load(k_ptr + b * sk_b + hk * sk_h + pos[:, None] * sk_l + d[None, :],
                        mask=read[:, None] & (d < head_dim)[None, :], other=0.0)  # [BLOCK_L, BLOCK_D]
            v = tl.load(v_ptr + b * sv_b + hk * sv_h + pos[:, None] * sv_l + dv[None, :],
                        mask=read[:, None] & (dv < value_dim)[None, :], other=0.0)  # [BLOCK_L, BLOCK_DV]
            scores = tl.dot(q, tl.trans(k)) * scale + bias  # [BLOCK_R, BLOCK_L], float32
            scores = tl.where(keep, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing kept yet
            probs = tl.exp(scores - base[:, None])
            rescale = tl.exp(row_max - base)
            row_sum = row_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
            row_max = new_max
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT:
        part = pid * splits + split
        tl.store(part_out_ptr + (part * BLOCK_R + rows[:, None]) * BLOCK_DV + dv[None, :], acc)
        tl.store(part_max_ptr + part * BLOCK_R + rows, row_max)
        tl.store(part_sum_ptr + part * BLOCK_R + rows, row_sum)
    else:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        offsets = b * so_b + hk * so_hk + (rows // tokens) * so_g + token * so_t
        tl.store(out_ptr + offsets[:, None] + dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv < value_dim)[None, :])


@triton.jit
def combine_splits_kernel(
    out_ptr,  # [B, H, T, DV] at the strides below
    part_out_ptr, part_max_ptr, part_sum_ptr,  # as decode_attention_kernel writes them
    so_b, so_hk, so_g, so_t,  # decode_attention_kernel's
    splits, key_heads, tokens, value_dim,
    BLOCK_R: tl.constexpr,  # decode_attention_kernel's, the partial buffers' row stride
    BLOCK_S: tl.constexpr,  # >= splits
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (batch, key head) and query row: every split's output for the row at
    once, each rescaled from its own maximum to the overall one, summed and divided by the
    rescaled sum of the softmax."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)  # b * Hk + hk
    row = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    s_ok = s < splits
    stat = (pid * splits + s) * BLOCK_R + row  # [BLOCK_S]
    maxes = tl.load(part_max_ptr + stat, mask=s_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + stat, mask=s_ok, other=0.0)
    parts = tl.load(part_out_ptr + stat[:, None] * BLOCK_DV + dv[None, :], mask=s_ok[:, None], other=0.0)
    overall = tl.max(maxes, axis=0)
    weight = tl.exp(maxes - tl.where(overall == float("-inf"), 0.0, overall))  # 0 for a split that saw nothing
    total = tl.sum(weight * sums, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # [BLOCK_DV]
    offset = pid // key_heads * so_b + pid % key_heads * so_hk + row // tokens * so_g + row % tokens * so_t
    tl.store(out_ptr + offset + dv, out.to(out_ptr.dtype.element_ty), mask=dv < value_dim)
