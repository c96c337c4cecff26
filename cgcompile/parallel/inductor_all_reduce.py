"""The fast all-reduce inside Inductor's compile of a piece: a post-grad pass that routes the
all-reduces of the aten graph, those a Dynamo graph does not show.

A DTensor model (torch's `parallelize_module`, transformers' `tp_plan` with gradients on)
traces into Dynamo's graph as `redistribute`, `from_local` and `to_local` calls; the
collectives they stand for appear only when AOTAutograd dispatches the subclass, in the aten
graph Inductor compiles. `RouteCompiledAllReduces` rewrites those the way
`fast_all_reduce.route_graph_all_reduces` rewrites a Dynamo graph's, by the choice recorded
for their group (`symm_all_reduce.GROUPS`), which the Dynamo-level step made (it sets up the
groups of every device mesh a graph holds).

Why it is sound with Inductor's FX graph cache: the cache keys a compile by the pass's
`uuid()`, the hash of the sources that decide the rewrite plus every recorded group choice,
so a compile made under one choice is never served under another. The pass runs no
collective (a rank served from the cache skips it).

Pieces run eagerly (compiler="eager") keep DTensor's own dispatch, which calls the group's
NCCL all-reduce directly: there the fast path needs Inductor pieces.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..passes import all_reduce_norm as norm_rewrite
from ..passes import fast_all_reduce as rewrite
from . import all_reduce_choice, all_reduce_norm, fast_all_reduce, lamport_all_reduce, symm_all_reduce

log = logging.getLogger(__name__)


class RouteCompiledAllReduces(CustomGraphPass):
    """Inductor's post-grad pass: each sum all-reduce of the aten graph to its group's path,
    as recorded in `registry` (this process's `GROUPS` unless a test gives its own); then,
    with `fuse_norm`, each routed all-reduce that a residual add and an RMS norm follow, on a
    group with the Lamport kernel, into one call (`all_reduce_norm`)."""

    def __init__(self, registry: symm_all_reduce.GroupRegistry | None = None, fuse_norm: bool = True):
        self.registry = registry if registry is not None else symm_all_reduce.GROUPS
        self.fuse_norm = fuse_norm

    def __call__(self, graph) -> None:
        # torch hands a Graph (older releases: its GraphModule); the rewrite recompiles the module.
        gm = graph if isinstance(graph, torch.fx.GraphModule) else graph.owning_module
        fast_all_reduce.route_compiled_all_reduces(gm, self.registry.choice_of)
        if self.fuse_norm:
            all_reduce_norm.fuse_compiled_all_reduce_norms(gm, self.registry.choice_of)

    def uuid(self) -> Any:
        return (_sources_hash(), self._choices(), self.fuse_norm)

    def __repr__(self) -> str:
        # Part of cgcompile's own compile keys (`compiler.options_key`): the choices, no address.
        return f"{type(self).__name__}({self._choices()}, fuse_norm={self.fuse_norm})"

    def _choices(self) -> tuple:
        return tuple(sorted((c.group_name, c.kind, tuple(map(str, c.dtypes)), c.lamport_max_bytes)
                            for c in self.registry.choices()))


@functools.cache
def _sources_hash() -> str:
    modules = (rewrite, norm_rewrite, all_reduce_choice, all_reduce_norm, fast_all_reduce, lamport_all_reduce,
               symm_all_reduce)
    return get_hash_for_files(tuple(m.__file__ for m in modules)).hex()
