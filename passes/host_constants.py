"""Host data a graph copies to the device at every call, made once instead.

Two forms in a Dynamo graph copy host memory to the device at every call, which a CUDA
graph cannot replay:

  - a tensor built from literal Python data: `torch.tensor([-1], device=...)` (transformers'
    sliding-window cache builds its roll index so at every decode step), `torch.as_tensor`,
    `torch.asarray`, `x.new_tensor`;
  - indexing with a Python list: `x[..., [-2], :]` (Falcon and several MoE routers), where
    torch turns the list into an index tensor on the host and copies it over.

The first makes a split (rule `device_copy`), so no full graph; the second is invisible to
the split rule and fails the capture instead (the graph then runs piecewise). When the data
is a literal (no graph value in it), the tensor is the same at every call, so it can be made
once, at compile time, and read as a constant attribute of the graph:

    count = hoist_host_constants(gm, make=lambda fn, args, kwargs: fn(*args, **kwargs))

`make` builds the tensor (the caller's job: this module creates none). A built tensor is
hoisted only where sharing it between calls cannot be seen: nothing in the graph writes into
it or a view of it, and the graph does not return it or a view of it (the caller could write
into it). A list index always qualifies: indexing copies what it selects. The rewrite is in
place; node metadata is kept (the constant takes the built tensor's fake value).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value
from .mutation import view_base, written_args

_FROM_DATA_FUNCTIONS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_FROM_DATA_METHODS = frozenset({"new_tensor"})
ATTRIBUTE_PREFIX = "_cgcompile_host_constant_"

Make = Callable[[Callable, tuple, dict], torch.Tensor]


def hoist_host_constants(gm: GraphModule, make: Make) -> int:
    """Rewrite every hoistable host-data tensor of `gm` to a constant made by `make`; returns
    how many constants were made."""
    escaping = _written_or_returned(gm)
    count = 0
    for node in list(gm.graph.nodes):
        if _builds_from_literal(node) and node not in escaping:
            _replace_with_constant(gm, node, _builder(node), count, make)
            count += 1
        elif _indexes_with_a_list(node):
            count += _hoist_list_indices(gm, node, count, make)
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _builder(node: Node) -> tuple[Callable, tuple, dict]:
    if node.op == "call_method":  # base.new_tensor(data, ...): the base's dtype and device unless given
        base = example_value(node.args[0])
        kwargs = {"dtype": base.dtype, "device": base.device, **node.kwargs}
        return torch.tensor, tuple(node.args[1:]), kwargs
    return node.target, tuple(node.args), dict(node.kwargs)


def _builds_from_literal(node: Node) -> bool:
    if node.op == "call_method":
        builds, data, rest = node.target in _FROM_DATA_METHODS, node.args[1:2], node.args[2:]
    else:
        builds, data, rest = node.op == "call_function" and node.target in _FROM_DATA_FUNCTIONS, node.args[:1], ()
    if not builds or not data or not isinstance(example_value(node), torch.Tensor):
        return False
    return _is_literal(data[0]) and all(map(_is_literal, rest)) and all(map(_is_literal, node.kwargs.values()))


def _indexes_with_a_list(node: Node) -> bool:
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], Node):
        return False
    if not isinstance(example_value(node.args[0]), torch.Tensor):
        return False
    index = node.args[1]
    parts = index if isinstance(index, tuple) else (index,)
    return any(_is_literal_list(part) for part in parts)


def _hoist_list_indices(gm: GraphModule, node: Node, first: int, make: Make) -> int:
    source, index = node.args
    device = example_value(source).device
    parts = index if isinstance(index, tuple) else (index,)
    new_parts, made = [], 0
    for part in parts:
        if _is_literal_list(part):
            name = f"{ATTRIBUTE_PREFIX}{first + made}"
            constant = _constant_node(gm, node, name, make(torch.tensor, (part,), {"device": device}))
            new_parts.append(constant)
            made += 1
        else:
            new_parts.append(part)
    node.args = (source, tuple(new_parts) if isinstance(index, tuple) else new_parts[0])
    return made


def _replace_with_constant(gm: GraphModule, node: Node, builder: tuple, k: int, make: Make) -> None:
    fn, args, kwargs = builder
    constant = _constant_node(gm, node, f"{ATTRIBUTE_PREFIX}{k}", make(fn, args, kwargs))
    node.replace_all_uses_with(constant)
    gm.graph.erase_node(node)


def _constant_node(gm: GraphModule, before: Node, name: str, value: torch.Tensor) -> Node:
    gm.register_buffer(name, value, persistent=False)
    with gm.graph.inserting_before(before):
        constant = gm.graph.get_attr(name)
    fake_mode = _fake_mode(gm)
    constant.meta["example_value"] = fake_mode.from_tensor(value, static_shapes=True) if fake_mode else value
    return constant


def _fake_mode(gm: GraphModule):
    for node in gm.graph.nodes:
        mode = getattr(example_value(node), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _written_or_returned(gm: GraphModule) -> set[Node]:
    """Nodes whose tensor some op writes into, or the graph returns, directly or through views."""
    found = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            found |= {view_base(n) for n in node.all_input_nodes}
        else:
            found |= {view_base(n) for n in written_args(node)}
    return found


def _is_literal(value: Any) -> bool:
    """A value with no graph value inside: numbers, bools, strings, dtypes, devices, None,
    and lists or tuples of them."""
    if isinstance(value, (list, tuple)):
        return all(map(_is_literal, value))
    return isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device, type(None)))


def _is_literal_list(value: Any) -> bool:
    """A list index of plain ints or bools (possibly nested): what torch copies to the device."""
    if not isinstance(value, list) or not value:
        return False
    return all(_is_literal_list(v) if isinstance(v, list) else type(v) in (int, bool) for v in value)
