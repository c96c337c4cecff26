"""Matrix products of one row in Inductor's post-grad graph, found and handed to a linear op.

A linear reaches Inductor's post-grad (aten) graph as `mm(x, permute(w, [1, 0]))`, or
`addmm(bias, x, permute(w, [1, 0]))`, with `x` of shape [M, K] and `w` [N, K]. Where M is
1 (a batch-1 decode step) the product reads all of `w` for one output per feature, and a
kernel made for that reads it faster than cuBLAS's matrix kernels.

`find_skinny_linears(gm, max_features)` lists the products whose `x` has one row (a static
size: a symbolic row count is left alone), in bf16 or fp16 on CUDA, with `w` a matrix of
at most `max_features` rows (output features) and unit stride along K, and a bias, if
any, of shape [N];
`rewrite_skinny_linears(gm, target, max_features)` replaces each with
`target(x, w, bias)`, which must compute `x @ w.T + bias` as the product would (to
rounding). Everything is read from the nodes' fake values, so it runs on any post-grad
graph and changes nothing it cannot see.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value, replace_with_call
from .matvec_reduction import HALF_DTYPES
_aten = torch.ops.aten
_TRANSPOSES = (_aten.permute.default, _aten.t.default)


@dataclasses.dataclass(frozen=True)
class SkinnyLinear:
    """One product of the graph that a skinny linear op can take."""

    product: Node  # the mm or addmm
    x: Node  # [M, K]
    weight: Node  # [N, K]
    bias: Node | None  # [N]


def find_skinny_linears(gm: GraphModule, max_features: int) -> list[SkinnyLinear]:
    """The products of `gm` that `rewrite_skinny_linears` replaces, in graph order."""
    found = []
    for node in gm.graph.nodes:
        match = _as_linear(node)
        if match is not None and _fits(match, max_features):
            found.append(match)
    return found


def rewrite_skinny_linears(gm: GraphModule, target, max_features: int) -> int:
    """Replace each product `find_skinny_linears` lists with `target(x, weight, bias)`; the
    number replaced. Transposes left without users are removed. One walk in graph order, each
    product read when it is reached: a product fed by one replaced before it reads the new call."""
    count = 0
    for node in list(gm.graph.nodes):
        match = _as_linear(node)
        if match is None or not _fits(match, max_features):
            continue
        transpose = node.args[-1]
        replace_with_call(gm.graph, node, target, (match.x, match.weight, match.bias))
        if not transpose.users:
            gm.graph.erase_node(transpose)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _as_linear(node: Node) -> SkinnyLinear | None:
    """`node` read as x @ w.T (+ bias), or None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is _aten.mm.default and len(node.args) == 2:
        bias, (x, transposed) = None, node.args
    elif node.target is _aten.addmm.default and len(node.args) == 3:
        bias, x, transposed = node.args
    else:
        return None
    if not (isinstance(transposed, Node) and transposed.target in _TRANSPOSES and isinstance(x, Node)):
        return None
    if transposed.target is _aten.permute.default and list(transposed.args[1]) != [1, 0]:
        return None
    weight = transposed.args[0]
    if not isinstance(weight, Node) or (bias is not None and not isinstance(bias, Node)):
        return None
    return SkinnyLinear(node, x, weight, bias)


def _fits(match: SkinnyLinear, max_features: int) -> bool:
    x, w = example_value(match.x), example_value(match.weight)
    bias = example_value(match.bias) if match.bias is not None else None
    if not _plain(x) or not _plain(w) or x.dim() != 2 or w.dim() != 2:
        return False
    if x.device.type != "cuda" or x.dtype not in HALF_DTYPES or w.dtype != x.dtype or w.device != x.device:
        return False
    if not all(type(s) is int for s in (*x.shape, *w.shape)) or x.shape[0] != 1 or w.shape[0] > max_features:
        return False
    if w.stride(1) != 1:
        return False
    if match.bias is not None:  # [N]: a bias addmm would broadcast is left to addmm
        if not _plain(bias) or tuple(bias.shape) != (w.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1:
            return False
    return True


def _plain(value) -> bool:
    """A tensor value (fake), not a subclass whose layout the op would have to keep."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value)
