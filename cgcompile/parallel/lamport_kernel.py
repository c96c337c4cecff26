"""The Triton kernels of the Lamport all-reduce; imported only where Triton is (see
`lamport_all_reduce`, whose docstring states the protocol and argues why it is sound, and
`all_reduce_norm` for the fused residual add and RMS norm).

The plain and fused kernels run the same three steps per program (CTA): publish the
program's elements into every peer's slot, gather and sum the peers' elements as they
arrive, reset the own slots and step the program's phase. `linear_publish_kernel` and
`lamport_gather_add_rms_norm_kernel` split the fused kernel's steps over two launches: the
row-parallel product that makes the row publishes each block of it into every rank's slot,
its own included, as it finishes it, and the second kernel only gathers, adds and resets
(see `LamportNormBuffer.linear_add_rms_norm`). Buffers are read and written as integer bit patterns
(`BITS`: int16 for bf16, int32 for fp32), so that the sentinel test compares bits:
-0.0 == +0.0 as floats, and the sentinel is -0.0's bit pattern.

With `PDL` (programmatic dependent launch, Hopper and later; the launch sets `launch_pdl`)
a kernel may be launched while the one before it on the stream still runs: it waits for
that one to finish (`gdc_wait`) before its first memory access, so it orders exactly as a
plain launch does, and it lets the next kernel launch (`gdc_launch_dependents`) once the
peers' elements are summed. Without it each all-reduce broke the chain of dependent
launches the step's other kernels keep, with a launch gap on either side.
"""

import triton
import triton.language as tl

from ..kernels.skinny_linear_kernel import linear_sum


@triton.jit(do_not_specialize=["vectors"])
def lamport_all_reduce_kernel(
    x_ptr,  # [numel] this rank's input (bf16 or fp32), read in place
    out_ptr,  # [numel] this rank's output, same dtype
    peers_ptr,  # [WORLD] int64: the base address of every rank's buffer, mapped in this process
    phase_ptr,  # [programs] int32: the phase each program index uses next (0 .. PHASES-1)
    vectors,  # the message's length in 16-byte vectors (its bytes are a multiple of 16)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PHASES: tl.constexpr,
    SLOT: tl.constexpr,  # elements per slot (LAMPORT_MAX_BYTES / element size)
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,  # elements per 16 bytes
    BITS: tl.constexpr,  # the integer type of the element's width
    SENTINEL: tl.constexpr,  # -0.0's bit pattern as a signed integer of BITS
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] this program's elements of the message
    mask = offs < vectors * VEC  # constant over each 16-byte vector: the accesses vectorize
    phase = tl.load(phase_ptr + pid)
    acc = _exchange(x_ptr, offs, offs, mask, phase, peers_ptr, RANK, WORLD, SLOT, BITS, SENTINEL)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    _finish(peers_ptr, phase_ptr, pid, phase, offs, mask, RANK, WORLD, PHASES, SLOT, BITS, SENTINEL, False)


@triton.jit(do_not_specialize=["vectors"])
def lamport_add_rms_norm_kernel(
    x_ptr,  # [rows, hidden] this rank's input (bf16 or fp32), read in place
    residual_ptr,  # [rows, hidden] added to the sum
    weight_ptr,  # [hidden] the norm's scale
    sum_ptr,  # [rows, hidden] out: all_reduce(x) + residual, in the input's dtype
    norm_ptr,  # [rows, hidden] out: rms_norm(sum) * weight
    peers_ptr,
    phase_ptr,  # [programs] int32, one per row
    vectors,  # hidden in 16-byte vectors
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PHASES: tl.constexpr,
    SLOT: tl.constexpr,
    ROW: tl.constexpr,  # elements of a slot each row owns: the largest hidden size, a power of 2
    VEC: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)  # one program a row: the norm reads the whole row
    cols = tl.arange(0, ROW)
    hidden = vectors * VEC
    mask = cols < hidden
    offs = row * hidden + cols  # the row in the [rows, hidden] tensors
    slot_offs = row * ROW + cols  # the row's part of a slot: the same elements at every hidden size
    phase = tl.load(phase_ptr + row)
    total = _exchange(x_ptr, offs, slot_offs, mask, phase, peers_ptr, RANK, WORLD, SLOT, BITS, SENTINEL)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _add_rms_norm(total, residual_ptr, weight_ptr, sum_ptr, norm_ptr, offs, cols, mask, hidden, eps)
    _finish(peers_ptr, phase_ptr, row, phase, slot_offs, mask, RANK, WORLD, PHASES, SLOT, BITS, SENTINEL, False)


