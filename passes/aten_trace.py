"""Trace one torch-level call of a Dynamo graph down to core ATen ops, on its fake values.

Dynamo's graphs hold torch-level calls (`F.hardswish(x)`, `torch.prelu(x, w)`, `x.silu()`);
what an op does to its elements is written on ATen overloads, as tags such as
`torch.Tag.pointwise`, and an op without the tag (hardswish, prelu) decomposes into ops
that have it. Tracing the call with `make_fx` on the fake values Dynamo recorded gives
exactly the overloads it dispatches to, with the graph's own size symbols in their values,
so a pass can judge each of them with the rule it uses for the graph's nodes.

Only torch's own functions, methods and modules are traced: a user function in the graph
(`allow_in_graph`) may have side effects that a trace would run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from .graph_values import example_value


@dataclasses.dataclass(frozen=True)
class AtenTrace:
    """`gm`: the call in core ATen ops; its placeholders are the tensors of `sources` (nodes
    of the traced graph), in order. Every node's `meta["val"]` holds its fake value, in the
    size symbols of the graph the call belongs to."""

    gm: GraphModule
    sources: tuple[Node, ...]


def trace_to_aten(node: Node) -> AtenTrace | str:
    """The core ATen graph of `node`'s call on its example values, or why there is none."""
    fn = _torch_callable(node)
    if fn is None:
        return "it is not one of torch's own ops"
    if any(example_value(a) is None for a in node.all_input_nodes):
        return "an argument has no recorded value to trace it with"
    # Nodes are pytree leaves: each tensor leaf's node is the placeholder's source.
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    flat = [example_value(v) if isinstance(v, Node) else v for v in leaves]
    positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode([flat[i] for i in positions])
    if fake_mode is None:
        return "it has no fake tensor arguments to trace it with"

    def call(*tensors):
        values = list(flat)
        for i, t in zip(positions, tensors):
            values[i] = t
        a, k = pytree.tree_unflatten(values, spec)
        return fn(*a, **k)

    gm = _trace(call, [flat[i] for i in positions], fake_mode.shape_env)
    return gm if isinstance(gm, str) else AtenTrace(gm, tuple(leaves[i] for i in positions))


def _trace(call: Callable, tensors: list, shape_env) -> GraphModule | str:
    from torch.fx.experimental.proxy_tensor import make_fx

    guards = len(shape_env.guards) if shape_env is not None else 0
    try:
        gm = make_fx(call, decomposition_table=_decompositions(), tracing_mode="fake")(*tensors)
    except Exception as e:  # noqa: BLE001 - any failure only means "not proven"
        return f"tracing it to ATen failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if shape_env is not None and len(shape_env.guards) != guards:
        # Its decomposition branched on a size: what was traced holds at this size only.
        return "its decomposition depends on the sizes (tracing it added guards)"
    return gm


def _torch_callable(node: Node) -> Callable | None:
    """What `node` calls, if it is torch's own: an op, a function of torch's namespaces, a
    tensor method or a module of torch.nn."""
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, None)
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(node.target) if node.graph.owning_module else None
        return module if module is not None and _is_torch_name(type(module).__module__) else None
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target
    return target if callable(target) and _is_torch_name(getattr(target, "__module__", None)) else None


def _is_torch_name(module: Any) -> bool:
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


@functools.cache
def _decompositions() -> dict:
    from torch._decomp import core_aten_decompositions

    return dict(core_aten_decompositions())
