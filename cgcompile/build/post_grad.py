"""Inductor's post-grad pass for piece compiles: the rewrites of the aten graph that Config turns on.

Inductor runs one custom post-grad pass (`POST_GRAD_PASS`), on every forward and backward
graph it compiles. `PostGradPass` runs, in order:

- the all-reduce route and its fusion with the residual add and RMS norm
  (`parallel.inductor_all_reduce.RouteCompiledAllReduces`, `Config.all_reduce` not "nccl");
- products of one row handed to the skinny linear ops (`Config.skinny_linears`): those that
  read the same input, 2 to 4 at a time, to one `cgcompile::grouped_skinny_linear` each
  (`passes.skinny_groups`), the rest to `cgcompile::skinny_linear` (`passes.skinny_linear`);
  then each of those single calls that reads a gated MLP's `silu(gate) * up` to
  `cgcompile::silu_mul_linear`, which makes that product as it reads it
  (`passes.silu_mul_linear`); after the all-reduce fusion, which reads the products'
  outputs whatever makes them;
- with both of those (and `Config.fuse_linear_all_reduce`), each single product that only a
  fused all-reduce reads, folded into it (`cgcompile::linear_all_reduce_add_rms_norm`,
  `passes.linear_all_reduce_norm`): the product publishes its row to the peers itself.

Why it is sound with Inductor's FX graph cache: the cache keys a compile by `uuid()`, the
hash of the sources that decide each rewrite and the all-reduce choices, so a compile made
under one set of rewrites is never served under another. Where the user's Inductor options
set their own post-grad pass, torch runs that one: cgcompile's rewrites are off, with a
warning.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..kernels import grouped_skinny_linear, silu_mul_linear, skinny_linear
from ..parallel import all_reduce_norm
from ..parallel.all_reduce_choice import NCCL
from ..parallel.inductor_all_reduce import RouteCompiledAllReduces
from ..passes import silu_mul_linear as gated_rewrite
from ..passes import skinny_groups as group_rewrite
from ..passes import linear_all_reduce_norm as fold_rewrite
from ..passes import skinny_linear as skinny_rewrite

log = logging.getLogger(__name__)

POST_GRAD_PASS = "post_grad_custom_post_pass"  # the Inductor option the pass goes in


class PostGradPass(CustomGraphPass):
    """The post-grad rewrites of one PieceCompiler. `rewritten_linears` counts the products
    handed to either skinny linear op by the compiles Inductor ran (a compile served from
    Inductor's cache runs no pass), `grouped_linears` those of them run in groups, and
    `gated_linears` those that make their gated input as they read it, and
    `folded_linears` those folded into the all-reduce after them."""

    def __init__(self, all_reduces: RouteCompiledAllReduces | None = None, skinny_linears: bool = False,
                 fold_linears: bool = False):
        self.all_reduces = all_reduces
        self.skinny_linears = skinny_linears
        # The fold reads what both rewrites leave: fused all-reduces and skinny products.
        self.fold_linears = fold_linears and skinny_linears and all_reduces is not None and all_reduces.fuse_norm
        self.rewritten_linears = 0
        self.grouped_linears = 0
        self.gated_linears = 0
        self.folded_linears = 0

    def __call__(self, graph) -> None:
        # torch hands a Graph (older releases: its GraphModule); each rewrite recompiles the module.
        gm = graph if isinstance(graph, torch.fx.GraphModule) else graph.owning_module
        if self.all_reduces is not None:
            self.all_reduces(gm)
        if self.skinny_linears:
            self._rewrite_linears(gm)
        if self.fold_linears:
            self.folded_linears += all_reduce_norm.fold_compiled_linears(gm)

    def _rewrite_linears(self, gm: torch.fx.GraphModule) -> None:
        # Groups first: the products no group takes are left for the single op.
        grouped = group_rewrite.rewrite_skinny_groups(gm, torch.ops.cgcompile.grouped_skinny_linear.default,
                                                      skinny_linear.MAX_FEATURES, grouped_skinny_linear.MAX_MEMBERS)
        single = skinny_rewrite.rewrite_skinny_linears(gm, torch.ops.cgcompile.skinny_linear.default,
                                                       skinny_linear.MAX_FEATURES)
        gated = gated_rewrite.rewrite_silu_mul_linears(gm, torch.ops.cgcompile.skinny_linear.default,
                                                       torch.ops.cgcompile.silu_mul_linear.default)
        self.grouped_linears += grouped
        self.gated_linears += gated
        self.rewritten_linears += grouped + single

    def uuid(self) -> Any:
        return (None if self.all_reduces is None else self.all_reduces.uuid(),
                _skinny_sources_hash() if self.skinny_linears else None,
                _fold_sources_hash() if self.fold_linears else None)

    def __repr__(self) -> str:
        # Part of cgcompile's own compile keys (`compiler.options_key`): no address.
        groups = grouped_skinny_linear.MAX_MEMBERS if self.skinny_linears else 0
        return (f"{type(self).__name__}({self.all_reduces!r}, skinny_linears={self.skinny_linears}, "
                f"skinny_groups={groups}, fold_linears={self.fold_linears})")


def post_grad_pass(options: dict[str, Any], all_reduce: str, fuse_norm: bool = True,
                   skinny_linears: bool = False, fold_linears: bool = False) -> PostGradPass | None:
    """The pass piece compiles run under (None: nothing to rewrite, or the user's Inductor
    `options` set their own post-grad pass)."""
    routes = all_reduce != NCCL
    if skinny_linears and not skinny_linear.triton_available():
        _note_no_triton()
        skinny_linears = False
    if not routes and not skinny_linears:
        return None
    if options.get(POST_GRAD_PASS) is not None:
        _warn_user_pass_kept()
        return None
    return PostGradPass(RouteCompiledAllReduces(fuse_norm=fuse_norm) if routes else None, skinny_linears,
                        fold_linears)


@contextlib.contextmanager
def compiling_with(rewrites: PostGradPass | None) -> Iterator[None]:
    """Inductor's config with `rewrites` as its post-grad pass, for the compiles inside (the
    user's options, which compile_fx patches in its turn, come on top)."""
    if rewrites is None:
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch({POST_GRAD_PASS: rewrites}):
        yield


@functools.cache
def _skinny_sources_hash() -> str:
    return get_hash_for_files((skinny_rewrite.__file__, group_rewrite.__file__, gated_rewrite.__file__,
                               skinny_linear.__file__, grouped_skinny_linear.__file__, silu_mul_linear.__file__)).hex()


@functools.cache
def _fold_sources_hash() -> str:
    return get_hash_for_files((fold_rewrite.__file__, all_reduce_norm.__file__)).hex()


@functools.cache
def _note_no_triton() -> None:
    log.info("cgcompile: Config.skinny_linears: triton cannot be imported, so one-row linears keep cuBLAS")


@functools.cache
def _warn_user_pass_kept() -> None:
    log.warning("cgcompile: inductor_options set %s, so cgcompile's post-grad rewrites are off: all-reduces that "
                "only Inductor's aten graph shows (DTensor's) keep NCCL, none is fused with the RMS norm after "
                "it, and one-row linears keep cuBLAS (Config.skinny_linears); the Dynamo graph's all-reduces "
                "are still routed", POST_GRAD_PASS)
