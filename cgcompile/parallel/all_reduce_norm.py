"""The all-reduce fused with the residual add and RMS norm after it, at decode sizes.

    total, normed = torch.ops.cgcompile.all_reduce_add_rms_norm(x, residual, weight, eps, group_name)
    # total = all_reduce(x) + residual; normed = weight * rms_norm(total, eps), rounded as the graph rounds

Both halves of a tensor-parallel pre-norm layer end this way (`passes.all_reduce_norm`). At
decode each of the three steps is one small, latency-bound kernel; fused under the Lamport
protocol (`lamport_add_rms_norm_kernel`, one program a row, on a buffer of its own:
`LamportNormBuffer`), the sum, the add and the norm are one kernel, and the row never leaves
the program between them.

Where it applies: inside Inductor's compile of a piece, the post-grad pass
(`inductor_all_reduce.RouteCompiledAllReduces`) fuses the chains of routed all-reduces whose
group runs the Lamport kernel (`Config.all_reduce="auto"`), unless
`Config.fuse_all_reduce_norm` is off, and only in a compile whose sizes are fixed and which the
kernel takes (`why_not_fused`: up to 8 rows, a hidden size up to 8192, within the group's
Lamport byte limit): a decode step's graph of one row (Dynamo specialises sizes of 1), a
graph compiled with `dynamic=False`, a `compile_sizes` compile. Per call (at capture: replays
run no Python) the op runs the fused kernel where it takes the call
(`LamportNormBuffer.problem`, which also checks contiguity and alignment); any other call runs
the group's all-reduce (`cgcompile::all_reduce`: one-shot, two-shot or NCCL) and then the add
and the norm as torch ops, the graph's own arithmetic.

The product before it. Where the fused call's input is a one-row product on the skinny
kernels that nothing else reads (a batch-1 step's output and down projections), the same
pass can fold the product into the call (`Config.fuse_linear_all_reduce`, off by default,
`cgcompile::linear_all_reduce_add_rms_norm`): the product's programs store their blocks of
the row straight into every rank's slot (`linear_publish_kernel`), and the second launch
only gathers, adds and normalises. That takes the fused kernel's read of the row and its
publishing step, with the hand-off between the two launches before them, off each
all-reduce's path; the sums are the fused kernel's, bit for bit. A call the two kernels
cannot take runs the product op, then the fused op.
"""

from __future__ import annotations

import logging
import math

import torch

from ..kernels import silu_mul_linear, skinny_linear  # noqa: F401  (the product ops the fold reads)
from ..passes.all_reduce_norm import find_all_reduce_norms, fuse_all_reduce_norms
from ..passes.linear_all_reduce_norm import find_linear_all_reduce_norms, fold_linear_all_reduce_norms
from .all_reduce_choice import AllReduceChoice
from .lamport_all_reduce import norm_shape_problem
from .symm_all_reduce import ALL_REDUCE_OP, GROUPS

log = logging.getLogger(__name__)

LAMPORT_ADD_RMS_NORM = "lamport_add_rms_norm"  # a per-call kind in `all_reduce_report().calls`


@torch.library.custom_op("cgcompile::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_reduce(x) + residual, weight * rms_norm(that)), by the fused kernel where it takes the call."""
    group = GROUPS.get(group_name)
    buffer = group.lamport_norm.get(x.dtype) if group is not None else None
    if buffer is not None and buffer.problem(x, residual, weight, group.choice.lamport_max_bytes) is None:
        group.calls[LAMPORT_ADD_RMS_NORM] += 1
        return buffer.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm(torch.ops.cgcompile.all_reduce(x, "sum", group_name), residual, weight, eps)


@all_reduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)


