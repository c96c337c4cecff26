"""Split a Dynamo graph into pieces at the eager nodes the split rule found.

Three phases, each a function below:
  1. `_assign_partitions`: walk the nodes in their original order (which keeps
     mutations and side effects ordered) and start a new partition whenever a node's
     kind (capturable or eager) differs from the previous one. So adjacent eager
     nodes merge into one eager piece. A `getitem` joins the partition of the node
     whose tuple it unpacks. A capturable stretch of nothing but view ops between
     eager pieces is folded into them: a graph of it would launch no kernel.
  2. `_detect_dependencies`: which original nodes each partition reads from outside
     and which it must hand on. Size computations and constants ("floating" nodes)
     are never handed across: each partition that needs them recomputes them from
     their sources, so no `torch.Size` or shape arithmetic crosses a piece boundary.
  3. `_build_piece` / `_build_stitch`: copy each partition into its own GraphModule
     with canonical names (arg0, arg1, ... and op-derived node names), so that pieces
     with the same code print the same code; then build the stitching graph that
     calls the pieces in order.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from .graph_values import example_value, is_view_op
from .split_rule import SplitReason, is_floating


@dataclasses.dataclass(frozen=True)
class PieceSpec:
    """One piece of a split graph. `inputs`/`outputs` are nodes of the original graph."""

    name: str
    graph: GraphModule
    capturable: bool
    reasons: tuple[SplitReason, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]


@dataclasses.dataclass(frozen=True)
class SplitGraph:
    """`stitch` calls the pieces (its submodules, named by `PieceSpec.name`) in order."""

    stitch: GraphModule
    pieces: tuple[PieceSpec, ...]


@dataclasses.dataclass
class _Partition:
    capturable: bool
    nodes: list[Node] = dataclasses.field(default_factory=list)
    reasons: list[SplitReason] = dataclasses.field(default_factory=list)
    inputs: dict[Node, None] = dataclasses.field(default_factory=dict)  # ordered set
    outputs: dict[Node, None] = dataclasses.field(default_factory=dict)


def split_graph(gm: GraphModule, eager: dict[Node, SplitReason]) -> SplitGraph:
    partitions = _assign_partitions(gm, eager)
    owner = {node: part for part in partitions for node in part.nodes}
    _detect_dependencies(gm, partitions, owner)
    pieces = tuple(_build_piece(gm, f"piece_{i}", part, owner) for i, part in enumerate(partitions))
    return SplitGraph(_build_stitch(gm, pieces, owner), pieces)


# -- phase 1 ---------------------------------------------------------------------------


def _assign_partitions(gm: GraphModule, eager: dict[Node, SplitReason]) -> list[_Partition]:
    parts: list[_Partition] = []
    owner: dict[Node, _Partition] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or is_floating(node):
            continue
        producer = _unpacked_producer(node)
        if producer in owner:
            part = owner[producer]
        else:
            capturable = node not in eager
            if not parts or parts[-1].capturable != capturable:
                parts.append(_Partition(capturable))
            part = parts[-1]
            if not capturable:
                part.reasons.append(eager[node])
        part.nodes.append(node)
        owner[node] = part
    return _fold_view_only(parts)


def _unpacked_producer(node: Node) -> Node | None:
    """The node whose tuple output this `getitem` unpacks, else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source = node.args[0]
    if isinstance(source, Node) and not isinstance(example_value(source), torch.Tensor):
        return source
    return None


def _fold_view_only(parts: list[_Partition]) -> list[_Partition]:
    """Turn view-only capturable partitions next to eager ones eager, then merge neighbours."""
    for i, part in enumerate(parts):
        neighbours = parts[max(i - 1, 0) : i] + parts[i + 1 : i + 2]
        if part.capturable and all(map(is_view_op, part.nodes)) and any(not p.capturable for p in neighbours):
            part.capturable = False
            part.reasons.append(
                SplitReason("view_only", "only view ops next to eager code, so nothing to capture", part.nodes[0].name)
            )
    merged: list[_Partition] = []
    for part in parts:
        if merged and merged[-1].capturable == part.capturable:
            merged[-1].nodes.extend(part.nodes)
            merged[-1].reasons.extend(part.reasons)
        else:
            merged.append(part)
    return merged


# -- phase 2 ---------------------------------------------------------------------------


def _sources(node: Node, owner: dict[Node, _Partition]) -> list[Node]:
    """The non-floating nodes a value needs from outside, looking through floating nodes."""
    if node.op == "placeholder" or node in owner:
        return [node]
    return [s for arg in node.all_input_nodes for s in _sources(arg, owner)]


def _detect_dependencies(gm: GraphModule, parts: list[_Partition], owner: dict[Node, _Partition]) -> None:
    for part in parts:
        for node in part.nodes:
            for arg in node.all_input_nodes:
                for source in _sources(arg, owner):
                    if owner.get(source) is not part:
                        part.inputs[source] = None
                        if source in owner:
                            owner[source].outputs[source] = None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for arg in output.all_input_nodes:
        for source in _sources(arg, owner):
            if source in owner:
                owner[source].outputs[source] = None


# -- phase 3 ---------------------------------------------------------------------------


class _Copier:
    """Copies original nodes into `graph`, recomputing floating nodes on first use."""

    def __init__(self, gm: GraphModule, graph: Graph, env: dict[Node, Node]):
        self.gm, self.graph, self.env = gm, graph, env
        self.attrs: dict[str, Any] = {}

    def lookup(self, node: Node) -> Node:
        if node not in self.env:
            self.copy(node)  # a floating node: recompute it here
        return self.env[node]

    def copy(self, node: Node) -> Node:
        if node.op == "get_attr":
            name = f"_attr{len(self.attrs)}"
            self.attrs[name] = _fetch_attr(self.gm, node.target)
            new = self.graph.get_attr(name)
        else:
            args = torch.fx.map_arg(node.args, self.lookup)
            kwargs = torch.fx.map_arg(node.kwargs, self.lookup)
            new = self.graph.create_node(node.op, node.target, args, kwargs)
        new.meta = dict(node.meta)
        self.env[node] = new
        return new


def _fetch_attr(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _build_piece(gm: GraphModule, name: str, part: _Partition, owner) -> PieceSpec:
    graph = Graph()
    env = {}
    for i, source in enumerate(part.inputs):
        env[source] = graph.placeholder(f"arg{i}")
        env[source].meta = dict(source.meta)
    copier = _Copier(gm, graph, env)
    for node in part.nodes:
        copier.copy(node)
    outputs = tuple(part.outputs)
    graph.output(tuple(env[o] for o in outputs))
    module = GraphModule(copier.attrs, graph, class_name=name)
    return PieceSpec(name, module, part.capturable, tuple(part.reasons), tuple(part.inputs), outputs)


def _build_stitch(gm: GraphModule, pieces: tuple[PieceSpec, ...], owner) -> GraphModule:
    graph = Graph()
    env = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name, type_expr=node.type)
            env[node].meta = dict(node.meta)
    copier = _Copier(gm, graph, env)
    for piece in pieces:
        call = graph.call_module(piece.name, tuple(copier.lookup(i) for i in piece.inputs))
        for k, out in enumerate(piece.outputs):
            env[out] = graph.call_function(operator.getitem, (call, k))
            env[out].meta = dict(out.meta)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(torch.fx.map_arg(output.args[0], copier.lookup))
    root = {p.name: p.graph for p in pieces} | copier.attrs
    return GraphModule(root, graph, class_name="SplitGraph")
