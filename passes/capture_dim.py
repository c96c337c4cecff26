"""Choose the capture dimension: the symbolic size that CUDA graphs are captured and padded over.

Default rule: walk the graph inputs in Dynamo's order, skip parameters and buffers
(static inputs) and non-tensors, and take the first tensor whose dimension 0 is a
plain symbol (s0, not s0 + 1). That is the batch/token dimension of the usual model
input (`input_ids`, hidden states). A graph with no such input is static: every piece
that depends on no symbol is captured at its one shape. The user overrides the rule by
naming the input (`Config.capture_input`) and the dimension (`Config.capture_input_dim`),
e.g. input_ids' dimension 1 for a Hugging Face model run with batch 1. Where that
dimension has a fixed size, the graph is static: Dynamo compiles the first call of a
model with every size fixed and only later marks sizes dynamic, so a static graph is
what the override names on the first call and must not be an error.

Only dimension 0 is searched by default: a later dimension of a later input is as
likely the length of a KV cache, which must never be captured and padded over.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import sympy
import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value


@dataclasses.dataclass(frozen=True)
class CaptureDim:
    symbol: sympy.Symbol
    input_name: str  # the input as Dynamo names it, e.g. "L['input_ids']"
    dim: int

    def __str__(self) -> str:
        return f"{self.symbol} (dim {self.dim} of {self.input_name})"


def input_name(node: Node) -> str:
    """The input's source as Dynamo names it, e.g. "L['x']", else the placeholder name."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return node.name
    name = source.name
    return name() if callable(name) else name


def _symbol_at(node: Node, dim: int) -> sympy.Symbol | None:
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or dim >= value.dim():
        return None
    size = value.shape[dim]
    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
        return size.node.expr
    return None


def _matches(node: Node, wanted: str, forward_names: dict[str, str]) -> bool:
    name = input_name(node)
    return wanted in (name, node.name, forward_names.get(name)) or name.endswith(f"['{wanted}']")


# torch.compile of a module whose code Dynamo does not trace from its own frame (every
# module of torch.nn, e.g. nn.Sequential) traces a wrapper `inner(*args, **kwargs)` that
# calls `fn(*args, **kwargs)`: positional inputs are then named L['args'][i], not as in
# the module's forward. The module is L['fn'], whose class Dynamo records in each node's
# nn_module_stack; its forward's signature gives the names back.
_WRAPPED_MODULE = "L['fn']"
_POSITIONAL = re.compile(r"^L\['args'\]\[(\d+)\]$")


def forward_names(gm: GraphModule) -> dict[str, str]:
    """Dynamo's name of each positional input of a wrapped module call -> forward's name for it,
    e.g. {"L['args'][0]": "input"} for an nn.Sequential; {} for any other graph."""
    names = _positional_parameters(_wrapped_module_class(gm))
    result = {}
    for node in gm.graph.nodes:
        match = _POSITIONAL.match(input_name(node)) if node.op == "placeholder" else None
        if match and int(match.group(1)) < len(names):
            result[match.group(0)] = names[int(match.group(1))]
    return result


def _wrapped_module_class(gm: GraphModule) -> type | None:
    for node in gm.graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            if path == _WRAPPED_MODULE and isinstance(cls, type):
                return cls
    return None


def _positional_parameters(cls: type | None) -> list[str]:
    """The names of forward's positional parameters after self ([] when unknown)."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values()) if cls else []
    except (TypeError, ValueError):  # a forward without a readable signature
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters[1:] if p.kind in positional]


def find_capture_dim(
    gm: GraphModule,
    static_inputs: frozenset[str],
    override_input: str | None = None,
    override_dim: int = 0,
) -> CaptureDim | None:
    """Apply the rule in the module docstring; `static_inputs` holds placeholder names.

    Raises LookupError when the override names no input, a dimension the input does not
    have, or one whose size is an expression (s0 + 1) rather than a plain symbol.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if override_input is not None:
        return _override(gm, placeholders, static_inputs, override_input, override_dim)
    for node in placeholders:
        if node.name in static_inputs:
            continue
        symbol = _symbol_at(node, 0)
        if symbol is not None:
            return CaptureDim(symbol, input_name(node), 0)
    return None


def _override(gm: GraphModule, placeholders: list[Node], static_inputs: frozenset[str],
              wanted: str, dim: int) -> CaptureDim | None:
    aliases = forward_names(gm)
    candidates = [n for n in placeholders if _matches(n, wanted, aliases)]
    if not candidates:
        names = [_readable(input_name(n), aliases) for n in placeholders
                 if n.name not in static_inputs and isinstance(example_value(n), torch.Tensor)]
        raise LookupError(
            f"expected the name of a tensor input as in forward, got {wanted!r}; the graph's tensor "
            f"inputs other than parameters and buffers are {names}"
        )
    value = example_value(candidates[0])
    shape = tuple(getattr(value, "shape", ()))
    if dim >= len(shape):
        raise LookupError(
            f"expected capture_input_dim below {len(shape)} for input {wanted!r} of shape {shape}, "
            f"got {dim}; pick a dimension the input has"
        )
    symbol = _symbol_at(candidates[0], dim)
    if symbol is None and isinstance(shape[dim], torch.SymInt):
        raise LookupError(
            f"expected dim {dim} of input {wanted!r} (shape {shape}) to be a plain dynamic size, got "
            f"{shape[dim]}; pick the input whose size it is derived from"
        )
    return CaptureDim(symbol, input_name(candidates[0]), dim) if symbol is not None else None


def _readable(name: str, aliases: dict[str, str]) -> str:
    return f"{aliases[name]} ({name})" if name in aliases else name
