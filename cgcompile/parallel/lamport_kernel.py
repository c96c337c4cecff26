"""The Triton kernels of the Lamport all-reduce; imported only where Triton is (see
`lamport_all_reduce`, whose docstring states the protocol and argues why it is sound, and
`all_reduce_norm` for the fused residual add and RMS norm).

Both kernels run the same three steps per program (CTA): publish the program's elements
into every peer's slot, gather and sum the peers' elements as they arrive, reset the own
slots and step the program's phase. Buffers are read and written as integer bit patterns
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
    _finish(peers_ptr, phase_ptr, pid, phase, offs, mask, RANK, WORLD, PHASES, SLOT, BITS, SENTINEL)


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

    # What the unfused graph computes, rounding included: the all-reduce's result and the sum
    # with the residual in the input's dtype, the norm in fp32, its result cast back before the
    # weight (torch's and transformers' RMS norms), the product rounded once more.
    dtype = x_ptr.dtype.element_ty
    residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    h = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(sum_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, axis=0) / hidden
    normed = (hf * tl.rsqrt(variance + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(norm_ptr + offs, (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)
    _finish(peers_ptr, phase_ptr, row, phase, slot_offs, mask, RANK, WORLD, PHASES, SLOT, BITS, SENTINEL)


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

    # 2. Gather, summing in rank order in fp32 (every rank adds the same values in the same
    # order: identical results).
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += bits.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        else:
            slot = own + (phase * WORLD + src) * SLOT + slot_offs
            got = tl.load(slot, mask=mask, other=0, volatile=True)  # masked lanes read 0: never waiting
            while tl.max((got == SENTINEL).to(tl.int32), axis=0) > 0:
                got = tl.load(slot, mask=mask, other=0, volatile=True)
            acc += got.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def _finish(peers_ptr, phase_ptr, pid, phase, slot_offs, mask, RANK: tl.constexpr, WORLD: tl.constexpr,
            PHASES: tl.constexpr, SLOT: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """3. Reset this phase's peer slots of the own buffer, once every thread of the program
    has read its elements (the barrier), then step this program's phase."""
    tl.debug_barrier()
    own = _buffer(peers_ptr, RANK, BITS)
    unwritten = tl.full(slot_offs.shape, SENTINEL, BITS)
    for src in tl.static_range(WORLD):
        if src != RANK:
            tl.store(own + (phase * WORLD + src) * SLOT + slot_offs, unwritten, mask=mask)
    tl.store(phase_ptr + pid, (phase + 1) % PHASES)


@triton.jit
def _buffer(peers_ptr, rank: tl.constexpr, BITS: tl.constexpr):
    """Rank `rank`'s buffer, as a pointer; symmetric allocations are page-aligned, which
    Triton cannot see through an integer (without the hint every access is scalar)."""
    return tl.multiple_of(tl.load(peers_ptr + rank).to(tl.pointer_type(BITS)), 16)
