"""Whether one graph of the whole Dynamo graph may replace its pieces, and what to check per call.

A piecewise run re-reads everything host-side at every call: its split ops run eagerly
with the call's own arguments. A full graph freezes them. It is still right for a call
when the call hands the graph exactly what it was captured with, so the plan hoists
every such dependency of the eager pieces to the graph's inputs:

  - tensor inputs the graph writes into, directly or through a view (a static KV cache
    and its length tensor): the full graph writes them at their captured address, so
    the address (and symbolic strides) must be the captured ones. So must parameters and
    buffers an eager piece reads (read in place; checking them costs little);
  - every symbol besides the capture dimension (a host int such as a cache length,
    a size): the graph holds the value it was captured with, so the value must match.
    Except symbols the graph reads from a device buffer (`device_scalars`): the runtime
    writes the call's value there before every call, so they are no part of the key;
  - every other tensor input is copied into the graph's own buffer before a replay, as
    piecewise graphs copy theirs: an op that only reads it, split op or not, reads the
    same values from the copy (a position tensor made anew every step stays on the full
    path). Parameters and buffers only capturable code reads are read in place, as there.

Why is that enough? A node inside the graph computes from its inputs and constants; its
non-tensor arguments are constants or expressions of the symbols, and its tensor
arguments are made inside the graph or are inputs. So when every symbol has its captured
value and every input the eager nodes see is where it was, a replay computes what the
eager run computes. It holds only for eager nodes that read nothing but their arguments:
split ops the user declared capturable (`Config.capturable_split_ops`), in-place writes
into inputs (checked by address), ops on symbolic sizes (checked by value) and views. Host
syncs and host-to-device copies can never be captured: their graph has no plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.fx import GraphModule, Node

from .graph_values import address, example_value, free_symbols, show_address
from .mutation import view_base, view_parent, written_inputs
from .split import SplitGraph

# Rules whose eager nodes a full graph may hold: given the checks above, and views (a
# stretch of views is kept out of piecewise graphs only because it launches nothing).
_FULL_GRAPH_RULES = frozenset({"input_mutation", "dynamic_shape", "dynamic_scalar", "view_only"})


@dataclasses.dataclass(frozen=True)
class FullGraphPlan:
    """What a call must match for a full graph to replay it; positions among graph inputs.

    by_address: tensor inputs written by the graph, parameters and buffers the eager pieces
        read, and inputs that cannot be copied: their data_ptr is checked per call.
    strides_checked: those of them whose strides are symbolic: strides checked too
        (Dynamo guards static strides itself).
    host_values: (input, dim) per symbol other than the capture dimension: the SymInt
        input itself (dim None) or the size of a tensor input's dim.
    copied: tensor inputs copied into the full graph's own buffers before a replay.
    names: every graph input's name, for the log.
    device_scalars: SymInt inputs the graph reads from a device buffer that the runtime
        writes before every call (`passes.device_scalars`): not checked.
    """

    by_address: tuple[int, ...]
    strides_checked: tuple[int, ...]
    host_values: tuple[tuple[int, int | None], ...]
    copied: tuple[int, ...]
    names: tuple[str, ...]
    device_scalars: tuple[int, ...] = ()

    def key(self, args: Sequence) -> tuple:
        """What this call hands the graph host-side; equal keys replay the same graph."""
        return (
            [address(args[i]) for i in self.by_address],
            [args[i].stride() for i in self.strides_checked],
            self.symbol_values(args),
        )

    def symbol_values(self, args: Sequence) -> list:
        """The call's value of every symbol besides the capture dimension."""
        return [args[i] if d is None else args[i].shape[d] for i, d in self.host_values]

    def difference(self, key: tuple, captured: tuple) -> str:
        """The first input whose host-side value differs between two keys, in words."""
        values = tuple(i for i, _ in self.host_values)
        parts = (("the address", self.by_address, show_address), ("the strides", self.strides_checked, str),
                 ("the host value", values, str))
        for (what, indices, show), got, had in zip(parts, key, captured):
            for i, g, h in zip(indices, got, had):
                if g != h:
                    return f"{what} of input {self.names[i]!r} is {show(g)}, captured with {show(h)}"
        return "nothing differs"


