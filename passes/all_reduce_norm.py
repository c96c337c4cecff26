"""Find all-reduces whose sum is added to a residual and RMS-normalised, and fuse each into one call.

A pre-norm decoder layer that is tensor parallel ends both halves the same way: the
row-parallel projection's partial sums are all-reduced, added to the residual stream, and the
sum is normalised for what comes next. In the aten graph Inductor compiles (its post-grad
passes) that reads, for torch's, transformers' and cgcompile's RMS norms alike:

    s   = all_reduce(x, "sum", group_name)          # the routed op, `all_reduce_target`
    h   = add(s, residual)                          # or add(residual, s)
    hf  = convert_element_type(h, float32)          # absent where h is float32
    var = mean(pow(hf, 2), [-1], keepdim=True)
    n   = mul(hf, rsqrt(add(var, eps)))
    y   = mul(weight, convert_element_type(n, h.dtype))   # either operand order; no cast for float32

`find_all_reduce_norms` reports each such chain whose intermediate values nothing else
reads (`h` may have other readers: it is the next residual); `fuse_all_reduce_norms`
replaces each by one call `target(x, residual, weight, eps, group_name) -> (h, y)`.

Pure: which op the all-reduce is and what the fused target computes are the caller's
(`cgcompile.parallel.all_reduce_norm`).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value

aten, prims = torch.ops.aten, torch.ops.prims


@dataclasses.dataclass(frozen=True)
class AllReduceNorm:
    """One all-reduce + residual add + RMS norm chain, by node names. `erased`: every node
    the fused call replaces, in graph order (the all-reduce first, the weighted norm last)."""

    all_reduce: str
    add: str
    norm: str  # the node whose value is the weighted norm
    x: str
    residual: str
    weight: str
    eps: float
    group_name: str
    dtype: torch.dtype  # the sum's, the residual's and the weight's
    shape: tuple  # the sum's (ints, or SymInts in a graph compiled for several sizes)
    erased: tuple[str, ...]


def find_all_reduce_norms(gm: GraphModule, all_reduce_target) -> list[AllReduceNorm]:
    """Every sum `all_reduce_target(x, "sum", group_name)` of `gm` that only a residual add
    and an RMS norm of the form above read, in graph order."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is all_reduce_target:
            match = _match(node, order)
            if match is not None:
                found.append(match)
    return found


def fuse_all_reduce_norms(gm: GraphModule, found: list[AllReduceNorm], target) -> int:
    """Replace each chain of `found` by `target(x, residual, weight, eps, group_name)`, whose two
    results take the places of the add and of the weighted norm. Returns how many."""
    by_name = {node.name: node for node in gm.graph.nodes}  # updated as chains are fused:
    for chain in found:  # a chain's residual may be an earlier chain's sum
        add, norm = by_name[chain.add], by_name[chain.norm]
        args = (by_name[chain.x], by_name[chain.residual], by_name[chain.weight], chain.eps, chain.group_name)
        with gm.graph.inserting_before(add):
            call = gm.graph.call_function(target, args)
            total = gm.graph.call_function(operator.getitem, (call, 0))
            normed = gm.graph.call_function(operator.getitem, (call, 1))
        call.meta["val"] = (add.meta.get("val"), norm.meta.get("val"))
        total.meta.update(add.meta)
        normed.meta.update(norm.meta)
        add.replace_all_uses_with(total)
        norm.replace_all_uses_with(normed)
        for name in reversed(chain.erased):  # readers before what they read
            gm.graph.erase_node(by_name[name])
        by_name.update({chain.add: total, chain.norm: normed})
    if found:
        gm.graph.lint()
        gm.recompile()
    return len(found)


def _match(all_reduce: Node, order: dict[Node, int]) -> AllReduceNorm | None:
    x, reduce_op, group_name = (list(all_reduce.args) + [None] * 3)[:3]
    if reduce_op != "sum" or not isinstance(x, Node) or not isinstance(group_name, str) or len(all_reduce.users) != 1:
        return None
    add = next(iter(all_reduce.users))
    if not _is(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2:
        return None
    residual = add.args[1] if add.args[0] is all_reduce else add.args[0]
    total_value, residual_value = example_value(add), example_value(residual) if isinstance(residual, Node) else None
    if not _same_layout(total_value, residual_value) or residual is all_reduce:
        return None
    dtype = total_value.dtype
    chain = [all_reduce, add]

    hf = add
    if dtype != torch.float32:  # the norm's float32 copy
        hf = _only(add, prims.convert_element_type.default, (add, torch.float32), any_users=True)
        if hf is None:
            return None
        chain.append(hf)
    readers = set(hf.users)
    square = next((u for u in readers if _is(u, aten.pow.Tensor_Scalar) and u.args == (hf, 2)), None)
    scale = next((u for u in readers if _is(u, aten.mul.Tensor) and hf in u.args), None)
    if square is None or scale is None or (readers != {square, scale} and hf is not add):
        return None
    mean = _only(square, aten.mean.dim)
    if mean is None or not _last_dim(mean, total_value.dim()) or mean.kwargs.get("dtype") is not None:
        return None
    plus_eps = _only(mean, aten.add.Tensor)
    if plus_eps is None or len(plus_eps.args) != 2 or not isinstance(plus_eps.args[1], (int, float)) or plus_eps.kwargs:
        return None
    rsqrt = _only(plus_eps, aten.rsqrt.default)
    if rsqrt is None or _sole_user(rsqrt) is not scale or set(scale.args) != {hf, rsqrt}:
        return None
    chain += [square, mean, plus_eps, rsqrt, scale]

    normed = scale
    if dtype != torch.float32:
        normed = _only(scale, prims.convert_element_type.default, (scale, dtype))
        if normed is None:
            return None
        chain.append(normed)
    out = _sole_user(normed)
    if out is None or not _is(out, aten.mul.Tensor) or len(out.args) != 2 or out.kwargs:
        return None
    weight = out.args[1] if out.args[0] is normed else out.args[0]
    weight_value = example_value(weight) if isinstance(weight, Node) else None
    hidden = total_value.shape[-1] if total_value.dim() else None
    if (not isinstance(weight_value, torch.Tensor) or weight_value.dtype != dtype or tuple(weight_value.shape) != (hidden,)
            or order[weight] > order[add] or example_value(out).shape != total_value.shape):
        return None
    # Every intermediate is read only inside the chain (the add's other readers keep its value).
    inside = set(chain) | {out}
    if any(set(n.users) - inside for n in chain if n is not add):
        return None
    return AllReduceNorm(all_reduce.name, add.name, out.name, x.name, residual.name, weight.name,
                         float(plus_eps.args[1]), group_name, dtype, tuple(total_value.shape),
                         tuple(n.name for n in chain + [out]))


def _is(node: Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def _sole_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _only(node: Node, target, args: tuple | None = None, any_users: bool = False) -> Node | None:
    """The user of `node` calling `target` (with exactly `args` where given): its sole user,
    or with `any_users` the one such user among several."""
    users = [u for u in node.users if _is(u, target) and (args is None or u.args == args)]
    if len(users) != 1 or (not any_users and len(node.users) != 1):
        return None
    return users[0]


def _last_dim(mean: Node, rank: int) -> bool:
    dims, keepdim = (list(mean.args) + [None, False])[1:3]
    keepdim = mean.kwargs.get("keepdim", keepdim)
    return keepdim is True and isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _same_layout(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.dtype in (torch.bfloat16, torch.float16, torch.float32) and a.shape == b.shape and a.dim() >= 1)
