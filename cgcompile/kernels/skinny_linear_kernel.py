"""The Triton kernel of `skinny_linear`; imported only where Triton is (see `skinny_linear`).

`y = w @ x (+ bias)` for one row x: each program owns `BLOCK_N` output features and walks
the whole of K, so each weight element is read exactly once, by one program. Products are
added into a float32 accumulator of the tile's shape and summed over K once, after the
loop: in float32, as cuBLAS accumulates, and rounded once.

With `PDL` (programmatic dependent launch, Hopper and later; the launch sets `launch_pdl`)
the kernel may be launched while the kernel before it still runs: it waits for that kernel (`gdc_wait`) before its first load or store, so
nothing it reads or writes can race, and it lets the next kernel launch once its loads are
done (`gdc_launch_dependents`; a kernel launched that way waits in its turn).
"""

import triton
import triton.language as tl


@triton.jit
def skinny_linear_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    y_ptr,  # [N]
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_ok = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k)
        else:
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
