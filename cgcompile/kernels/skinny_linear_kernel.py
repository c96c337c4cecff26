"""The Triton kernels of `skinny_linear` and `grouped_skinny_linear`; imported only where
Triton is (see `skinny_linear`).

`y = w @ x (+ bias)` for one row x: each program owns `BLOCK_N` output features and walks
the whole of K, so each weight element is read exactly once, by one program. Products are
added into a float32 accumulator of the tile's shape and summed over K once, after the
loop: in float32, as cuBLAS accumulates, and rounded once. Every kernel runs that loop
through one function, `linear_sum`; the grouped kernel only picks which weight a
program's block belongs to, the SiLU-gated kernel makes each step's x from a gate and
an up projection as it loads them (`silu(gate) * up`, each op rounded to x's dtype as
eager rounds it), so that product is never written out, and the Lamport kernel that
publishes a row-parallel product into its peers' buffers (`parallel.lamport_kernel`)
stores its block there instead of into `y`.

With `PDL` (programmatic dependent launch, Hopper and later; the launch sets `launch_pdl`)
the kernel may be launched while the kernel before it still runs: it waits for that kernel (`gdc_wait`) before its first load or store, so
nothing it reads or writes can race, and it lets the next kernel launch once its loads are
done (`gdc_launch_dependents`; a kernel launched that way waits in its turn).
"""

import triton
import triton.language as tl


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up as eager computes it: each op in float32, its result rounded to gate's dtype."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _linear_block(
    x_ptr,  # [K]
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    y_ptr,  # [N]
    block,  # which BLOCK_N output features: block * BLOCK_N onwards
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    PDL: tl.constexpr,
    up_ptr,  # [K]: where GATED, x is silu(x_ptr[k]) * up_ptr[k]; else any pointer
    GATED: tl.constexpr,
):
    y, offs_n, n_ok = linear_sum(x_ptr, w_ptr, bias_ptr, block, N, K, stride_wn, BLOCK_N, BLOCK_K, HAS_BIAS,
                                 EVEN_K, PDL, up_ptr, GATED)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def linear_sum(
    x_ptr,  # [K]
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    block,  # which BLOCK_N output features: block * BLOCK_N onwards
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    PDL: tl.constexpr,
    up_ptr,  # [K]: where GATED, x is silu(x_ptr[k]) * up_ptr[k]; else any pointer
    GATED: tl.constexpr,
):
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_ok = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k)
            if GATED:
                x = _silu_mul(x, tl.load(up_ptr + k0 + offs_k))
        else:
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            if GATED:  # masked lanes: silu(0) * 0 = 0
                x = _silu_mul(x, tl.load(up_ptr + k0 + offs_k, mask=k_ok, other=0.0))
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return y, offs_n, n_ok


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
    _linear_block(x_ptr, w_ptr, bias_ptr, y_ptr, tl.program_id(0), N, K, stride_wn,
                  BLOCK_N, BLOCK_K, HAS_BIAS, EVEN_K, PDL, x_ptr, False)


@triton.jit
def silu_mul_linear_kernel(
    gate_ptr,  # [K]
    up_ptr,  # [K]
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    y_ptr,  # [N]
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """`w @ (silu(gate) * up) (+ bias)`: a gated MLP's down projection with its gating."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    _linear_block(gate_ptr, w_ptr, bias_ptr, y_ptr, tl.program_id(0), N, K, stride_wn,
                  BLOCK_N, BLOCK_K, HAS_BIAS, EVEN_K, PDL, up_ptr, True)


@triton.jit
def _pick(later, value, chosen):
    """`value` where the program's block lies at or past a member's first block, else `chosen`."""
    return tl.where(later, value, chosen)


@triton.jit
def grouped_skinny_linear_kernel(
    x_ptr,  # [K], read by every member
    w0, w1, w2, w3,  # [N_i, K] each, unit stride along K; an unused member repeats w0 with N_i = 0
    b0, b1, b2, b3,  # [N_i] each, or any pointers when not HAS_BIAS
    y_ptr,  # [N_0 + N_1 + N_2 + N_3]: the members' outputs side by side
    N0, N1, N2, N3,
    S0, S1, S2, S3,  # the weights' strides along N
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Up to four linears of one row x in one launch. The grid covers each member's blocks in
    turn (cdiv(N_i, BLOCK_N) each, so no block straddles two members); a program finds its
    member by comparing its id with where each member's blocks start, and runs that member's
    `_linear_block`. Members of N_i = 0 own no block: they are never picked."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    start1 = tl.cdiv(N0, BLOCK_N)
    start2 = start1 + tl.cdiv(N1, BLOCK_N)
    start3 = start2 + tl.cdiv(N2, BLOCK_N)
    in1, in2, in3 = pid >= start1, pid >= start2, pid >= start3
    w = _pick(in3, w3, _pick(in2, w2, _pick(in1, w1, w0)))
    b = _pick(in3, b3, _pick(in2, b2, _pick(in1, b1, b0)))
    n = _pick(in3, N3, _pick(in2, N2, _pick(in1, N1, N0)))
    stride = _pick(in3, S3, _pick(in2, S2, _pick(in1, S1, S0)))
    start = _pick(in3, start3, _pick(in2, start2, _pick(in1, start1, 0)))
    column = _pick(in3, N0 + N1 + N2, _pick(in2, N0 + N1, _pick(in1, N0, 0)))
    _linear_block(x_ptr, w, b, y_ptr + column, pid - start, n, K, stride,
                  BLOCK_N, BLOCK_K, HAS_BIAS, EVEN_K, PDL, x_ptr, False)
