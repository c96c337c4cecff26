"""Route a graph's all-reduces: give each functional sum all-reduce the group's chosen path.

Two places, one rewrite (`passes.fast_all_reduce`):

    records = route_graph_all_reduces(gm, device, configured=config.rewrites.all_reduce)   # Dynamo graph
    records = route_compiled_all_reduces(gm, GROUPS.choice_of)                    # aten graph

The first runs on each Dynamo graph before it is split (`phases.split_pieces`): the
all-reduces a model writes (`funcol.all_reduce`, `dist.all_reduce`; transformers' row-wise
layers at inference). The second runs inside Inductor's compile of a piece, as a post-grad
pass (`inductor_all_reduce`): the all-reduces that appear only after AOTAutograd's dispatch,
such as a DTensor `redistribute` from Partial to Replicate (torch's `parallelize_module`,
transformers' layers with gradients on).

A sum all-reduce (and its wait) on a group whose choice is the fast path becomes one
`cgcompile::all_reduce` call (`symm_all_reduce`), which lives inside a captured piece like
the NCCL collective did (it is neither a split op nor a host sync) and picks one-shot,
two-shot or NCCL per capture size. Every other all-reduce is left as the model wrote it
(NCCL). Each decision is a record with its reason, logged at INFO and kept in
`all_reduce_report()`.

Only graphs on CUDA are routed. Groups are set up (`distributed.setup_all_reduce`, a
collective) on the Dynamo graph only, where every rank compiles the same graphs in the same
order, as tensor parallelism requires anyway: the groups the graph's all-reduces name and
those of every DTensor device mesh in it. The aten-level pass reads the recorded choices and
runs no collective, since Inductor's caches may serve one rank and not another.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import torch

from ..passes import example_value
from ..passes.fast_all_reduce import AllReduceSite, find_all_reduces, route_all_reduces
from .all_reduce_choice import FAST, NCCL, AllReduceChoice
from .distributed import setup_all_reduce
from .symm_all_reduce import ALL_REDUCE_OP, GROUPS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoutedAllReduce:
    """Which all-reduce one site of a graph got (FAST or NCCL), and why. level: "graph" for
    a Dynamo graph's site, "inductor" for one of the aten graph Inductor compiles."""

    site: AllReduceSite
    kind: str
    reason: str
    level: str = "graph"

    def __str__(self) -> str:
        shape = "[" + ", ".join(map(str, self.site.shape)) + "]"
        return (f"{self.site.node} {shape} {self.site.dtype} on group "
                f"{self.site.group_name!r} ({self.level}): {self.kind} ({self.reason})")


_ROUTED: list[RoutedAllReduce] = []  # this process's decisions, for all_reduce_report()


def route_graph_all_reduces(gm: torch.fx.GraphModule, device: torch.device, *,
                            configured: str) -> tuple[RoutedAllReduce, ...]:
    """Decide every all-reduce of the Dynamo graph `gm` and rewrite those that get the fast
    path. On CUDA this sets up (a collective) every group the graph's all-reduces name and
    every group of a DTensor's device mesh in it, whose all-reduces appear only in the aten
    graphs Inductor compiles (`inductor_all_reduce`), which must not run collectives."""
    if device.type == "cuda" and configured != NCCL:
        for group in _mesh_groups(gm):
            setup_all_reduce(device, group, configured=configured)
    return _route(gm, lambda site: _decide(site, device, configured), "graph")


def route_compiled_all_reduces(gm: torch.fx.GraphModule,
                               choice_of: Callable[[str], AllReduceChoice | None]) -> tuple[RoutedAllReduce, ...]:
    """Decide every all-reduce of an aten graph inside an Inductor compile by the recorded
    choice of its group (`choice_of(group_name)`; None: never set up) and rewrite those that
    get the fast path. Runs no collective: ranks may hit Inductor's caches differently."""
    return _route(gm, lambda site: _decide_recorded(site, choice_of(site.group_name)), "inductor")