def add_rms_norm(total: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused arithmetic the rewrite matched, as torch ops (the op's path for calls the
    kernel does not take, and the tests' reference)."""
    added = total + residual
    wide = added.float()
    return added, weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(added.dtype)


FUSED_OP = torch.ops.cgcompile.all_reduce_add_rms_norm.default

LAMPORT_LINEAR_ADD_RMS_NORM = "lamport_linear_add_rms_norm"  # a per-call kind in `all_reduce_report().calls`


@torch.library.custom_op("cgcompile::linear_all_reduce_add_rms_norm", mutates_args=())
def linear_all_reduce_add_rms_norm(x: torch.Tensor, up: torch.Tensor | None, matrix: torch.Tensor,
                                   bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_reduce_add_rms_norm` of the one-row product `F.linear(x', matrix, bias)`, x' being
    x or, where `up` is given, silu(x) * up: the product publishes its row into the Lamport
    slots itself where `LamportNormBuffer.linear_problem` allows, else the product op and
    the fused op run as they would apart."""
    group = GROUPS.get(group_name)
    buffer = group.lamport_norm.get(residual.dtype) if group is not None else None
    if buffer is not None and buffer.linear_problem(x, up, matrix, bias, residual, weight,
                                                    group.choice.lamport_max_bytes) is None:
        group.calls[LAMPORT_LINEAR_ADD_RMS_NORM] += 1
        return buffer.linear_add_rms_norm(x, up, matrix, bias, residual, weight, eps)
    if up is None:
        product = torch.ops.cgcompile.skinny_linear(x, matrix, bias)
    else:
        product = torch.ops.cgcompile.silu_mul_linear(x, up, matrix, bias)
    return all_reduce_add_rms_norm(product.view(residual.shape), residual, weight, eps, group_name)


@linear_all_reduce_add_rms_norm.register_fake
def _(x, up, matrix, bias, residual, weight, eps, group_name):
    return torch.empty_like(residual), torch.empty_like(residual)


LINEAR_FUSED_OP = torch.ops.cgcompile.linear_all_reduce_add_rms_norm.default


def fold_compiled_linears(gm: torch.fx.GraphModule) -> int:
    """Fold, in an aten graph inside an Inductor compile, each one-row product that only a
    fused all-reduce + add + norm reads into that call (`passes.linear_all_reduce_norm`): the
    product then publishes its row into the peers' Lamport slots itself, and the all-reduce's
    launch only gathers. Runs after the skinny linear rewrites. Returns how many."""
    found = find_linear_all_reduce_norms(gm, FUSED_OP, torch.ops.cgcompile.skinny_linear.default,
                                         torch.ops.cgcompile.silu_mul_linear.default)
    for match in found:
        log.info("cgcompile: product %s folded into the all-reduce, residual add and RMS norm %s",
                 match.product, match.fused)
    return fold_linear_all_reduce_norms(gm, found, LINEAR_FUSED_OP)


def fuse_compiled_all_reduce_norms(gm: torch.fx.GraphModule, choice_of) -> int:
    """Fuse, in an aten graph inside an Inductor compile, every routed all-reduce + residual
    add + RMS norm that the fused kernel will run at every call (`why_not_fused`). Runs no
    collective. Returns how many were fused."""
    found = []
    for chain in find_all_reduce_norms(gm, ALL_REDUCE_OP):
        why = why_not_fused(choice_of(chain.group_name), chain.dtype, chain.shape)
        if why is None:
            found.append(chain)
            log.info("cgcompile: all-reduce %s on group %r fused with the residual add %s and the RMS norm %s",
                     chain.all_reduce, chain.group_name, chain.add, chain.norm)
        else:
            log.info("cgcompile: all-reduce %s on group %r not fused with the RMS norm after it: %s",
                     chain.all_reduce, chain.group_name, why)
    return fuse_all_reduce_norms(gm, found, FUSED_OP)


def why_not_fused(choice: AllReduceChoice | None, dtype: torch.dtype, shape: tuple) -> str | None:
    """Why a chain of this group, dtype and shape keeps its three steps (None: fuse it).

    Only shapes the compile fixes are fused, and only where the kernel takes them: a graph
    compiled for several sizes would send its larger calls down the op's unfused path, whose
    torch ops cost more kernels than Inductor's own fused add and norm."""
    if choice is None or not choice.lamport:
        return "its group does not run the Lamport kernel"
    if dtype not in choice.dtypes:
        return f"{dtype}: the kernel takes {', '.join(map(str, choice.dtypes))}"
    if not all(isinstance(d, int) for d in shape):
        return f"sizes {list(shape)} are not fixed by this compile"
    return norm_shape_problem(math.prod(shape[:-1]), shape[-1], torch.empty((), dtype=dtype).element_size(),
                              choice.lamport_max_bytes)
