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
     `_add_size_symbols` then gives each partition every size symbol its code needs
     that its inputs do not carry as such (see there).
  3. `_build_piece` / `_build_stitch`: copy each partition into its own GraphModule
     with canonical names (arg0, arg1, ... and op-derived node names), so that pieces
     with the same code print the same code; then build the stitching graph that
     calls the pieces in order.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
from torch.fx import Graph, GraphModule, Node

from .graph_values import example_value, free_symbols, is_view_op
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
    """`stitch` calls the pieces (its submodules, named by `PieceSpec.name`) in order.

    Every size symbol in a piece's code is carried by one of its inputs as such: a SymInt
    input made as the symbol (not one that reads as it after a replacement), or a tensor
    input with a dimension of exactly that size.
    """

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
    """Split `gm` at the `eager` nodes. Leaves `gm` as it was but for one kind of node it
    may add: `sym_size` of a tensor, for a size symbol no SymInt of `gm` carries (Dynamo's
    graphs have one per symbol; a re-split piece or an ATen graph may not)."""
    partitions = _assign_partitions(gm, eager)
    owner = {node: part for part in partitions for node in part.nodes}
    _detect_dependencies(gm, partitions, owner)
    _add_size_symbols(gm, partitions, owner)
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


def _add_size_symbols(gm: GraphModule, parts: list[_Partition], owner: dict[Node, _Partition]) -> None:
    """Give each partition the size symbols its code needs but no input carries as such.

    A compiler binds a symbol only from an input that is that symbol (Inductor reads
    `s = arg.size(0)` or takes the SymInt itself). A piece whose tensors are all sized
    `2*s` (after a `repeat_interleave`), `16*s` (a flatten) or `s + 4` (a pad) cannot
    recover s from them, and Inductor stops with "expected [s] to have been codegen-ed".
    Such a piece gets the symbol as one more input: the node that binds it (a SymInt
    placeholder of the graph, an `.item()` in an earlier piece), or else `sym_size` of
    the first tensor with it as a dimension, a floating node added to `gm` that the
    stitching graph computes. A piece re-split later (`capture_recovery`) has its
    inputs as placeholders, so its own pieces get the symbols the same way.
    """
    sources = _SymbolSources(gm, owner)
    for part in parts:
        missing = _needed_symbols(part, owner) - _carried_symbols(part.inputs)
        for symbol in sorted(missing, key=str):  # sorted: equal layers get equal signatures
            source = sources.node_for(symbol)
            if source is None:
                continue  # nothing in the graph binds it: no piece could be given it
            # The node the stitching graph reads: the source, or the tensor it takes the size of.
            carrier = source.args[0] if source in sources.added else source
            if owner.get(carrier) is part:
                continue  # bound inside the partition: an unbacked size (.item(), nonzero)
            part.inputs[source] = None
            if carrier in owner:
                owner[carrier].outputs[carrier] = None


def _needed_symbols(part: _Partition, owner: dict[Node, _Partition]) -> set[sympy.Symbol]:
    """The symbols in the values of a partition's inputs, its nodes and the floating nodes
    its copy recomputes (the size arguments of its nodes, transitively)."""
    code, stack = set(part.nodes) | set(part.inputs), [a for n in part.nodes for a in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in code and node not in owner and node.op != "placeholder":
            code.add(node)
            stack.extend(node.all_input_nodes)
    return {s for node in code for s in _symbols_of(example_value(node))}


def _symbols_of(value) -> set[sympy.Symbol]:
    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return free_symbols(value)
    if isinstance(value, (tuple, list)):
        return {s for v in value for s in _symbols_of(v)}
    return set()  # dtypes, devices, None: no sizes


def _carried_symbols(nodes) -> set[sympy.Symbol]:
    """The symbols a compiler can bind from these inputs: SymInts and plain tensor dimensions."""
    carried = set()
    for node in nodes:
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            carried.add(_bound_by_symint(value))
        elif isinstance(value, torch.Tensor):
            carried |= {s.node.expr for s in value.shape
                        if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol)}
    return carried


def _bound_by_symint(value: torch.SymInt) -> sympy.Expr:
    """The symbol Inductor binds from a SymInt input: the one it was made as, not what
    the ShapeEnv now replaces that with. Dynamo makes one SymInt per input's size; when
    two inputs must be equal (ids and mask [s72, L] and [s43, L]) it replaces s72 by s43,
    and the SymInt of s72 reads as s43 but still binds s72 (`_get_placeholder_expr`)."""
    from torch.fx.experimental.symbolic_shapes import _get_placeholder_expr

    return _get_placeholder_expr(value.node) if value.node.shape_env is not None else value.node.expr


class _SymbolSources:
    """The node that binds each size symbol, found or made on first request."""

    def __init__(self, gm: GraphModule, owner: dict[Node, _Partition]):
        self.gm = gm
        # Nodes a later piece can be handed: placeholders and the partitions' own nodes.
        self.handable = [n for n in gm.graph.nodes if n.op == "placeholder" or n in owner]
        self.added: set[Node] = set()
        self._found: dict[sympy.Symbol, Node | None] = {}

    def node_for(self, symbol: sympy.Symbol) -> Node | None:
        if symbol not in self._found:
            self._found[symbol] = self._symint(symbol) or self._sym_size(symbol)
        return self._found[symbol]

    def _symint(self, symbol) -> Node | None:
        for node in self.handable:
            value = example_value(node)
            if isinstance(value, torch.SymInt) and _bound_by_symint(value) == symbol:
                return node
        return None

    def _sym_size(self, symbol) -> Node | None:
        for node in self.handable:
            value = example_value(node)
            if not isinstance(value, torch.Tensor):
                continue
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    return self._add_sym_size(node, d, size)
        return None

    def _add_sym_size(self, tensor: Node, dim: int, size: torch.SymInt) -> Node:
        # After every placeholder: the graph's signature stays its placeholders in order.
        anchor = tensor if tensor.op != "placeholder" else self._last_placeholder()
        with self.gm.graph.inserting_after(anchor):
            node = self.gm.graph.call_function(torch.ops.aten.sym_size.int, (tensor, dim))
        node.meta["example_value" if "example_value" in tensor.meta else "val"] = _as_made(size)
        self.added.add(node)
        return node

    def _last_placeholder(self) -> Node:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"][-1]


def _as_made(size: torch.SymInt) -> torch.SymInt:
    """`size` as a SymInt that binds the symbol it reads as (see `_bound_by_symint`): a
    tensor's dim made as s72 reads s43 once s72 is replaced, and a piece handed it as a
    SymInt input must bind s43."""
    symbol, env = size.node.expr, size.node.shape_env
    if env is None or _bound_by_symint(size) == symbol:
        return size
    return env.create_symintnode(symbol, hint=size.node.hint)


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