@triton.jit
def linear_publish_kernel(
    x_ptr,  # [K] the product's one input row (where GATED, the gate)
    up_ptr,  # [K] where GATED, the up projection: the input is silu(x) * up; else any pointer
    w_ptr,  # [N, K] this rank's shard of the row-parallel weight, unit stride along K
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    N,
    K,
    stride_wn,
    peers_ptr,  # [WORLD] int64: every rank's norm buffer, mapped in this process
    phase_ptr,  # [rows] int32: the phase of each row's slots; the product is row 0
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    SLOT: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Step 1 of the fused kernel, made by the product itself: each program's BLOCK_N
    features of `w @ x (+ bias)` (the skinny kernels' `linear_sum`), rounded to x's dtype,
    go into slot (phase, RANK) of every rank's buffer, this rank's own included, at row 0's
    elements. No output tensor is written."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # also orders the phase read after the last gather's step
    y, offs_n, n_ok = linear_sum(x_ptr, w_ptr, bias_ptr, tl.program_id(0), N, K, stride_wn, BLOCK_N, BLOCK_K,
                                 HAS_BIAS, EVEN_K, PDL, up_ptr, GATED)
    bits = y.to(x_ptr.dtype.element_ty).to(BITS, bitcast=True)
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)  # -0.0 -> +0.0, as `_exchange` publishes
    phase = tl.load(phase_ptr)
    for dst in tl.static_range(WORLD):
        peer = _buffer(peers_ptr, dst, BITS)
        tl.store(peer + (phase * WORLD + RANK) * SLOT + offs_n, bits, mask=n_ok)


@triton.jit(do_not_specialize=["vectors"])
def lamport_gather_add_rms_norm_kernel(
    residual_ptr,  # [rows, hidden] added to the sum
    weight_ptr,  # [hidden] the norm's scale
    sum_ptr,  # [rows, hidden] out: all_reduce(x) + residual
    norm_ptr,  # [rows, hidden] out: rms_norm(sum) * weight
    peers_ptr,
    phase_ptr,  # [programs] int32, one per row
    vectors,  # hidden in 16-byte vectors
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PHASES: tl.constexpr,
    SLOT: tl.constexpr,
    ROW: tl.constexpr,
    VEC: tl.constexpr,
    BITS: tl.constexpr,
    SENTINEL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Steps 2 and 3 of the fused kernel where `linear_publish_kernel` did step 1: every
    rank's part, this rank's own too, is read from the own buffer; the own slot is reset
    with the peers'."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, ROW)
    hidden = vectors * VEC
    mask = cols < hidden
    offs = row * hidden + cols
    slot_offs = row * ROW + cols
    phase = tl.load(phase_ptr + row)
    total = _gather(_buffer(peers_ptr, RANK, BITS), phase, slot_offs, mask, tl.zeros(offs.shape, dtype=BITS),
                    residual_ptr.dtype.element_ty, RANK, WORLD, SLOT, SENTINEL, True)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _add_rms_norm(total, residual_ptr, weight_ptr, sum_ptr, norm_ptr, offs, cols, mask, hidden, eps)
    _finish(peers_ptr, phase_ptr, row, phase, slot_offs, mask, RANK, WORLD, PHASES, SLOT, BITS, SENTINEL, True)


@triton.jit
def _add_rms_norm(total, residual_ptr, weight_ptr, sum_ptr, norm_ptr, offs, cols, mask, hidden, eps):
    """What the unfused graph computes from the all-reduce's fp32 sum, rounding included: the
    all-reduce's result and the sum with the residual in the input's dtype, the norm in fp32,
    its result cast back before the weight (torch's and transformers' RMS norms), the
    product rounded once more."""
    dtype = residual_ptr.dtype.element_ty
    residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    h = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(sum_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, axis=0) / hidden
    normed = (hf * tl.rsqrt(variance + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(norm_ptr + offs, (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _exchange(x_ptr, offs, slot_offs, mask, phase, peers_ptr, RANK: tl.constexpr, WORLD: tl.constexpr,
              SLOT: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """Publish this rank's elements `x[offs]` into slot (phase, RANK) of every peer at
    `slot_offs`, then gather each peer's from the own buffer as they arrive; the fp32 sum."""
    own = _buffer(peers_ptr, RANK, BITS)
    bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(BITS, bitcast=True)
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)  # -0.0 -> +0.0: data never looks unwritten

    # 1. Publish, over P2P.
    for dst in tl.static_range(WORLD):
        if dst != RANK:  # compile-time: this rank's own part stays in registers
            peer = _buffer(peers_ptr, dst, BITS)
            tl.store(peer + (phase * WORLD + RANK) * SLOT + slot_offs, bits, mask=mask)

    # 2. Gather.
    return _gather(own, phase, slot_offs, mask, bits, x_ptr.dtype.element_ty, RANK, WORLD, SLOT, SENTINEL, False)


@triton.jit
def _gather(own, phase, slot_offs, mask, bits, dtype: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
            SLOT: tl.constexpr, SENTINEL: tl.constexpr, OWN_SLOT: tl.constexpr):
    """Sum every rank's elements in rank order in fp32 (every rank adds the same values in
    the same order: identical results), each peer's read from the own buffer as it arrives;
    this rank's from `bits` (registers), or with OWN_SLOT from its slot too."""
    acc = tl.zeros(slot_offs.shape, dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK and not OWN_SLOT:
            acc += bits.to(dtype, bitcast=True).to(tl.float32)
        else:
            slot = own + (phase * WORLD + src) * SLOT + slot_offs
            got = tl.load(slot, mask=mask, other=0, volatile=True)  # masked lanes read 0: never waiting
            while tl.max((got == SENTINEL).to(tl.int32), axis=0) > 0:
                got = tl.load(slot, mask=mask, other=0, volatile=True)
            acc += got.to(dtype, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def _finish(peers_ptr, phase_ptr, pid, phase, slot_offs, mask, RANK: tl.constexpr, WORLD: tl.constexpr,
            PHASES: tl.constexpr, SLOT: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr,
            OWN_SLOT: tl.constexpr):
    """3. Reset this phase's peer slots of the own buffer (with OWN_SLOT this rank's own slot
    too), once every thread of the program has read its elements (the barrier), then step
    this program's phase."""
    tl.debug_barrier()
    own = _buffer(peers_ptr, RANK, BITS)
    unwritten = tl.full(slot_offs.shape, SENTINEL, BITS)
    for src in tl.static_range(WORLD):
        if src != RANK or OWN_SLOT:
            tl.store(own + (phase * WORLD + src) * SLOT + slot_offs, unwritten, mask=mask)
    tl.store(phase_ptr + pid, (phase + 1) % PHASES)


@triton.jit
def _buffer(peers_ptr, rank: tl.constexpr, BITS: tl.constexpr):
    """Rank `rank`'s buffer, as a pointer; symmetric allocations are page-aligned, which
    Triton cannot see through an integer (without the hint every access is scalar)."""
    return tl.multiple_of(tl.load(peers_ptr + rank).to(tl.pointer_type(BITS)), 16)
