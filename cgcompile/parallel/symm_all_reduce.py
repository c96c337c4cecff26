"""The fast all-reduce at run time: the op `cgcompile::all_reduce` that the graph rewrite
inserts (`cgcompile.parallel.fast_all_reduce`), the persistent symmetric buffers it reads,
and this process's record of every group's choice.

    out = torch.ops.cgcompile.all_reduce(x, "sum", group_name)   # = funcol.all_reduce(x, "sum", group)

Per call (at capture: a replay runs no Python) the op picks one-shot, two-shot or NCCL by
`all_reduce_choice.kind_for_call`; a group with no fast path (or none set up) gets NCCL. A
group set up with `configured="auto"` (and Triton) also holds one `lamport_all_reduce.LamportBuffer`
per dtype (its own symmetric buffer, under the same contract) for the smallest messages.

Buffer contract. A group with the fast path owns one symmetric buffer per dtype,
`[TWO_SHOT_MAX_BYTES / element size]`, allocated with `torch.distributed._symmetric_memory.empty`
and rendezvoused across the group once, at set-up (`distributed.setup_all_reduce`, a
collective), before any capture. An all-reduce copies its input into the buffer's leading
`numel` elements and runs the kernel on that view, so a graph captured with it holds the
buffer's address and its peers' (the kernels read peers' buffers over P2P): the buffers are
never freed or replaced while this process lives, and every graph replays with the very
buffers it was captured with. They live outside the graph pool, so no capture can reuse
their memory. Ranks must replay the same graphs in the same order (true of tensor
parallelism: every rank runs the same step), as with NCCL inside graphs.

Why a registry by name: a custom op takes tensors and strings, so the op finds its group's
buffers by the group's name, as torch's own `symm_mem` ops find their group.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings

import torch

from .all_reduce_choice import ALIGNMENT, LAMPORT, NCCL, ONE_SHOT, TWO_SHOT, AllReduceChoice, kind_for_call
from .lamport_all_reduce import LamportBuffer, LamportNormBuffer

log = logging.getLogger(__name__)

# The ops the fast path calls; none of them uses NVLink multicast (no `multimem_*`).
_SYMM_OPS = ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out")


@dataclasses.dataclass
class FastGroup:
    """One group's choice, its symmetric buffers (by dtype; empty for NCCL), its Lamport
    buffers for plain sums and for sums fused with a residual add and RMS norm (by dtype;
    empty unless `choice.lamport`) and how many all-reduces ran each way (eager calls and
    captures; replays run no Python)."""

    choice: AllReduceChoice
    buffers: dict[torch.dtype, torch.Tensor]
    lamport: dict[torch.dtype, LamportBuffer] = dataclasses.field(default_factory=dict)
    lamport_norm: dict[torch.dtype, LamportNormBuffer] = dataclasses.field(default_factory=dict)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class GroupRegistry:
    """Every group set up in this process, by group name. Entries are never removed: the
    buffers must outlive every graph captured with them (see the module's contract)."""

    def __init__(self) -> None:
        self._groups: dict[str, FastGroup] = {}

    def get(self, group_name: str) -> FastGroup | None:
        return self._groups.get(group_name)

    def add(self, group: FastGroup) -> None:
        assert group.choice.group_name not in self._groups, group.choice.group_name
        self._groups[group.choice.group_name] = group

    def choices(self) -> list[AllReduceChoice]:
        return [g.choice for g in self._groups.values()]

    def choice_of(self, group_name: str) -> AllReduceChoice | None:
        group = self._groups.get(group_name)
        return None if group is None else group.choice

    def calls(self) -> dict[str, dict[str, int]]:
        return {name: dict(g.calls) for name, g in self._groups.items()}


GROUPS = GroupRegistry()


def symm_mem_problem(device: torch.device) -> str | None:
    """Why torch's symmetric memory cannot serve all-reduces on `device` here (None: it can)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch.distributed._symmetric_memory cannot be imported ({e})"
    missing = [op for op in _SYMM_OPS if not hasattr(torch.ops.symm_mem, op)]
    if missing:
        return f"torch {torch.__version__} has no symm_mem ops {missing}"
    try:
        backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None
    except RuntimeError:
        backend = None
    if backend not in (None, "CUDA"):
        return (f"the symmetric-memory backend is {backend} (TORCH_SYMMMEM or set_backend); the one- and "
                f"two-shot kernels run on the CUDA (P2P) backend")
    return None


def allocate_buffers(choice: AllReduceChoice, device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """One symmetric buffer per dtype of `choice`, rendezvoused over its group (a collective:
    every rank of the group calls it, in the same order)."""
    import torch.distributed._symmetric_memory as symm_mem

    _enable_for_group(symm_mem, choice.group_name)
    buffers = {}
    for dtype in choice.dtypes:
        numel = choice.max_bytes // torch.empty((), dtype=dtype).element_size()
        buffers[dtype] = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buffers[dtype], choice.group_name)
    return buffers


def allocate_lamport(choice: AllReduceChoice, rank: int, device: torch.device):
    """Two Lamport buffers per dtype of `choice`, for plain sums and for fused ones
    (`all_reduce_norm`), filled with the sentinel and rendezvoused (a collective, after
    `allocate_buffers`), their kernels compiled, every fill done on the device. The caller
    meets every rank before the first call (see `LamportBuffer.allocate`). Returns
    ({dtype: plain}, {dtype: fused})."""
    made = [{dtype: kind.allocate(choice.group_name, dtype, rank, choice.world_size, device) for dtype in choice.dtypes}
            for kind in (LamportBuffer, LamportNormBuffer)]
    for buffers in made:
        for buffer in buffers.values():
            buffer.compile()
    torch.cuda.synchronize(device)
    return tuple(made)


def _enable_for_group(symm_mem, group_name: str) -> None:
    """Older torch needs the group enabled before a rendezvous; newer torch deprecates the
    call (a FutureWarning) and needs nothing."""
    if symm_mem.is_symm_mem_enabled_for_group(group_name):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group_name)


@torch.library.custom_op("cgcompile::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """funcol.all_reduce(x, reduce_op, group) + its wait, by the group's chosen path."""
    group = GROUPS.get(group_name)
    kind = NCCL
    if group is not None:
        kind, _ = kind_for_call(group.choice, reduce_op=reduce_op, dtype=x.dtype, numel=x.numel(),
                                contiguous=x.is_contiguous(), aligned=x.data_ptr() % ALIGNMENT == 0)
        group.calls[kind] += 1
    if kind == NCCL:
        return _nccl_all_reduce(x, reduce_op, group_name)
    if kind == LAMPORT:  # reads x in place: no copy into a buffer
        return group.lamport[x.dtype].all_reduce(x)
    buffer = group.buffers[x.dtype][: x.numel()].view(x.shape)  # starts at the buffer's base
    out = torch.empty_like(x)
    if kind == ONE_SHOT:  # copies x into the buffer inside the kernel
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x, "sum", group_name, out)
    else:
        assert kind == TWO_SHOT, kind
        buffer.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(buffer, "sum", group_name, out)
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


ALL_REDUCE_OP = torch.ops.cgcompile.all_reduce.default  # what the rewrite inserts


def _nccl_all_reduce(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """The group's own all-reduce (NCCL on GPUs, gloo on CPUs), as the graph had it."""
    started = torch.ops._c10d_functional.all_reduce(x, reduce_op, group_name)
    return torch.ops._c10d_functional.wait_tensor(started)

