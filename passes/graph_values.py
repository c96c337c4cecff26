"""Read what Dynamo recorded about each node: its example value and what kind of value it is."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_SIZE_TYPES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, torch.Size)

def contiguous_strides(sizes, strides) -> bool:
    """Whether `strides` are the contiguous ones for `sizes` (size-1 dims' strides ignored,
    as torch's `is_contiguous` ignores them); plain ints only."""
    expected = 1
    for size, stride in reversed(list(zip(sizes, strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def free_symbols(value) -> set:
    """Sympy symbols that a fake tensor's sizes/strides or a SymInt depend on."""
    from torch.fx.experimental.symbolic_shapes import free_symbols as _free_symbols

    return set(_free_symbols(value))



# Ops that only reinterpret their input's metadata: a piece of nothing but these
# launches no kernel, so capturing it buys nothing.
VIEW_METHODS = frozenset(
    {"view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "t", "narrow",
     "select", "as_strided", "unflatten", "view_as", "expand_as", "detach"}
)
VIEW_FUNCTIONS = frozenset(
    {torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.narrow,
     torch.select, torch.t, torch.detach, operator.getitem}
)


# Ops whose result may share memory with their first argument without always being a
# view: reshape and flatten return a view when the strides allow, contiguous and the
# dtype/device conversions return the argument itself when nothing changes. A write
# through their result may reach the argument, so mutation tracking follows them.
MAY_ALIAS_METHODS = VIEW_METHODS | frozenset(
    {"reshape", "reshape_as", "flatten", "contiguous", "movedim", "moveaxis", "swapaxes", "swapdims",
     "diagonal", "unfold", "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long",
     "bool", "cuda", "cpu"}
)
MAY_ALIAS_FUNCTIONS = VIEW_FUNCTIONS | frozenset(
    {torch.reshape, torch.flatten, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims,
     torch.diagonal, torch.Tensor.contiguous, torch.Tensor.reshape, torch.Tensor.view}
)


# Reshapes in an aten (post-grad) graph: a new shape over the same values.
ATEN_RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                           torch.ops.aten.reshape.default})


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of `gm`'s graph (metadata kept), for passes that add
    inputs: Dynamo reads the placeholders of the graph it handed over after the backend returns."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def example_value(node: Node) -> Any:
    """The fake value Dynamo (`example_value`) or AOT (`val`) recorded for the node."""
    if "example_value" in node.meta:
        return node.meta["example_value"]
    return node.meta.get("val")


def meta_for_replacement(node: Node) -> dict:
    """`node`'s meta for the call of another op that replaces it: its value and the rest, but
    not `eager_input_vals`, the replaced op's inputs, which Inductor would read as the new
    op's (against the new op's schema)."""
    return {k: v for k, v in node.meta.items() if k != "eager_input_vals"}


def meta_with_value(node: Node, value: torch.Tensor) -> dict:
    """`node`'s meta (`meta_for_replacement`) for a post-grad node of another value: `val`
    and, where `node` had it, `tensor_meta` describe `value`."""
    meta = {**meta_for_replacement(node), "val": value}
    meta.pop("example_value", None)
    if "tensor_meta" in meta:
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        meta["tensor_meta"] = _extract_tensor_metadata(value)
    return meta


def replace_with_call(graph: Graph, node: Node, target, args: tuple) -> Node:
    """Put `target(*args)` where `node` is: inserted before it with its meta
    (`meta_for_replacement`), given its users, and `node` erased. Returns the new call."""
    with graph.inserting_before(node):
        call = graph.call_function(target, args)
    call.meta.update(meta_for_replacement(node))
    node.replace_all_uses_with(call)
    graph.erase_node(node)
    return call


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def wrapped_tensors(tensor: torch.Tensor, name: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the plain tensors `tensor` holds: itself, or for a traceable wrapper
    subclass (a DTensor shard, quantized weights), whose own data_ptr is 0, the inner
    tensors it flattens to, recursively ("w._local_tensor"). What it flattens to besides tensors
    (a DTensor's device mesh, from torch 2.13 on) holds no memory of its own and is left out."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        inner = ((attr, getattr(tensor, attr)) for attr in attrs)
        return [found for attr, value in inner if isinstance(value, torch.Tensor)
                for found in wrapped_tensors(value, f"{name}.{attr}")]
    return [(name, tensor)]


def address(tensor: torch.Tensor) -> int | tuple:
    """Where a tensor's memory is: its data_ptr, or for a traceable wrapper subclass (a DTensor
    shard, quantized weights), whose own data_ptr is 0, the addresses of what it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        return tuple(inner.data_ptr() for _, inner in wrapped_tensors(tensor, ""))
    return tensor.data_ptr()


def show_address(value: int | tuple) -> str:
    """An `address` in hex (a wrapper's: the addresses of what it wraps, in parentheses)."""
    return hex(value) if isinstance(value, int) else "(" + ", ".join(map(show_address, value)) + ")"


def is_size_value(value: Any) -> bool:
    """Ints, symbolic ints and `torch.Size`: values computed from shapes, not data."""
    if isinstance(value, _SIZE_TYPES):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(is_size_value(v) for v in value)


def is_view_op(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


def may_alias_first_input(node: Node) -> bool:
    """Whether `node`'s result may share memory with its first argument (see MAY_ALIAS_METHODS)."""
    if node.op == "call_method":
        return node.target in MAY_ALIAS_METHODS
    return node.op == "call_function" and node.target in MAY_ALIAS_FUNCTIONS


def storage_of(value: Any):
    """A hashable handle on the memory a fake tensor uses: views of one tensor share it."""
    if not isinstance(value, torch.Tensor):
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(value.untyped_storage())


def values_sharing_memory(values: list, owners: list[Node], exclude: list[Node] = ()) -> tuple[int, ...]:
    """Positions in `values` that are one of `owners` or share memory with one of them.

    Dynamo's fake tensors track storage like real ones: a view (made in any piece) of a
    piece's output shares that output's fake storage, so this sees aliases however many
    view ops and piece boundaries lie between them. Memory shared with a node of `exclude`
    does not count (a piece's output that views a graph input: only the output itself).
    """
    excluded = {storage_of(example_value(node)) for node in exclude}
    owned = {storage_of(example_value(node)) for node in owners} - excluded - {None}
    return tuple(i for i, node in enumerate(values)
                 if node in owners or (isinstance(node, Node) and storage_of(example_value(node)) in owned))
