"""The Triton kernel of the Lamport all-reduce; imported only where Triton is (see
`lamport_all_reduce`, whose docstring states the protocol and argues why it is sound).

One program (CTA) per BLOCK elements of the message. Buffers are read and written as
integer bit patterns (`BITS`: int16 for bf16, int32 for fp32), so that the sentinel test
compares bits: -0.0 == +0.0 as floats, and the sentinel is -0.0's bit pattern.
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
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] this program's elements of the message
    mask = offs < vectors * VEC  # constant over each 16-byte vector: the accesses vectorize
    phase = tl.load(phase_ptr + pid)
    own = _buffer(peers_ptr, RANK, BITS)
    bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(BITS, bitcast=True)
    bits = tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)  # -0.0 -> +0.0: data never looks unwritten

    # 1. Publish: this rank's elements into slot (phase, RANK) of every peer's buffer, over P2P.
    for dst in tl.static_range(WORLD):
        if dst != RANK:  # compile-time: this rank's own part stays in registers
            peer = _buffer(peers_ptr, dst, BITS)
            tl.store(peer + (phase * WORLD + RANK) * SLOT + offs, bits, mask=mask)

    # 2. Gather: wait for each peer's elements in this rank's own buffer, summing in rank
    # order in fp32 (every rank adds the same values in the same order: identical results).
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            acc += bits.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        else:
            slot = own + (phase * WORLD + src) * SLOT + offs
            got = tl.load(slot, mask=mask, other=0, volatile=True)  # masked lanes read 0: never waiting
            while tl.max((got == SENTINEL).to(tl.int32), axis=0) > 0:
                got = tl.load(slot, mask=mask, other=0, volatile=True)
            acc += got.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    # 3. Reset this phase's peer slots of the own buffer, once every thread of the program
    # has read its elements (the barrier), then step this program's phase.
    tl.debug_barrier()
    unwritten = tl.full([BLOCK], SENTINEL, BITS)
    for src in tl.static_range(WORLD):
        if src != RANK:
            tl.store(own + (phase * WORLD + src) * SLOT + offs, unwritten, mask=mask)
    tl.store(phase_ptr + pid, (phase + 1) % PHASES)


@triton.jit
def _buffer(peers_ptr, rank: tl.constexpr, BITS: tl.constexpr):
    """Rank `rank`'s buffer, as a pointer; symmetric allocations are page-aligned, which
    Triton cannot see through an integer (without the hint every access is scalar)."""
    return tl.multiple_of(tl.load(peers_ptr + rank).to(tl.pointer_type(BITS)), 16)
