"""Which all-reduce a process group gets: torch symmetric memory's one-shot or two-shot
kernels over NVLink P2P pointers (the fast path), optionally cgcompile's barrier-free
Lamport kernel for the smallest messages (`lamport_all_reduce`), or the group's own NCCL
all-reduce.

Two decisions, both pure functions of recorded facts:

  - `choose_for_group(facts)`, once per group at set-up: can the fast path serve this
    group at all? It needs CUDA tensors on an NCCL group whose ranks all sit on one host
    with P2P access between their GPUs, and torch's symmetric-memory ops over the CUDA
    (P2P) backend. Any missing condition gives "nccl" with the reason.
  - `kind_for_call(choice, ...)`, per all-reduce and size (at capture, since a replay runs
    no Python): one-shot for messages up to `ONE_SHOT_MAX_BYTES`, two-shot up to
    `TWO_SHOT_MAX_BYTES`, NCCL above (bandwidth-bound, where NCCL's ring is as good), and
    NCCL for what the kernels do not take (a non-sum reduction, another dtype, a
    misaligned size). Below one-shot, messages up to `LAMPORT_MAX_BYTES` go to the Lamport
    kernel where Triton is there and the input's address is 16-byte aligned (measured on 2
    H200s: 2.9 us against one-shot's 6.7 for 8 KiB); `configured="symm_mem"` keeps torch's
    kernels only.

Why these kernels: NCCL's ring and tree protocols are bandwidth-optimal but pay several
micro-seconds of protocol per call; a decode step's all-reduce moves a few KB. One-shot
has every rank read every peer's buffer and sum (one barrier, one pass); two-shot
reduce-scatters then all-gathers, moving less per rank for larger messages. Neither uses
NVLink multicast (`multimem_*` ops, NVLS), which these hosts switch off
(`NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`).

The byte thresholds are starting points to be set by `benchmarks/all_reduce_bench.py`.
"""

from __future__ import annotations

import dataclasses

import torch

FAST = "symm_mem"
NCCL = "nccl"
ONE_SHOT = "one_shot"
TWO_SHOT = "two_shot"
LAMPORT = "lamport"  # a per-call kind
AUTO = "auto"  # the configured values (Config.all_reduce): every kernel where it serves,
TORCH_KERNELS_ONLY = "symm_mem"  # torch's one-shot and two-shot without the Lamport kernel, or NCCL

ONE_SHOT_MAX_BYTES = 512 * 1024
TWO_SHOT_MAX_BYTES = 8 * 1024 * 1024  # also the size of each symmetric buffer
FAST_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one/two-shot kernels dispatch on
ALIGNMENT = 16  # bytes: the kernels move 16-byte vectors
LAMPORT_MAX_BYTES = 64 * 1024  # also the size of each slot of a Lamport buffer


@dataclasses.dataclass(frozen=True)
class GroupFacts:
    """What the choice reads about one process group, gathered on every rank alike.

    symm_mem_problem: why torch's symmetric memory cannot serve here (None: it can).
    lamport_problem: why the Lamport kernel cannot serve here (None: it can, or nobody asked:
    `configured` other than "auto")."""

    device_type: str
    backend: str | None
    world_size: int
    hosts: int
    p2p: bool
    symm_mem_problem: str | None
    lamport_problem: str | None = None


@dataclasses.dataclass(frozen=True)
class AllReduceChoice:
    """The all-reduce one process group gets, and why: `kind` is FAST or NCCL.
    lamport_max_bytes: the largest message the Lamport kernel takes (0: none).
    configured: the Config.all_reduce value it was chosen under."""

    group_name: str
    kind: str
    reason: str
    world_size: int = 1
    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES
    max_bytes: int = TWO_SHOT_MAX_BYTES
    dtypes: tuple[torch.dtype, ...] = FAST_DTYPES
    lamport_max_bytes: int = 0
    configured: str = AUTO

    @property
    def fast(self) -> bool:
        return self.kind == FAST

    @property
    def lamport(self) -> bool:
        return self.fast and self.lamport_max_bytes > 0

    def without_lamport(self, why: str) -> AllReduceChoice:
        """The same choice with the Lamport kernel off, saying why."""
        return dataclasses.replace(self, lamport_max_bytes=0, reason=f"{self.reason}; Lamport off: {why}")

    def __str__(self) -> str:
        return f"group {self.group_name!r}: {self.kind} ({self.reason})"


