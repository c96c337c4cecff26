"""Route a graph's all-reduces: the step of the compile that gives each functional
all-reduce of a Dynamo graph the group's chosen path before the graph is split.

    records = route_graph_all_reduces(gm, device, configured=config.all_reduce)

A sum all-reduce (and its wait) on a group whose choice is the fast path becomes one
`cgcompile::all_reduce` call (`symm_all_reduce`), which lives inside a captured piece like
the NCCL collective did (it is neither a split op nor a host sync) and picks one-shot,
two-shot or NCCL per capture size. Every other all-reduce is left as the model wrote it
(NCCL). Each decision is a record with its reason, logged at INFO and kept in
`all_reduce_report()`.

Only graphs on CUDA are routed. A group met here that `prepare_collectives` did not set up
is set up now (`distributed.setup_all_reduce`, a collective): every rank compiles the same
graphs in the same order, as tensor parallelism requires anyway.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..passes.fast_all_reduce import AllReduceSite, find_all_reduces, route_all_reduces
from .all_reduce_choice import FAST, NCCL
from .distributed import setup_all_reduce
from .symm_all_reduce import ALL_REDUCE_OP, GROUPS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoutedAllReduce:
    """Which all-reduce one site of a graph got (FAST or NCCL), and why."""

    site: AllReduceSite
    kind: str
    reason: str

    def __str__(self) -> str:
        shape = "[" + ", ".join(map(str, self.site.shape)) + "]"
        return (f"{self.site.node} {shape} {self.site.dtype} on group "
                f"{self.site.group_name!r}: {self.kind} ({self.reason})")


_ROUTED: list[RoutedAllReduce] = []  # this process's decisions, for all_reduce_report()


def route_graph_all_reduces(gm: torch.fx.GraphModule, device: torch.device, *,
                            configured: str) -> tuple[RoutedAllReduce, ...]:
    """Decide every all-reduce of `gm` and rewrite those that get the fast path."""
    sites = find_all_reduces(gm)
    if not sites:
        return ()
    records = tuple(RoutedAllReduce(site, *_decide(site, device, configured)) for site in sites)
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

    choice = setup_all_reduce(device, _resolve_process_group(site.group_name))
    if not choice.fast:
        return NCCL, choice.reason
    if site.dtype not in choice.dtypes:
        return NCCL, f"{site.dtype}: the symmetric-memory kernels take {', '.join(map(str, choice.dtypes))}"
    return FAST, choice.reason


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

