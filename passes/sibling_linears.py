"""Fuse linear layers that read the same input into one matmul over concatenated weights.

Hugging Face decoders project each token with separate q, k and v linears, and gate and
up linears, all reading the same hidden state. At decode sizes (a few rows) each is a
memory-bound matrix-vector product, and a small one runs far below the GPU's bandwidth:
on an H100 a [512, 2048] bf16 k projection took 5.3 us for 2 MB (0.4 TB/s) where the
fused [3072, 2048] q/k/v product reads 12 MB at about the speed of one large matmul.

`fuse_sibling_linears` rewrites every group of two or more `linear(x, w_i, b_i)` calls on
the same `x` whose weights (and biases, all or none) are graph inputs the caller hands in
as real tensors (the model's parameters) into

    y = linear(x, w_fused, b_fused)      # w_fused = cat(w_1, ..., w_k): a new graph input
    y_i = y[..., start_i:end_i].contiguous()

Each y_i is made contiguous: the original results were, and code after them may `view`
them in ways a strided slice does not allow. The fused weights are copies, made here; the
caller appends them to every call's inputs and keeps them equal to their sources (see
`cgcompile.run.weights`). Results agree with the unfused graph to rounding: the matmul
kernel and its reduction order may differ.

Left alone: linears whose weight is not a handed-in tensor (an activation, a weight
computed in the graph), mixed dtypes or devices, a bias on some siblings only.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Mapping

import torch
from torch.fx import GraphModule, Node

from .graph_values import copy_graph_module, example_value

LINEAR_FUNCTIONS = frozenset({torch._C._nn.linear, torch.nn.functional.linear})


@dataclasses.dataclass(frozen=True)
class FusedInput:
    """A graph input the rewrite added: `tensor` is the concatenation (dim 0) of the
    inputs named `sources`, in order; kind: "weight" or "bias"."""

    name: str
    kind: str
    sources: tuple[str, ...]
    tensor: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Linear:
    node: Node
    weight: Node
    bias: Node | None


def fuse_sibling_linears(gm: GraphModule, tensors: Mapping[str, torch.Tensor],
                         concat: Callable[[list[torch.Tensor]], torch.Tensor | None] | None = None,
                         ) -> tuple[GraphModule, list[FusedInput]]:
    """Rewrite each group of sibling linears (see the module docstring).

    tensors: placeholder name -> the real tensor of a graph input that may be fused
    (parameters: fixed for the life of the graph, up to in-place updates).
    concat: makes a fused tensor from its sources (default: a new `torch.cat` along dim 0);
    a caller that compiles several graphs of one model can hand out one copy to all, and
    one that returns None for a group's weights or biases leaves that group unfused.
    Returns the rewritten graph and the inputs it added, in the order of their
    placeholders (after the graph's own); `gm` itself is left as it was, as Dynamo
    reads its placeholders after the backend returns. With nothing to fuse: (gm, []).
    """
    if not _sibling_groups(gm, tensors):
        return gm, []
    fused_gm = copy_graph_module(gm)
    added: list[FusedInput] = []
    for group in _sibling_groups(fused_gm, tensors):
        added.extend(_fuse(fused_gm, group, tensors, len(added), concat or _concat))
    fused_gm.graph.lint()
    fused_gm.recompile()
    return fused_gm, added


def _sibling_groups(gm: GraphModule, tensors: Mapping[str, torch.Tensor]) -> list[list[_Linear]]:
    """Linears grouped by input, and by what must match to concatenate: dtype, device,
    bias or not (a model may project one input with biased and unbiased linears)."""
    groups: dict[tuple, list[_Linear]] = {}
    for node in gm.graph.nodes:
        linear = _as_linear(node, tensors)
        if linear is not None:
            weight = tensors[linear.weight.name]
            key = (node.args[0], weight.dtype, weight.device, weight.shape[1], linear.bias is not None)
            groups.setdefault(key, []).append(linear)
    return [group for group in groups.values() if len(group) > 1 and _biases_match(group, tensors)]


def _as_linear(node: Node, tensors: Mapping[str, torch.Tensor]) -> _Linear | None:
    if node.op != "call_function" or node.target not in LINEAR_FUNCTIONS or not isinstance(node.args[0], Node):
        return None
    args = list(node.args[1:]) + [None] * (3 - len(node.args))
    weight = node.kwargs.get("weight", args[0])
    bias = node.kwargs.get("bias", args[1])
    if not _handed_in(weight, tensors) or tensors[weight.name].dim() != 2:
        return None
    if bias is not None and (not _handed_in(bias, tensors) or tensors[bias.name].dim() != 1):
        return None
    return _Linear(node, weight, bias)


def _handed_in(node, tensors: Mapping[str, torch.Tensor]) -> bool:
    return isinstance(node, Node) and node.op == "placeholder" and node.name in tensors


def _biases_match(group: list[_Linear], tensors: Mapping[str, torch.Tensor]) -> bool:
    dtype = tensors[group[0].weight.name].dtype
    return all(g.bias is None or tensors[g.bias.name].dtype == dtype for g in group)


def _fuse(gm: GraphModule, group: list[_Linear], tensors: Mapping[str, torch.Tensor], index: int,
          concat: Callable) -> list[FusedInput]:
    graph = gm.graph
    names = {"weight": [g.weight.name for g in group]}
    if group[0].bias is not None:
        names["bias"] = [g.bias.name for g in group]
    inputs = []
    for i, (kind, sources) in enumerate(names.items()):
        tensor = concat([tensors[s] for s in sources])
        if tensor is None:  # the caller declined this group: leave it unfused
            return []
        inputs.append(FusedInput(f"fused_{kind}_{index + i}", kind, tuple(sources), tensor))
    nodes = [_placeholder(graph, fused) for fused in inputs]
    sizes = [tensors[g.weight.name].shape[0] for g in group]
    first = group[0].node
    with graph.inserting_before(first):
        fused = graph.call_function(torch._C._nn.linear, (first.args[0], *nodes))
        fused.meta["example_value"] = _linear_value(first, sum(sizes))
    start = 0
    for linear, size in zip(group, sizes):
        with graph.inserting_before(first):  # `first` is erased last: it anchors every insert
            part = graph.call_function(operator.getitem, (fused, (Ellipsis, slice(start, start + size))))
            part.meta["example_value"] = _slice_value(fused, start, size)
            part = graph.call_method("contiguous", (part,))
        part.meta = dict(linear.node.meta)
        linear.node.replace_all_uses_with(part)
        start += size
    for linear in group:
        graph.erase_node(linear.node)
    return inputs


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(parts, dim=0)


def _placeholder(graph: torch.fx.Graph, fused: FusedInput) -> Node:
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        node = graph.placeholder(fused.name)
    source = next(n for n in graph.nodes if n.op == "placeholder" and n.name == fused.sources[0])
    node.meta = {"example_value": _fake_like(example_value(source), fused.tensor)}
    return node


def _fake_like(source_value, tensor: torch.Tensor):
    """The new input's fake value, from the same fake mode as the graph's own inputs."""
    mode = getattr(source_value, "fake_mode", None)
    if mode is None:
        return tensor
    return mode.from_tensor(tensor, static_shapes=True)


def _slice_value(fused: Node, start: int, size: int):
    value = fused.meta["example_value"]
    return value[..., start:start + size] if isinstance(value, torch.Tensor) else value


def _linear_value(first: Node, out_features: int):
    value = example_value(first)
    if not isinstance(value, torch.Tensor):
        return value
    return value.new_empty((*value.shape[:-1], out_features))
