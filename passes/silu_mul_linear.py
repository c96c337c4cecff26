"""A gated MLP's `silu(gate) * up` handed to the one-row linear that reads it.

Llama-style MLPs compute `down(silu(gate) * up)`. In Inductor's post-grad graph, once the
one-row products are skinny linear calls (`passes.skinny_linear`), that reads

    prod = mul(silu(g), u)            # either operand order; g, u: [..., K], one row
    y = linear(reshape(prod), w, b)   # any chain of view/_unsafe_view/reshape, or none

where `silu(g)` is the op itself or one of its decompositions: Inductor's own, in float32
between two dtype conversions, `g32 / (1 + exp(-g32))`, or the core one, `g32 * sigmoid(g32)`.

`find_silu_mul_linears(gm, linear)` lists the calls of the `linear` op whose input is
such a product and nothing else reads the product, its SiLU or the reshapes between, and
no node between the product and the call writes to memory (`Node.is_impure`: the new call
reads g and u where the call was, later than the product did);
`rewrite_silu_mul_linears(gm, linear, gated)` replaces each with `gated(g, u, w, b)`, which
must compute `F.linear(F.silu(g) * u, w, b)` (to rounding) in the shape [..., N] of g's
leading dims, viewed back to the call's shape where that differs, and removes the product
and what fed only it. Everything is read from the nodes' fake values: g and u must be one
row of the same shape and dtype, their last dim w's K.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import GraphModule, Node

from .graph_values import ATEN_RESHAPES, example_value, meta_with_value

_aten = torch.ops.aten
_CONVERT = torch.ops.prims.convert_element_type.default


@dataclasses.dataclass(frozen=True)
class SiluMulLinear:
    """One linear call of the graph whose input is silu(gate) * up."""

    call: Node  # linear(x, w, b)
    product: Node  # silu(gate) * up
    gate: Node
    up: Node
    chain: tuple[Node, ...]  # what only the call reads: the reshapes, the product, the SiLU's nodes


def find_silu_mul_linears(gm: GraphModule, linear) -> list[SiluMulLinear]:
    """The calls `rewrite_silu_mul_linears` replaces, in graph order."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    found = []
    for node in nodes:
        match = _as_gated(node, linear)
        if match is not None and not any(n.is_impure() for n in nodes[order[match.product] + 1:order[node]]):
            found.append(match)
    return found


def rewrite_silu_mul_linears(gm: GraphModule, linear, gated) -> int:
    """Replace each call `find_silu_mul_linears` lists with `gated(gate, up, w, b)`; the
    number replaced."""
    graph = gm.graph
    found = find_silu_mul_linears(gm, linear)
    for match in found:
        call = match.call
        _, weight, bias = _operands(call)
        gate_value = example_value(match.gate)
        value = gate_value.new_empty((*gate_value.shape[:-1], example_value(weight).shape[0]))
        with graph.inserting_before(call):
            fused = graph.call_function(gated, (match.gate, match.up, weight, bias))
            fused.meta.update(meta_with_value(call, value))
            result = fused
            shape = list(example_value(call).shape)
            if list(value.shape) != shape:
                result = graph.call_function(_aten.view.default, (fused, shape))
                result.meta.update(meta_with_value(call, _aten.view.default(value, shape)))
        call.replace_all_uses_with(result)
        graph.erase_node(call)
        for node in match.chain:  # nearest the call first: each has no user left when reached
            graph.erase_node(node)
    if found:
        graph.lint()
        gm.recompile()
    return len(found)


def _operands(call: Node) -> tuple[Node, Node, Node | None]:
    x, weight, *rest = call.args
    return x, weight, (rest[0] if rest else call.kwargs.get("bias"))


def _as_gated(node: Node, linear) -> SiluMulLinear | None:
    if node.op != "call_function" or node.target is not linear:
        return None
    x, weight, _ = _operands(node)
    chain = []
    while isinstance(x, Node) and x.target in ATEN_RESHAPES and len(x.users) == 1:
        chain.append(x)
        x = x.args[0]
    if not (isinstance(x, Node) and x.target is _aten.mul.Tensor and len(x.users) == 1 and len(x.args) == 2):
        return None
    product = x
    for silu, up in (product.args, tuple(reversed(product.args))):
        if not (isinstance(silu, Node) and isinstance(up, Node)) or up is silu or len(silu.users) != 1:
            continue
        found = _silu_of(silu)
        if found is not None and _fits(found[0], up, weight):
            gate, nodes = found
            return SiluMulLinear(node, product, gate, up, (*chain, product, *nodes))
    return None


def _silu_of(node: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(g, the nodes that compute silu(g) from `node` back, each before what it reads), or None."""
    if node.target is _aten.silu.default:
        return (node.args[0], (node,)) if isinstance(node.args[0], Node) else None
    if _cast(node) is None:
        return None
    nodes = _decomposed_silu(node.args[0])
    return None if nodes is None else (nodes[-1].args[0], (node, *nodes))


def _decomposed_silu(top: Node) -> tuple[Node, ...] | None:
    """The nodes of `top` = g32 / (1 + exp(-g32)) or g32 * sigmoid(g32), from `top` to
    g32 = convert(g, float32), where nothing else reads them; else None."""
    if len(top.users) != 1 or len(top.args) != 2 or not all(isinstance(a, Node) for a in top.args):
        return None
    if top.target is _aten.div.Tensor:
        g32, add = top.args
        exp = _sole_input(add, _aten.add.Tensor, top, other=1)
        neg = _sole_input(exp, _aten.exp.default, add)
        nodes = (top, add, exp, neg)
        if _sole_input(neg, _aten.neg.default, exp) is not g32:
            return None
    elif top.target is _aten.mul.Tensor:
        sigmoid = next((a for a in top.args if a.target is _aten.sigmoid.default), None)
        g32 = top.args[0] if top.args[1] is sigmoid else top.args[1]
        if sigmoid is None or _sole_input(sigmoid, _aten.sigmoid.default, top) is not g32:
            return None
        nodes = (top, sigmoid)
    else:
        return None
    if _cast(g32) is not torch.float32 or set(g32.users) != {top, nodes[-1]}:
        return None
    return (*nodes, g32)


def _cast(node) -> torch.dtype | None:
    """The dtype `node` converts a Node to (Inductor's `convert_element_type`, or `_to_copy`
    of a dtype alone), or None where it is no such conversion."""
    if not (isinstance(node, Node) and node.args and isinstance(node.args[0], Node)):
        return None
    if node.target is _CONVERT and len(node.args) == 2 and not node.kwargs:
        return node.args[1]
    if node.target is _aten._to_copy.default and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _sole_input(node, target, user: Node, other=None):
    """`node`'s one Node input where `node` is `target` of it (and of `other`, in either order)
    read by `user` alone; else None."""
    if not (isinstance(node, Node) and node.target is target and set(node.users) == {user}):
        return None
    args = list(node.args)
    if other is not None:
        if len(args) != 2 or other not in args:
            return None
        args.remove(other)
    return args[0] if len(args) == 1 and isinstance(args[0], Node) else None


def _fits(gate: Node, up: Node, weight: Node) -> bool:
    g, u, w = example_value(gate), example_value(up), example_value(weight)
    if not all(isinstance(t, torch.Tensor) for t in (g, u, w)) or g.dim() == 0:
        return False
    if tuple(g.shape) != tuple(u.shape) or g.dtype != u.dtype or g.device != u.device:
        return False
    if not all(type(s) is int for s in (*g.shape, *w.shape)):
        return False
    return g.shape[-1] == w.shape[-1] and math.prod(g.shape) == g.shape[-1]