def plan_full_graph(gm: GraphModule, split: SplitGraph, static_inputs: frozenset[str],
                    capture_symbol: sympy.Symbol | None,
                    capturable: Callable[[Any], bool],
                    device_scalars: tuple[int, ...] = ()) -> FullGraphPlan | str:
    """The plan, or a sentence saying why no full graph may replace the pieces.
    device_scalars: positions of the SymInt inputs the graph reads from a device buffer."""
    why = _uncapturable_reason(gm, split, capturable)
    if why:
        return why
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = written_inputs(gm)  # written into the caller's tensors: checked by address, never copied
    reached = _inputs_reached_by_eager_pieces(split)
    by_address = tuple(
        i for i, n in enumerate(placeholders)
        if _is_tensor(n) and (i in written or (n.name in static_inputs and n in reached)
                              or (n.name not in static_inputs and _overlaps(n)))
    )
    from_device = {example_value(placeholders[i]).node.expr for i in device_scalars}
    host_values = _host_value_sources(placeholders, {capture_symbol, *from_device})
    if isinstance(host_values, str):
        return host_values
    copied = tuple(
        i for i, n in enumerate(placeholders)
        if _is_tensor(n) and i not in by_address and n.name not in static_inputs
    )
    strides = tuple(i for i in by_address if not all(type(s) is int for s in example_value(placeholders[i]).stride()))
    return FullGraphPlan(by_address, strides, host_values, copied, tuple(n.name for n in placeholders),
                         tuple(device_scalars))


def _uncapturable_reason(gm: GraphModule, split: SplitGraph, capturable) -> str | None:
    nodes = {n.name: n for n in gm.graph.nodes}
    for spec in split.pieces:
        for reason in spec.reasons:
            if reason.rule in _FULL_GRAPH_RULES:
                continue
            node = nodes.get(reason.node)
            if reason.rule == "split_op" and node is not None and capturable(node.target):
                continue
            if reason.rule == "split_op":
                return f"{reason.node} is a split op not in Config.capturable_split_ops ({reason.detail})"
            return f"{reason.node} cannot be captured: {reason.detail} [{reason.rule}]"
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for value in returned:
        if isinstance(value, Node) and view_base(value).op == "placeholder":
            return f"the graph returns {value.name}, an input or a view of one (a full graph would return its copy)"
    return None


def _inputs_reached_by_eager_pieces(split: SplitGraph) -> set[Node]:
    """Graph inputs that an op of an eager piece reads or writes, directly or through a
    view (made in that piece or before it). Views alone read nothing: an input an eager
    piece only views, for the capturable code after it, is no concern of the check."""
    reached = set()
    for spec in split.pieces:
        if spec.capturable:
            continue
        inner = [n for n in spec.graph.graph.nodes if n.op == "placeholder"]
        for node, original in zip(inner, spec.inputs):
            base = view_base(original)
            if base.op == "placeholder" and _used_by_an_op(node):
                reached.add(base)
    return reached


def _used_by_an_op(node: Node) -> bool:
    """Whether an op other than a view takes `node` or a view of it."""
    for user in node.users:
        if user.op == "output":
            continue
        if view_parent(user) is not node or _used_by_an_op(user):
            return True
    return False


def _host_value_sources(placeholders: list[Node], unchecked: set) -> tuple | str:
    """Where each symbol can be read from a call's inputs, but those `unchecked` (the
    capture dimension, symbols read from a device buffer)."""
    sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
    needed: set[sympy.Symbol] = set()
    for i, node in enumerate(placeholders):
        value = example_value(node)
        needed |= free_symbols(value) - unchecked if value is not None else set()
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            sources.setdefault(value.node.expr, (i, None))
        elif isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, (i, d))
    missing = sorted(str(s) for s in needed - sources.keys())
    if missing:
        return f"the host values {missing} are no input's size or value, so a call cannot be checked against them"
    return tuple(sources[s] for s in sorted(needed, key=str))


def _is_tensor(node: Node) -> bool:
    return isinstance(example_value(node), torch.Tensor)


def _overlaps(node: Node) -> bool:
    """Whether a stride of 0 makes elements share memory (an expanded tensor). A symbolic
    stride counts only when it may be 0: a product of sizes (a dynamic length's row
    stride) is positive, since Dynamo's size symbols are."""
    value = example_value(node)
    return any(_may_be_zero(st) and sz != 1 for sz, st in zip(value.shape, value.stride()))


def _may_be_zero(stride) -> bool:
    if type(stride) is int:
        return stride == 0
    return not bool(getattr(getattr(stride, "node", None), "expr", sympy.S.Zero).is_positive)
