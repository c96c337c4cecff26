"""Which tensors an op writes into, and which graph inputs a graph writes: the one answer
that the split rule, the padding-safety pass, the full-graph plan and the runtime's
capture undo all use.

An op writes into:
  - its first argument when it is an in-place method (`x.add_(y)`) or operator
    (`x += y`, `x[i] = y`; Dynamo keeps `operator.iadd` and `operator.setitem`);
  - each argument its schema marks written (`Tensor(a!)`): a cache update writes keys and
    values; a custom op may write several;
  - its `out=` tensor (`torch.add(x, 1, out=buf)`, which Dynamo keeps as it is);
  - its first argument when it is a function called with `inplace=True`, by keyword or
    by position (`F.relu(x, inplace=True)`, `F.hardswish(x, True)`: Dynamo keeps the
    functional call of `nn.ReLU(inplace=True)` as it is).

A write reaches the tensor a chain of views starts from (`view_base`): views, and ops
such as reshape or contiguous that may return their argument or a view of it
(`graph_values.MAY_ALIAS_METHODS`).
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value, may_alias_first_input

_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul,
})
_TUPLE_OF_VIEWS = frozenset({"chunk", "split", "unbind", "tensor_split", "split_with_sizes", "unsafe_split"})


def written_inputs(gm: GraphModule) -> tuple[int, ...]:
    """Positions of the placeholders of `gm` that some op writes into, directly or through
    a view: the inputs a run of `gm` changes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {view_base(target) for node in gm.graph.nodes for target in written_args(node)}
    return tuple(i for i, node in enumerate(placeholders) if node in written)


def written_args(node: Node) -> list[Node]:
    """Every tensor argument `node` writes into (see the module docstring), once each."""
    if node.op not in ("call_function", "call_method"):
        return []
    written = [in_place_target(node)]
    schema = _schema(node)
    if schema is not None:
        written += [value for arg, value in zip(schema.arguments, node.args) if _writes(arg)]
        written += [node.kwargs[arg.name] for arg in schema.arguments if _writes(arg) and arg.name in node.kwargs]
    written.append(node.kwargs.get("out"))
    return list(dict.fromkeys(value for value in written if isinstance(value, Node)))


def in_place_target(node: Node) -> Any:
    """The argument an in-place op writes into first (its only one, but for ops whose
    schema marks several): the first argument of an in-place method or operator, or the
    first positional argument its schema marks written; None for other ops."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.args[0]
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        # x += y on a tensor writes into x (Dynamo keeps operator.iadd for it)
        target = node.args[0]
        if node.target is operator.setitem or isinstance(example_value(target), torch.Tensor):
            return target
    if node.op == "call_function" and _called_in_place(node):
        return node.args[0] if node.args else None
    schema = _schema(node)
    if schema is not None:
        for arg, value in zip(schema.arguments, node.args):
            if _writes(arg):
                return value
    return None


def _called_in_place(node: Node) -> bool:
    """A function with an `inplace` parameter called with it true (`F.relu(x, inplace=True)`)."""
    if node.kwargs.get("inplace") is True:
        return True
    position = _inplace_position(node.target)
    return position is not None and len(node.args) > position and node.args[position] is True


@functools.lru_cache(maxsize=None)
def _inplace_position(target) -> int | None:
    """Where `inplace` sits among `target`'s positional parameters, or None."""
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # builtins and ops without a Python signature
        return None
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names.index("inplace") if "inplace" in names else None


def mutated_base(node: Node) -> tuple[Any, Node | None]:
    """(the argument an in-place op writes into, the tensor it is a view of), or (None, None)."""
    target = in_place_target(node)
    if not isinstance(target, Node):
        return None, None
    return target, view_base(target)


def view_base(node: Node) -> Node:
    """The tensor a chain of views starts from."""
    while (parent := view_parent(node)) is not None:
        node = parent
    return node


def view_parent(node: Node) -> Node | None:
    """The tensor `node` is (or may be) a view of, or None: views, and ops such as reshape
    that return one when they can. An element of a tuple of views (chunk, split, unbind)
    is a view of what they split; of any other tuple, of nothing."""
    if not (may_alias_first_input(node) or _is_tuple_of_views(node)) or not node.args or not isinstance(node.args[0], Node):
        return None
    if node.target is operator.getitem and _indexes_by_tensor(node.args[1:2]):
        return None  # table[ids] gathers into a new tensor
    parent = node.args[0]
    if isinstance(example_value(parent), torch.Tensor):
        return parent
    return parent if _is_tuple_of_views(parent) else None


def _writes(arg) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


def _schema(node: Node):
    schema = getattr(node.target, "_schema", None)
    if schema is None and isinstance(node.target, torch._ops.OpOverloadPacket) and "default" in node.target.overloads():
        schema = node.target.default._schema  # Dynamo records torch.ops.ns.op as the packet
    return schema


def _indexes_by_tensor(index) -> bool:
    if isinstance(index, Node):
        return isinstance(example_value(index), torch.Tensor)
    if isinstance(index, (tuple, list)):
        return any(_indexes_by_tensor(i) for i in index)
    return False


def _is_tuple_of_views(node: Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return node.op in ("call_method", "call_function") and name in _TUPLE_OF_VIEWS
