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


def _matches(node: Node, wanted: str) -> bool:
    name = input_name(node)
    return wanted in (name, node.name) or name.endswith(f"['{wanted}']")


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
        return _override(placeholders, override_input, override_dim)
    for node in placeholders:
        if node.name in static_inputs:
            continue
        symbol = _symbol_at(node, 0)
        if symbol is not None:
            return CaptureDim(symbol, input_name(node), 0)
    return None


def _override(placeholders: list[Node], wanted: str, dim: int) -> CaptureDim | None:
    candidates = [n for n in placeholders if _matches(n, wanted)]
    if not candidates:
        names = [input_name(n) for n in placeholders if isinstance(example_value(n), torch.Tensor)]
        raise LookupError(f"no graph input named {wanted!r}; the tensor inputs are {names}")
    value = example_value(candidates[0])
    shape = tuple(getattr(value, "shape", ()))
    if dim >= len(shape):
        raise LookupError(f"input {wanted!r} has shape {shape}, no dim {dim}; pick a dim below {len(shape)}")
    symbol = _symbol_at(candidates[0], dim)
    if symbol is None and isinstance(shape[dim], torch.SymInt):
        raise LookupError(
            f"dim {dim} of input {wanted!r} (shape {shape}) is {shape[dim]}, not a plain dynamic size; "
            f"pick the input whose size it is derived from"
        )
    return CaptureDim(symbol, input_name(candidates[0]), dim) if symbol is not None else None
