"""What cgcompile needs from torch.distributed: checked process groups, communicators made
before any capture, and which collectives a CUDA graph can hold.

Tensor parallelism needs nothing else. A model whose layers call torch.distributed's
functional collectives (`torch.distributed._functional_collectives.all_reduce`), or
`dist.all_reduce`, which Dynamo rewrites into them, compiles into pieces that hold the
collectives like any other op: `_c10d_functional.all_reduce` and `wait_tensor` are
neither split ops nor host syncs. On CUDA with NCCL they are captured inside the pieces'
graphs (NCCL kernels can be captured); a decode step stays one replay per piece. Two
conditions make that sound, and `prepare_collectives` sees to the first:

  - NCCL builds a communicator at its first collective, which cannot happen inside a
    capture: one collective on the device before the first capture creates it.
  - Every rank captures and replays the same graphs in the same order: the ranks of a
    group run the same model on the same batch size (so the same capture size), which
    `check_same_rows` verifies where a caller is unsure.

A collective on a group with no backend for the graph's device is a user error
(`check_backend`); one on gloo with CUDA tensors cannot be captured: its capture fails
and capture recovery splits the piece there (`capture_failed`, with the op named).

Timeouts: a rank that never joins a collective or a send leaves its peers waiting up to
the process group's timeout (`dist.init_process_group(timeout=...)`; 10 minutes by
default for NCCL and 30 for gloo), after which torch raises on the waiting ranks. The
checks here turn the mistakes they can see into errors before anything waits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import socket
import sys
import threading
from typing import Iterator

import torch
import torch.distributed as dist

from ..run.capture import release_all_graphs
from ..errors import DistributedError, expect
from .all_reduce_choice import AUTO, NCCL, AllReduceChoice, GroupFacts, choose_for_group
from .lamport_all_reduce import lamport_problem
from .symm_all_reduce import GROUPS, FastGroup, allocate_buffers, allocate_lamport, symm_mem_problem

log = logging.getLogger(__name__)


def require_group(culprit: str, group=None):
    """The process group to use (`group`, or the default one); raises when torch.distributed
    has not been initialised."""
    available = dist.is_available() and dist.is_initialized()
    expect(available, culprit, "an initialised torch.distributed process group", "none",
           "call torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPUs) first; "
           "torchrun sets the environment it reads", DistributedError, raw=True)
    return group if group is not None else dist.group.WORLD


def rank_name(group=None) -> str:
    """"rank 1" (the global rank, which torchrun's logs use too)."""
    return f"rank {dist.get_rank()}"


def backend_for(group, device: torch.device) -> str | None:
    """The backend name the group uses for tensors on `device` ("nccl", "gloo"), or None."""
    for entry in dist.get_backend_config(group).split(","):
        kind, _, name = entry.partition(":")
        if kind == device.type:
            return name
    return None


def check_backend(culprit: str, group, device: torch.device) -> str:
    """The group's backend for `device`; raises, naming the rank, when it has none."""
    name = backend_for(group, device)
    expect(name is not None, f"{rank_name()}: {culprit}", f"a process group with a backend for {device.type}",
           f"one configured as {dist.get_backend_config(group)!r}",
           "move the tensors to a device the group serves, or init the group for both "
           "(backend='cpu:gloo,cuda:nccl')", DistributedError, raw=True)
    return name


def collectives_capturable(group, device: torch.device) -> bool:
    """Whether collectives on `device` in this group can live inside a CUDA graph (NCCL)."""
    return device.type == "cuda" and backend_for(group, device) == "nccl"


def prepare_collectives(device: torch.device | str, group=None, *, all_reduce: str = "auto") -> None:
    """Run one all-reduce on `device` so the group's communicator exists before any capture,
    and choose the group's all-reduce (`setup_all_reduce`; `all_reduce` as `Config.all_reduce`:
    "auto", "symm_mem" without the Lamport kernel, or "nccl").

    Call it once on every rank after `init_process_group` and before the first compiled
    call (`cgcompile.parallel.pipeline.PipelineStage.connect` calls it). With CUDA graphs a lazily
    created NCCL communicator would be created during the first capture, which fails.
    """
    device = torch.device(device)
    group = require_group("prepare_collectives", group)
    check_backend("prepare_collectives", group, device)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe, group=group)
    expected_sum = dist.get_world_size(group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    expect(int(probe.item()) == expected_sum, f"{rank_name()}: prepare_collectives", f"a sum of {expected_sum}",
           int(probe.item()), "every rank of the group must call prepare_collectives", DistributedError)
    setup_all_reduce(device, group, configured=all_reduce)


def setup_all_reduce(device: torch.device | str, group=None, *, configured: str = "auto") -> AllReduceChoice:
    """Choose the group's all-reduce once, and for the fast path allocate its symmetric
    buffers (see `symm_all_reduce`'s contract); later calls return the recorded choice.

    A collective over the group on its first call for a group (every rank calls it in the
    same order): `prepare_collectives` calls it, and so does the graph rewrite when it
    meets a group nobody set up (every rank compiles the same graphs in the same order).
    """
    group = require_group("setup_all_reduce", group)
    known = GROUPS.get(group.group_name)
    if known is not None:
        _warn_set_up_before(known.choice, configured)
        return known.choice
    device = torch.device(device)
    facts = gather_facts(group, device, lamport=configured == AUTO)
    choice = choose_for_group(group.group_name, facts, configured=configured)
    buffers, lamport = {}, ()
    if choice.fast:
        choice, buffers = _allocate_or_fall_back(choice, group, device)
    if choice.lamport:
        choice, lamport = _lamport_or_fall_back(choice, group, device)
    GROUPS.add(FastGroup(choice, buffers, *lamport))
    log.info("cgcompile: %s: all-reduce for %s", rank_name(), choice)
    return choice


def _warn_set_up_before(choice: AllReduceChoice, configured: str) -> None:
    """A group is set up once: say so where a later set-up asks for another fast path than the
    group's first set-up did (the Lamport kernel or not), rather than quietly keeping it."""
    if configured != NCCL and choice.fast and configured != choice.configured:
        _warn_once(choice.group_name, configured, str(choice))


@functools.cache
def _warn_once(group_name: str, configured: str, choice: str) -> None:
    log.warning("cgcompile: %s: all_reduce=%r asked for group %r, which was set up earlier as %s; it keeps "
                "that choice (set the group up first with prepare_collectives(device, group, all_reduce=%r))",
                rank_name(), configured, group_name, choice, configured)


def gather_facts(group, device: torch.device, *, lamport: bool = False) -> GroupFacts:
    """What `choose_for_group` reads, the same on every rank: gathered over the group only
    where the fast path is possible at all (CUDA tensors on an NCCL group); whether the
    Lamport kernel can run, only where `lamport` asks."""
    backend, world = backend_for(group, device), dist.get_world_size(group)
    if device.type != "cuda" or backend != "nccl" or world < 2:
        return GroupFacts(device.type, backend, world, 1, False, None)
    everyone: list = [None] * world
    mine = (socket.gethostname(), device.index, symm_mem_problem(device), lamport and lamport_problem(world))
    dist.all_gather_object(everyone, mine, group=group)
    here = socket.gethostname()
    peers = [index for host, index, *_ in everyone if host == here and index != device.index]
    p2p: list = [None] * world
    dist.all_gather_object(p2p, all(torch.cuda.can_device_access_peer(device, i) for i in peers), group=group)
    problems = [problem for _, _, problem, _ in everyone if problem]
    lamport_problems = [f"rank {i}: {problem}" for i, (*_, problem) in enumerate(everyone) if problem]
    return GroupFacts("cuda", backend, world, len({host for host, *_ in everyone}), all(p2p),
                      problems[0] if problems else None, lamport_problems[0] if lamport_problems else None)


def _on_every_rank(group, make, catch=(RuntimeError, ValueError)):
    """make() on every rank of `group`: its result here (None where it raised one of `catch`)
    and every rank's failures, the same list on every rank. The gather is also a barrier:
    no rank returns before every rank has finished make()."""
    try:
        made, error = make(), None
    except catch as e:
        made, error = None, f"{type(e).__name__}: {e}"
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return made, [f"rank {i}: {e}" for i, e in enumerate(errors) if e]


def _allocate_or_fall_back(choice: AllReduceChoice, group, device: torch.device):
    """The symmetric buffers, or NCCL (a warning) on every rank when any rank failed."""
    # torch raises RuntimeError and ValueError for allocation and rendezvous
    buffers, failed = _on_every_rank(group, lambda: allocate_buffers(choice, device))
    if not failed:
        return choice, buffers
    log.warning("cgcompile: %s: symmetric memory for group %r failed (%s); its all-reduces use NCCL",
                rank_name(), choice.group_name, "; ".join(failed))
    reason = f"symmetric buffers could not be made ({failed[0]})"
    return AllReduceChoice(choice.group_name, NCCL, reason, choice.world_size, configured=choice.configured), {}


def _lamport_or_fall_back(choice: AllReduceChoice, group, device: torch.device):
    """The Lamport buffers, made on every rank and then checked by one all-reduce per dtype,
    or the choice without them (a warning, on every rank) when any rank failed.

    The first gather is the barrier the protocol needs: every rank's sentinel fill is done
    on its device (`allocate_lamport` synchronizes) before any rank's first call writes into
    its peers. Any exception counts as a failure (a Triton compile error too): a rank that
    raised past the gather would leave its peers waiting there, or spinning in the check."""
    rank = dist.get_rank(group)
    lamport, failed = _on_every_rank(group, lambda: allocate_lamport(choice, rank, device), catch=Exception)
    if not failed:
        checks = lambda: [b.check() for buffers in lamport for b in buffers.values()]  # noqa: E731
        _, failed = _on_every_rank(group, checks, catch=Exception)
    if not failed:
        return choice, lamport
    log.warning("cgcompile: %s: the Lamport all-reduce for group %r failed (%s); its small all-reduces use "
                "one-shot", rank_name(), choice.group_name, "; ".join(failed))
    return choice.without_lamport(f"its set-up failed ({failed[0]})"), ()


def check_same_rows(culprit: str, rows: int, group=None) -> None:
    """Raise on every rank, naming the ranks, unless all ranks of `group` call with `rows`.

    Costs one small collective on the host; tensor-parallel ranks that pad different
    sizes would otherwise replay graphs whose collectives do not match (a hang or wrong
    sums), so call it while a serving loop is being brought up, or whenever in doubt.
    """
    group = require_group(culprit, group)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (dist.get_rank(), rows), group=group)
    odd = [f"rank {rank}: {n}" for rank, n in everyone if n != rows]
    expect(not odd, f"{rank_name()}: {culprit}", f"every rank to call with {rows} rows, as this rank does",
           ", ".join(odd), "give every rank of the group the same batch", DistributedError, raw=True)


