"""Find the one-row products whose only reader is a fused all-reduce + residual add + RMS norm,
and fold each into that call.

A tensor-parallel layer's row-parallel projection (attention's output projection, the MLP's
down projection) makes partial sums that only the all-reduce reads. After the all-reduce
fusion (`passes.all_reduce_norm`) and the skinny linear rewrites (`passes.skinny_linear`,
`passes.silu_mul_linear`), Inductor's post-grad graph reads:

    y = linear(x, w, bias)            # or gated(gate, up, w, bias)
    y = view(y, shape)                # none or more views, each y's only reader
    h, n = fused(y, residual, weight, eps, group_name)

`find_linear_all_reduce_norms` lists each such pair where nothing impure runs between the
product and the fused call (the product moves to the call's place, so nothing may write
what it reads in between); `fold_linear_all_reduce_norms` replaces each with one call
`target(x, up, w, bias, residual, weight, eps, group_name) -> (h, n)`, `up` None for a plain
product. `target` must compute what the pair did.

Pure: which ops the product and the fused call are, and what the target computes, are the
caller's (`cgcompile.parallel.all_reduce_norm`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule, Node

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


@dataclasses.dataclass(frozen=True)
class LinearAllReduceNorm:
    """One product and the fused call that alone reads it."""

    fused: Node
    product: Node
    views: tuple[Node, ...]  # between them, the product's reader first
    x: Node  # the product's input row (the gate, for a gated product)
    up: Node | None
    weight: Node
    bias: Node | None


def find_linear_all_reduce_norms(gm: GraphModule, fused_target, linear_target, gated_target) -> list[LinearAllReduceNorm]:
    """Every `fused_target` call of `gm` whose input only a `linear_target(x, w, bias)` or
    `gated_target(gate, up, w, bias)` call makes, through views that nothing else reads."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    found = []
    for node in nodes:
        if node.op != "call_function" or node.target is not fused_target or node.kwargs:
            continue
        views, value = [], node.args[0]
        while isinstance(value, Node) and value.op == "call_function" and value.target in _VIEWS and len(value.users) == 1:
            views.append(value)
            value = value.args[0]
        if not isinstance(value, Node) or value.op != "call_function" or len(value.users) != 1 or value.kwargs:
            continue
        operands = _product_operands(value, linear_target, gated_target)
        if operands is None or any(n.is_impure() for n in nodes[order[value] + 1:order[node]]):
            continue
        found.append(LinearAllReduceNorm(node, value, tuple(reversed(views)), *operands))
    return found


def fold_linear_all_reduce_norms(gm: GraphModule, found: list[LinearAllReduceNorm], target) -> int:
    """Replace each pair of `found` with `target(x, up, w, bias, residual, weight, eps,
    group_name)`, whose results take the fused call's place. Returns how many."""
    graph = gm.graph
    for match in found:
        _, residual, weight, eps, group_name = match.fused.args
        with graph.inserting_before(match.fused):
            call = graph.call_function(target, (match.x, match.up, match.weight, match.bias, residual, weight, eps,
                                                 group_name))
        call.meta.update(match.fused.meta)
        match.fused.replace_all_uses_with(call)
        graph.erase_node(match.fused)
        for node in (*reversed(match.views), match.product):  # readers before what they read
            graph.erase_node(node)
    if found:
        graph.lint()
        gm.recompile()
    return len(found)


def _product_operands(node: Node, linear_target, gated_target) -> tuple | None:
    """(x, up, weight, bias) of a product call, or None for any other node."""
    if node.target is linear_target and len(node.args) in (2, 3):
        x, weight, bias = (*node.args, None)[:3]
        return x, None, weight, bias
    if node.target is gated_target and len(node.args) in (3, 4):
        gate, up, weight, bias = (*node.args, None)[:4]
        return gate, up, weight, bias
    return None
