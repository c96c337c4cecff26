"""Find a graph's functional all-reduces and route chosen ones to another all-reduce op.

Tensor-parallel models reach Dynamo's graph through torch.distributed's functional
collectives; DTensor models reach the aten graph AOTAutograd hands Inductor the same way
(a `redistribute` from Partial to Replicate dispatches to the same two ops), so the functions
here read either graph. `funcol.all_reduce(x, "sum", group)` traces as two nodes:

    ar = _c10d_functional.all_reduce(x, "sum", group_name)   # starts the collective
    y = _c10d_functional.wait_tensor(ar)                     # every user reads y

and `dist.all_reduce(x)` (Dynamo remaps it to `funcol.all_reduce_inplace`) as the same two
nodes followed by `x.copy_(y)`. `find_all_reduces` reports every such pair, with why a
pair cannot be routed (a non-sum reduction, an in-place `all_reduce_`, a result read
before its wait); `route_all_reduces` replaces the pairs it is given by one call
`target(x, reduce_op, group_name)` whose result every user of the wait then reads.

Pure: the caller decides which sites to route and names the op (cgcompile's
`cgcompile::all_reduce`, see `cgcompile.parallel.symm_all_reduce`); nothing here knows
about process groups or GPUs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value, replace_with_call

ALL_REDUCE = "_c10d_functional::all_reduce"
ALL_REDUCE_INPLACE = "_c10d_functional::all_reduce_"
WAIT = "_c10d_functional::wait_tensor"


@dataclasses.dataclass(frozen=True)
class AllReduceSite:
    """One functional all-reduce of a graph and the wait that ends it.

    blocker: why the pair cannot be routed (None: it can). shape, dtype and device are the
    traced input's (sizes may be symbolic: the bytes are known only per capture size)."""

    node: str
    wait: str | None
    reduce_op: str
    group_name: str
    shape: tuple
    dtype: torch.dtype | None
    blocker: str | None = None
    device: torch.device | None = None


def op_name(node: Node) -> str:
    """"namespace::name" of an op node's target ("" for anything else)."""
    if node.op != "call_function":
        return ""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(node.target, "_qualified_op_name", "")


def find_all_reduces(gm: GraphModule) -> list[AllReduceSite]:
    """Every functional all-reduce of `gm`, in graph order."""
    return [_site(node) for node in gm.graph.nodes if op_name(node) in (ALL_REDUCE, ALL_REDUCE_INPLACE)]


def _site(node: Node) -> AllReduceSite:
    x, reduce_op, group_name = (list(node.args) + [None] * 3)[:3]
    reduce_op = node.kwargs.get("reduce_op", reduce_op)
    group_name = node.kwargs.get("group_name", group_name)
    value = example_value(x) if isinstance(x, Node) else None
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    dtype, device = (value.dtype, value.device) if isinstance(value, torch.Tensor) else (None, None)
    waits = [u for u in node.users if op_name(u) == WAIT]
    site = AllReduceSite(node.name, waits[0].name if len(waits) == 1 else None, str(reduce_op).lower(),
                         str(group_name), shape, dtype, device=device)
    return dataclasses.replace(site, blocker=_blocker(node, waits, site))


def _blocker(node: Node, waits: list[Node], site: AllReduceSite) -> str | None:
    if op_name(node) == ALL_REDUCE_INPLACE:
        return "an in-place all_reduce_ (its input is its result)"
    if site.reduce_op != "sum":
        return f"reduce op {site.reduce_op!r}: only sums are routed"
    if len(waits) != 1 or len(node.users) != 1:
        return "its result is read other than through one wait_tensor"
    if site.dtype is None:
        return "its input has no traced tensor value"
    value = example_value(node.args[0])
    if value.requires_grad:
        return "its input requires grad (the routed op has no backward)"
    return None


def route_all_reduces(gm: GraphModule, sites: list[AllReduceSite], target: Callable) -> int:
    """Replace each routable site's all-reduce and wait by `target(x, reduce_op, group_name)`.

    Returns how many pairs were replaced. The new node takes the wait's place in the
    graph (so nothing between the collective and its wait moves) and its metadata (the
    result has the wait's value: same shape, dtype and layout as the input). `gm` may be a
    Dynamo graph or the aten graph of an Inductor compile (its post-grad passes)."""
    by_name = {node.name: node for node in gm.graph.nodes}
    routed = 0
    for site in sites:
        if site.blocker is not None:
            continue
        start, wait = by_name[site.node], by_name[site.wait]
        replace_with_call(gm.graph, wait, target, (start.args[0], site.reduce_op, site.group_name))  # the wait's value
        gm.graph.erase_node(start)
        routed += 1
    if routed:
        gm.graph.lint()
        gm.recompile()
    return routed