# How long `shut_down` may take before the process says so and exits (see teardown_deadline).
TEARDOWN_TIMEOUT_S = 120.0
TEARDOWN_EXIT_STATUS = 3


@contextlib.contextmanager
def teardown_deadline(seconds: float, who: str) -> Iterator[None]:
    """Bound the end of a worker: if the body has not returned after `seconds`, print what
    hung and every thread's stack to stderr and end the process with status 3.

    A hang in NCCL's teardown has no other way out (no timeout of the process group
    covers ncclCommDestroy), and by then the worker's results are out; a silent hang
    until an outer time limit kills the job is the one outcome that tells nobody anything.
    """
    def expire():
        sys.stderr.write(
            f"cgcompile: {who}: tearing the process group down has not finished after {seconds:g} s. "
            f"Likely causes: a CUDA graph that captured this group's collectives is still alive "
            f"(ncclCommDestroy waits for it, pytorch#115388; cgcompile releases its own graphs "
            f"first, so look for other graph owners), or a peer rank never reached the final "
            f"barrier. Every thread's stack follows; exiting with status {TEARDOWN_EXIT_STATUS}.\n"
        )
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(TEARDOWN_EXIT_STATUS)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def shut_down(ok: bool, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """End a torchrun worker cleanly: finish the GPU work, then tear the process group down
    on every rank together. A rank that exits while its peer still has NCCL work in flight,
    or without tearing its group down (the communicators are then torn down by interpreter
    exit, in no fixed order), is what torchrun reports as a failed rank.

    Every cgcompile CUDA graph of the process is released first: ncclCommDestroy waits
    while graphs that captured the communicator's collectives exist (pytorch#115388). On
    2 H200s (torch 2.11) the tensor-parallel example and the benchmark printed their results
    and then hung in teardown. After an error (`ok` False) the barrier is skipped, since a
    peer may be blocked in a collective this rank will never join, and an NCCL group is
    aborted rather than destroyed: the rank exits with its error and torchrun ends the peers.
    All of it runs under `teardown_deadline(timeout_s)`: a teardown that hangs all the same
    ends the process with a message, not silently."""
    with teardown_deadline(timeout_s, rank_name()):
        _tear_down(ok)


def _tear_down(ok: bool) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        release_all_graphs()
    if ok:
        dist.barrier()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and "nccl" in str(dist.get_backend()):
        abort()  # NCCL only (torch's note); it waits for no peer
    else:
        dist.destroy_process_group()  # gloo: pending work times out on its own


# What torchrun sets for each worker, and init_process_group's env:// rendezvous reads.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _require_torchrun() -> None:
    """Refuse a script started without torchrun before torch's rendezvous fails on RANK."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    script = " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]) if sys.argv and sys.argv[0] else "script.py"
    expect(not missing, "torchrun_worker", "the environment torchrun sets for each rank",
           f"no {', '.join(missing)}", f"run it under torchrun, e.g. torchrun --nproc-per-node 2 {script}",
           DistributedError, raw=True)


@contextlib.contextmanager
def torchrun_worker(device_type: str) -> Iterator[torch.device]:
    """The life of one torchrun worker: start the process group (NCCL for "cuda", gloo for
    "cpu"), yield this rank's device (cuda:LOCAL_RANK, made current), and end with
    `shut_down`, clean when the body returned and aborting when it raised."""
    _require_torchrun()
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    ok = False
    try:
        device = torch.device("cpu")
        if device_type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        yield device
        ok = True
    finally:
        shut_down(ok)