def choose_for_group(group_name: str, facts: GroupFacts, *, configured: str = "auto") -> AllReduceChoice:
    """The group's all-reduce: the fast path where every condition holds, else NCCL."""
    def nccl(why: str) -> AllReduceChoice:
        return AllReduceChoice(group_name, NCCL, why, facts.world_size, configured=configured)

    if configured == NCCL:
        return nccl("Config.all_reduce='nccl'")
    if facts.device_type != "cuda":
        return nccl(f"tensors on {facts.device_type}: symmetric memory is CUDA only")
    if facts.backend != "nccl":
        return nccl(f"the group's backend for cuda is {facts.backend or 'none'}, not nccl")
    if facts.world_size < 2:
        return nccl("a group of one rank (nothing to reduce)")
    if facts.hosts != 1:
        return nccl(f"ranks on {facts.hosts} hosts: symmetric memory needs every rank on one host")
    if not facts.p2p:
        return nccl("some GPUs of the group have no P2P access to each other")
    if facts.symm_mem_problem is not None:
        return nccl(facts.symm_mem_problem)
    why = (f"one-shot up to {ONE_SHOT_MAX_BYTES // 1024} KiB, two-shot up to "
           f"{TWO_SHOT_MAX_BYTES // 2**20} MiB, NCCL above; {facts.world_size} GPUs on one host over P2P")
    choice = AllReduceChoice(group_name, FAST, why, facts.world_size, configured=configured)
    if configured == TORCH_KERNELS_ONLY:
        return dataclasses.replace(choice, reason=f"{why}; no Lamport kernel (Config.all_reduce='symm_mem')")
    if facts.lamport_problem is not None:
        return choice.without_lamport(facts.lamport_problem)
    why = f"Lamport up to {LAMPORT_MAX_BYTES // 1024} KiB, then {why}"
    return dataclasses.replace(choice, reason=why, lamport_max_bytes=LAMPORT_MAX_BYTES)


def kind_for_call(choice: AllReduceChoice, *, reduce_op: str, dtype: torch.dtype, numel: int,
                  contiguous: bool = True, aligned: bool = True) -> tuple[str, str]:
    """(LAMPORT | ONE_SHOT | TWO_SHOT | NCCL, why) for one all-reduce of `numel` elements.
    aligned: the input's address is a multiple of ALIGNMENT (the Lamport kernel reads the
    input in place, and Triton compiles another kernel for an unaligned pointer)."""
    if not choice.fast:
        return NCCL, choice.reason
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if reduce_op != "sum":
        return NCCL, f"reduce op {reduce_op!r}: the symmetric-memory kernels sum only"
    if dtype not in choice.dtypes:
        return NCCL, f"{dtype}: the symmetric-memory kernels take {', '.join(map(str, choice.dtypes))}"
    if not contiguous:
        return NCCL, "a non-contiguous input"
    if nbytes > choice.max_bytes:
        return NCCL, f"{nbytes} bytes, over the {choice.max_bytes} of the symmetric buffer (bandwidth-bound)"
    if nbytes % ALIGNMENT:
        return NCCL, f"{nbytes} bytes, not a multiple of {ALIGNMENT}"
    if nbytes <= choice.lamport_max_bytes and aligned:
        return LAMPORT, f"{nbytes} bytes <= {choice.lamport_max_bytes}"
    if nbytes <= choice.one_shot_max_bytes:
        unaligned = nbytes <= choice.lamport_max_bytes  # the Lamport kernel's size, not its address
        return ONE_SHOT, f"{nbytes} bytes <= {choice.one_shot_max_bytes}" + (
            f" (an input address not {ALIGNMENT}-byte aligned: not Lamport)" if unaligned else "")
    element = nbytes // numel
    if numel % (choice.world_size * ALIGNMENT // element):
        return NCCL, f"{numel} elements do not split into {choice.world_size} aligned shards for two-shot"
    return TWO_SHOT, f"{nbytes} bytes <= {choice.max_bytes}"
