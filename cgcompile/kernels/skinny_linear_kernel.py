"""The Triton kernel of `skinny_linear`; imported only where Triton is (see `skinny_linear`).

`y = x @ w.T (+ bias)` for x of a few rows: each program owns `BLOCK_N` output features
and walks the whole of K, so each weight element is read exactly once, by one program,
and every row of x is applied to it while it is in registers. With `DOT` the rows are
padded to 16 and multiplied on the tensor cores (one `tl.dot` per K block); without, the
products are summed in a float32 accumulator of the tile's shape and reduced over K once,
after the loop. Either way the sum is in float32, as cuBLAS accumulates, and rounded once.
"""

import triton
import triton.language as tl


@triton.jit
def skinny_linear_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N] or a dummy when not HAS_BIAS
    y_ptr,  # [M, N], unit stride along N
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    ROWS: tl.constexpr,  # M rounded up to a power of 2 (16 with DOT)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, ROWS)  # [ROWS]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [ROWS, BLOCK_K]
    if DOT:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    else:
        acc3 = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc)  # [ROWS, BLOCK_N]
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not DOT:
        acc = tl.sum(acc3, axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
