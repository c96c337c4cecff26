"""A one-shot all-reduce with no barrier, for small messages: every rank writes its input
into every peer's buffer over NVLink P2P, and each element says by itself whether it has
arrived (Lamport's trick, as TensorRT-LLM's and vLLM's small-message all-reduces use).

    buffer = LamportBuffer.allocate(group_name, dtype, rank, world_size, device)  # collective, at set-up
    out = buffer.all_reduce(x)   # x: contiguous, 16-byte aligned, <= LAMPORT_MAX_BYTES

Layout. Each rank owns one symmetric buffer per dtype (outside every graph pool, never
freed: graphs hold its address and its peers'), of PHASES x world slots of `SLOT` elements;
slot (phase, src) starts at element (phase * world + src) * SLOT. Outside a call every
element of every slot holds the SENTINEL, -0.0's bit pattern: set at allocation, and
restored by the reader after each call.

A call (`lamport_kernel`; per program k, which owns elements [k*BLOCK, (k+1)*BLOCK)):

  1. phase = phases[k], a device counter (below); the input with -0.0 replaced by +0.0, so
     that data never equals the sentinel, is stored into slot (phase, me) of every peer.
  2. For each src in rank order, spin with volatile loads on slot (phase, src) of the own
     buffer until none of the program's elements is the sentinel, then add it in fp32
     (the own part from registers). Every rank adds the same values in the same order: the
     results are identical on every rank. A sum of zeros is +0.0 (NCCL's may be -0.0).
  3. A CTA barrier (every thread has read its elements), then the slots (phase, src != me)
     of the own buffer back to the sentinel, and phases[k] = (phase + 1) % PHASES.

Why no barrier is needed. Each element is stored once by one writer and read by one
reader, with natural alignment (2 or 4 bytes): a reader sees the sentinel or the value,
never a mix, and no element's arrival depends on another's, so no fence orders them. The
volatile loads (`ld.volatile`: relaxed, system scope) re-read memory on every spin;
neither L1 nor a register keeps a stale sentinel.

Why a slot is never overwritten early, nor its new data erased by a reset. Number the
calls that program k runs (every rank runs the same all-reduces on the group in the same
order, with the same sizes, as tensor parallelism requires: the same programs, the same
counts). Rank A writes slot (p, A) of rank B in call n, and next in call n + PHASES. A
starts call n + PHASES only after its call n + PHASES - 1 finished (stream order), which
needed B's data of that call, which B stores at the start of its call n + PHASES - 1,
which B starts only after its call n finished, reads and reset included. So B has read
and reset slot (p, A) before A writes it again: with PHASES >= 2 by this chain (one phase
is not enough: A's call n + 1 could land on a slot B has not read). We use 3: a whole call
of B's then lies between B's reset and A's next write, so the chain leans on stream order
and not on how soon a finished kernel's reset reaches a peer's view of memory; the cost
is one more slot per rank (64 KiB x world per dtype).

Why the phase lives on the device. A CUDA graph replays fixed arguments, and graphs may be
replayed in any order (two captured sizes alternating, eager calls between): a phase
baked in at capture would repeat. Each program index keeps its own counter, read at the
start of a call and stepped at its end (after the barrier, so no thread of the program
reads the stepped value), which the next kernel on the stream sees. Counters of program
indices that a small message does not launch stay put, as do their slots: the argument
holds per program index. A rank that runs an all-reduce its peers do not (or another
size) leaves the ranks' phases apart and hangs, as NCCL inside graphs would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from ..kernels.skinny_linear import dependent_launch
from .all_reduce_choice import ALIGNMENT, LAMPORT_MAX_BYTES

log = logging.getLogger(__name__)

PHASES = 3  # >= 2 is required, see the module's argument
BLOCK = 4096  # elements per program: a [1, 4096] message is one CTA; to be tuned on GPUs
NUM_WARPS = 8
MAX_WORLD = 8  # the kernel unrolls its loops over the ranks

# The sentinel is -0.0: for each dtype, the integer type of its width and -0.0's bits in it.
SENTINEL_BITS = {torch.bfloat16: (torch.int16, -(2**15)), torch.float32: (torch.int32, -(2**31))}


@dataclasses.dataclass(frozen=True)
class LamportLayout:
    """Where each slot of one rank's buffer lies, in elements of one dtype."""

    world_size: int
    element_size: int
    max_bytes: int = LAMPORT_MAX_BYTES
    phases: int = PHASES
    block: int = BLOCK

    @property
    def slot_numel(self) -> int:
        return self.max_bytes // self.element_size

    @property
    def numel(self) -> int:  # the whole buffer
        return self.phases * self.world_size * self.slot_numel

    @property
    def max_programs(self) -> int:  # one phase counter each
        return -(-self.slot_numel // self.block)

    def slot_offset(self, phase: int, src: int) -> int:
        return (phase * self.world_size + src) * self.slot_numel

    def programs(self, numel: int) -> int:
        assert 0 < numel <= self.slot_numel, numel
        return -(-numel // self.block)


def without_negative_zero(x: torch.Tensor) -> torch.Tensor:
    """`x` with every -0.0 made +0.0, bit for bit what the kernel publishes (its reference)."""
    bits_dtype, sentinel = SENTINEL_BITS[x.dtype]
    bits = x.view(bits_dtype)
    return torch.where(bits == sentinel, torch.zeros_like(bits), bits).view(x.dtype)


def lamport_problem(world_size: int) -> str | None:
    """Why the Lamport kernel cannot run here (None: it can)."""
    if world_size > MAX_WORLD:
        return f"{world_size} ranks; the Lamport kernel takes at most {MAX_WORLD}"
    try:
        import triton.language as tl
    except ImportError as e:
        return f"triton cannot be imported ({e})"
    if not hasattr(tl, "pointer_type"):
        return "this triton has no triton.language.pointer_type (the kernel's peer pointers)"
    return None


class _LamportSlots:
    """One rank's symmetric buffer for one dtype, the table of every rank's buffer address
    and the per-program phase counters: everything a graph's Lamport kernels read, made
    once and kept for the life of the process. The kernel that uses them is the subclass's."""

    BLOCK_NAME = "BLOCK"  # the kernel's name for the elements a program owns (`layout.block`)

    def __init__(self, layout: LamportLayout, rank: int, dtype: torch.dtype, buffer: torch.Tensor,
                 peers: torch.Tensor, handle) -> None:
        self.layout, self.rank, self.dtype = layout, rank, dtype
        self.buffer = buffer  # [layout.numel] of SENTINEL_BITS[dtype][0]: symmetric
        self.peers = peers  # [world] int64: every rank's buffer address, mapped here
        self.phases = torch.zeros(layout.max_programs, dtype=torch.int32, device=buffer.device)
        self._handle = handle  # keeps the peers' mappings alive
        bits_dtype, sentinel = SENTINEL_BITS[dtype]
        self._constants = {"RANK": rank, "WORLD": layout.world_size, "PHASES": layout.phases,
                           "SLOT": layout.slot_numel, self.BLOCK_NAME: layout.block,
                           "VEC": ALIGNMENT // layout.element_size, "BITS": _triton_int(bits_dtype),
                           "SENTINEL": sentinel, "num_warps": NUM_WARPS}
        pdl = dependent_launch(buffer.device)  # a compile option too: warmup and launch must agree
        self._constants.update(PDL=pdl, **({"launch_pdl": True} if pdl else {}))

    @classmethod
    def allocate(cls, group_name: str, dtype: torch.dtype, rank: int, world_size: int, device: torch.device):
        """Allocate, fill with the sentinel and rendezvous (a collective over the group).
        The caller synchronizes the device and meets every rank before the first call, so
        that no peer's data lands before this rank's fill."""
        import torch.distributed._symmetric_memory as symm_mem

        layout = cls.layout_for(world_size, torch.empty((), dtype=dtype).element_size())
        bits_dtype, sentinel = SENTINEL_BITS[dtype]
        buffer = symm_mem.empty(layout.numel, dtype=bits_dtype, device=device)
        buffer.fill_(sentinel)
        handle = symm_mem.rendezvous(buffer, group_name)
        offset = buffer.data_ptr() - handle.buffer_ptrs[rank]  # 0 where the handle gives tensor addresses
        addresses = [p + offset for p in handle.buffer_ptrs]
        assert all(a % ALIGNMENT == 0 for a in addresses), addresses  # the kernel's alignment hint
        peers = torch.tensor(addresses, dtype=torch.int64, device=device)
        return cls(layout, rank, dtype, buffer, peers, handle)

    @classmethod
    def layout_for(cls, world_size: int, element_size: int) -> LamportLayout:
        return LamportLayout(world_size, element_size)

    def _check_reset(self, what: str) -> None:
        if not bool((self.buffer == SENTINEL_BITS[self.dtype][1]).all()):
            raise RuntimeError(f"expected every slot back to the sentinel after the {what} self-check, got some not")

    def _vectors(self, x: torch.Tensor) -> int:
        nbytes = x.numel() * self.layout.element_size
        assert nbytes % ALIGNMENT == 0, nbytes  # kind_for_call sends no other size here
        return nbytes // ALIGNMENT


class LamportBuffer(_LamportSlots):
    """The plain all-reduce's buffer: programs of BLOCK elements of the message."""

    def compile(self) -> None:
        """Compile the kernel without running it: a rank whose compile fails must not leave
        its peers spinning, and no compile may happen inside a capture."""
        example = torch.empty(self.layout.block, dtype=self.dtype, device=self.buffer.device)
        with _current(self.buffer.device):  # Triton compiles for the current device
            _kernel().warmup(example, example, self.peers, self.phases, self._vectors(example), grid=(1,),
                             **self._constants)

    def check(self) -> None:
        """One all-reduce of (rank + 1) over a whole slot on every rank (a collective), against
        the exact sum, and the own slots back to the sentinel after it; raises where not."""
        world = self.layout.world_size
        x = torch.full((self.layout.slot_numel,), float(self.rank + 1), dtype=self.dtype, device=self.buffer.device)
        got, want = self.all_reduce(x), world * (world + 1) // 2
        wrong = got[got != want]
        if wrong.numel():
            raise RuntimeError(f"expected the Lamport all-reduce's self-check to give {want} everywhere, got "
                               f"{wrong.numel()} other elements ({wrong[:4].tolist()}...)")
        self._check_reset("Lamport")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, with no barrier (see the module's protocol)."""
        assert x.dtype == self.dtype and x.is_contiguous() and x.data_ptr() % ALIGNMENT == 0, x
        out = torch.empty_like(x)
        grid = (self.layout.programs(x.numel()),)
        with _current(self.buffer.device):  # Triton launches on the current device
            _kernel()[grid](x, out, self.peers, self.phases, self._vectors(x), **self._constants)
        return out


# The fused kernel (`all_reduce_norm`): one program a row, each row owning NORM_ROW elements
# of every slot, so a program index touches the same elements at every hidden size.
NORM_ROW = 8192  # the largest hidden size it takes (a power of 2: the program's block)
NORM_ROWS = 8  # the most rows a call may have


def norm_shape_problem(rows: int, hidden: int, element_size: int, max_bytes: int) -> str | None:
    """Why the fused kernel cannot take [rows, hidden] (None: it can); `max_bytes`: the group's
    Lamport limit, where the kernel's latency wins."""
    nbytes = rows * hidden * element_size
    if not 0 < hidden <= NORM_ROW or (hidden * element_size) % ALIGNMENT:
        return f"[{rows}, {hidden}]: the kernel takes a hidden size up to {NORM_ROW}, of whole {ALIGNMENT}-byte vectors"
    if rows > NORM_ROWS or nbytes > max_bytes:
        return f"[{rows}, {hidden}] ({nbytes} bytes): the kernel takes up to {NORM_ROWS} rows and {max_bytes} bytes"
    return None


class LamportNormBuffer(_LamportSlots):
    """The buffer of the all-reduce fused with the residual add and RMS norm after it (one
    program a row; `lamport_add_rms_norm_kernel`). The protocol and its argument are the plain
    kernel's, per program index: the index is the row, whose part of each slot is fixed."""

    BLOCK_NAME = "ROW"

    @classmethod
    def layout_for(cls, world_size: int, element_size: int) -> LamportLayout:
        return LamportLayout(world_size, element_size, max_bytes=NORM_ROWS * NORM_ROW * element_size, block=NORM_ROW)

    def problem(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, max_bytes: int) -> str | None:
        """Why the fused kernel cannot take this call (None: it can)."""
        hidden = x.shape[-1] if x.dim() else 0
        if x.dtype != self.dtype or residual.dtype != x.dtype or weight.dtype != x.dtype:
            return f"dtypes {x.dtype}, {residual.dtype}, {weight.dtype}: the kernel takes {self.dtype} for all three"
        if residual.shape != x.shape or tuple(weight.shape) != (hidden,):
            return f"shapes {list(x.shape)}, {list(residual.shape)}, {list(weight.shape)}: not [..., h], [..., h], [h]"
        why = norm_shape_problem(x.numel() // hidden if hidden else 0, hidden, self.layout.element_size, max_bytes)
        if why:
            return why
        tensors = {"input": x, "residual": residual, "weight": weight}
        odd = [name for name, t in tensors.items() if not t.is_contiguous() or t.data_ptr() % ALIGNMENT]
        if odd:
            return f"{', '.join(odd)} not contiguous at a {ALIGNMENT}-byte aligned address"
        return None

    def compile(self) -> None:
        example = torch.empty(1, NORM_ROW, dtype=self.dtype, device=self.buffer.device)
        with _current(self.buffer.device):
            _norm_kernel().warmup(example, example, example[0], example, example, self.peers, self.phases,
                                  self._vectors(example), 1e-6, grid=(1,), **self._constants)
            _gather_kernel().warmup(example, example[0], example, example, self.peers, self.phases,
                                    self._vectors(example), 1e-6, grid=(1,), **self._constants)

    def check(self) -> None:
        """One fused call of (rank + 1) over every row a slot holds (a collective), residual
        0 and weight 1: the sums must be exact, the norms 1 (to rounding), the slots reset."""
        world = self.layout.world_size
        x = torch.full((NORM_ROWS, NORM_ROW), float(self.rank + 1), dtype=self.dtype, device=self.buffer.device)
        total, normed = self.add_rms_norm(x, torch.zeros_like(x), torch.ones_like(x[0]), 0.0)
        want = world * (world + 1) // 2
        if bool((total != want).any()) or not bool(((normed.float() - 1).abs() < 1e-2).all()):
            raise RuntimeError(f"expected the fused Lamport all-reduce's self-check to give sums of {want} and "
                               f"norms of 1, got sums {total.unique()[:4].tolist()}, norms {normed.unique()[:4].tolist()}")
        self._check_reset("fused Lamport")

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(all_reduce(x) + residual, its RMS norm times `weight`), in one kernel; `problem`
        must have said None."""
        hidden = x.shape[-1]
        total, normed = torch.empty_like(x), torch.empty_like(x)
        with _current(self.buffer.device):
            _norm_kernel()[(x.numel() // hidden,)](x, residual, weight, total, normed, self.peers, self.phases,
                                                   self._vectors(weight), float(eps), **self._constants)
        return total, normed

    def linear_problem(self, x: torch.Tensor, up: torch.Tensor | None, matrix: torch.Tensor,
                       bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                       max_bytes: int) -> str | None:
        """Why `linear_add_rms_norm` cannot take this call (None: it can): the product must
        be one the skinny kernels take, and its row one the fused kernel takes."""
        from ..kernels.silu_mul_linear import gated_problem
        from ..kernels.skinny_linear import kernel_problem

        why = kernel_problem(x, matrix, bias) if up is None else gated_problem(x, up, matrix, bias)
        if why:
            return f"the product: {why}"
        if tuple(residual.shape) != (*x.shape[:-1], matrix.shape[0]):
            return f"a product of {matrix.shape[0]} features beside a residual of shape {list(residual.shape)}"
        return self.problem(residual, residual, weight, max_bytes)

    def linear_add_rms_norm(self, x: torch.Tensor, up: torch.Tensor | None, matrix: torch.Tensor,
                            bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(all_reduce(F.linear(x', matrix, bias)) + residual, its RMS norm times `weight`),
        x' being x, or silu(x) * up where `up` is given, for one row, in two launches: the
        product publishes each block of its row into every rank's slot as it finishes it
        (`linear_publish_kernel`), then the gather adds and normalises. The protocol is the
        fused kernel's; the product's launch only stands in for its first step, and a slot
        it writes is reset by the gather after it, as the peers' are. `linear_problem` must
        have said None."""
        from ..kernels.skinny_linear import cdiv, choose_launch, launch_arguments, one_row

        n, k = matrix.shape
        launch = choose_launch(n, k, gated=up is not None)
        lamport = {name: self._constants[name] for name in ("RANK", "WORLD", "SLOT", "BITS", "SENTINEL")}
        total, normed = torch.empty_like(residual), torch.empty_like(residual)
        row = one_row(x, k)
        with _current(self.buffer.device):
            _publish_kernel()[(cdiv(n, launch.block_n),)](
                row, one_row(up, k) if up is not None else row, matrix, bias if bias is not None else matrix, n, k,
                matrix.stride(0), self.peers, self.phases, HAS_BIAS=bias is not None, GATED=up is not None,
                **lamport, **launch_arguments(launch, k, self.buffer.device))
            _gather_kernel()[(1,)](residual, weight, total, normed, self.peers, self.phases, self._vectors(weight),
                                   float(eps), **self._constants)
        return total, normed


def _current(device: torch.device):
    """`device` made current; nothing for CPU tensors (Triton's interpreter, in tests)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _kernel():
    from .lamport_kernel import lamport_all_reduce_kernel

    return lamport_all_reduce_kernel


def _publish_kernel():
    from .lamport_kernel import linear_publish_kernel

    return linear_publish_kernel


def _gather_kernel():
    from .lamport_kernel import lamport_gather_add_rms_norm_kernel

    return lamport_gather_add_rms_norm_kernel


def _norm_kernel():
    from .lamport_kernel import lamport_add_rms_norm_kernel

    return lamport_add_rms_norm_kernel


def _triton_int(dtype: torch.dtype):
    import triton.language as tl

    return {torch.int16: tl.int16, torch.int32: tl.int32}[dtype]
