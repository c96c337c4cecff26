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

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..passes import all_reduce_norm as norm_rewrite
from ..passes import fast_all_reduce as rewrite
from . import all_reduce_choice, all_reduce_norm, fast_all_reduce, lamport_all_reduce, symm_all_reduce
from .all_reduce_choice import NCCL

log = logging.getLogger(__name__)

POST_GRAD_PASS = "post_grad_custom_post_pass"  # the Inductor option the pass goes in


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


def all_reduce_pass(options: dict[str, Any], all_reduce: str, fuse_norm: bool = True) -> RouteCompiledAllReduces | None:
    """The post-grad pass piece compiles run under where `Config.all_reduce` is not "nccl"
    (`fuse_norm`: `Config.fuse_all_reduce_norm`); None for "nccl", or where the user's
    Inductor `options` set their own post-grad pass (torch runs one): then the aten-level
    route and the fusion are off, with a warning."""
    if all_reduce == NCCL:
        return None
    if options.get(POST_GRAD_PASS) is not None:
        _warn_user_pass_kept()
        return None
    return RouteCompiledAllReduces(fuse_norm=fuse_norm)


@contextlib.contextmanager
def compiling_with(route: RouteCompiledAllReduces | None) -> Iterator[None]:
    """Inductor's config with `route` as its post-grad pass, for the compiles inside (the
    user's options, which compile_fx patches in its turn, come on top)."""
    if route is None:
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch({POST_GRAD_PASS: route}):
        yield


@functools.cache
def _warn_user_pass_kept() -> None:
    log.warning("cgcompile: inductor_options set %s, so all-reduces that only Inductor's aten graph shows "
                "(DTensor's) keep NCCL and no all-reduce is fused with the RMS norm after it; those of the "
                "Dynamo graph are still routed", POST_GRAD_PASS)