def _route(gm: torch.fx.GraphModule, decide: Callable, level: str) -> tuple[RoutedAllReduce, ...]:
    sites = find_all_reduces(gm)
    if not sites:
        return ()
    records = tuple(RoutedAllReduce(site, *decide(site), level) for site in sites)
    route_all_reduces(gm, [r.site for r in records if r.kind == FAST], ALL_REDUCE_OP)
    for record in records:
        log.info("cgcompile: all-reduce %s", record)
    _ROUTED.extend(records)
    return records


def _decide(site: AllReduceSite, device: torch.device, configured: str) -> tuple[str, str]:
    if site.blocker is not None:
        return NCCL, site.blocker
    if configured == NCCL:
        return NCCL, "Config.all_reduce='nccl'"
    if device.type != "cuda":
        return NCCL, f"the graph runs on {device.type}"
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _by_choice(site, setup_all_reduce(device, _resolve_process_group(site.group_name), configured=configured))


def _decide_recorded(site: AllReduceSite, choice: AllReduceChoice | None) -> tuple[str, str]:
    if site.blocker is not None:
        return NCCL, site.blocker
    if site.device is None or site.device.type != "cuda":
        return NCCL, f"its input is on {site.device}"
    if choice is None:
        return NCCL, ("its group was not set up before the compile; call "
                      "cgcompile.parallel.prepare_collectives(device, group) first")
    return _by_choice(site, choice)


def _by_choice(site: AllReduceSite, choice: AllReduceChoice) -> tuple[str, str]:
    if not choice.fast:
        return NCCL, choice.reason
    if site.dtype not in choice.dtypes:
        return NCCL, f"{site.dtype}: the symmetric-memory kernels take {', '.join(map(str, choice.dtypes))}"
    return FAST, choice.reason


def _mesh_groups(gm: torch.fx.GraphModule) -> list:
    """The process groups of every DTensor device mesh the graph holds: a sharded value's
    mesh, a mesh input (a closure's), or a mesh argument (`DTensor.from_local(x, mesh, ...)`)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return []
    meshes = {}
    for node in gm.graph.nodes:
        value = example_value(node)
        found = [value.device_mesh] if isinstance(value, DTensor) else [value]
        for mesh in map(_real_mesh, [*found, *node.args, *node.kwargs.values()]):
            if mesh is not None:
                meshes.setdefault(id(mesh), mesh)
    groups = {}
    for mesh in meshes.values():
        try:
            mesh_groups = mesh.get_all_groups()
        except Exception as e:  # torch's mesh API varies by release; those all-reduces then keep NCCL
            _warn_mesh_groups_unknown(f"{type(e).__name__}: {e}")
            continue
        for group in mesh_groups:
            groups.setdefault(group.group_name, group)
    return list(groups.values())


@functools.cache
def _warn_mesh_groups_unknown(why: str) -> None:
    log.warning("cgcompile: the process groups of a DTensor device mesh could not be read (%s); the "
                "all-reduces only Inductor's graph shows keep NCCL unless prepare_collectives set the "
                "groups up", why)


def _real_mesh(obj):
    """The DeviceMesh `obj` is, or stands for: newer torch traces a mesh as an opaque
    FakeScriptObject that keeps the real one."""
    from torch.distributed.device_mesh import DeviceMesh

    obj = obj.__dict__.get("real_obj", obj) if type(obj).__name__ == "FakeScriptObject" else obj
    return obj if isinstance(obj, DeviceMesh) else None


@dataclasses.dataclass(frozen=True)
class AllReduceReport:
    """This process's all-reduce decisions: per group, per graph site, and per call kind."""

    groups: tuple
    sites: tuple[RoutedAllReduce, ...]
    calls: dict

    def lines(self) -> list[str]:
        return ([f"all-reduce {c}" for c in self.groups] + [f"all-reduce {s}" for s in self.sites]
                + [f"all-reduce calls on group {g!r}: {dict(sorted(k.items()))}" for g, k in self.calls.items()])


def all_reduce_report() -> AllReduceReport:
    return AllReduceReport(tuple(GROUPS.choices()), tuple(_ROUTED), GROUPS.calls())

