"""Host ints a graph reads only as values of tensor ops, read from a device buffer instead.

A Python int that changes every call (transformers' sliding-window cache keeps its length
so: `cumulative_length_int`) becomes a SymInt input of Dynamo's graph. Where the graph
uses it only as the value of a tensor op, such as the mask offset of that cache

    kv_offset = sym_max(s - 8 + 1, 0)          # host arithmetic on the symbol
    kv_arange = torch.arange(8) + kv_offset    # ... whose result only a tensor op reads

a captured graph would replay the value it was captured with, so a full graph had to be
captured again for every value (`FullGraphPlan.host_values`), and piecewise graphs ran
those ops eagerly (split rule `dynamic_scalar`). Here each such symbol is read from one
element of a device int64 buffer, a new graph input that the caller writes before every
call (`cgcompile.run.device_scalars`):

    gm, found = read_scalars_from_device(gm)

The rewrite: a placeholder `BUFFER_NAME` of shape [k] is appended to the graph's inputs;
the host arithmetic between the symbol and its tensor ops is repeated on 0-d views of
the buffer (`s - 8` becomes `buffer[j] - 8`, `sym_max` becomes `clamp_min`), and those
tensor ops read the result in place of the int. The SymInt input stays: host arithmetic
that the graph returns (Dynamo hands `cumulative_length_int + 1` back as an output, to set
the attribute) still computes from it, and `DeviceScalars.host_outputs` names those outputs
so that a replayed graph can compute them again for the call (`host_output_code`).

Why is that sound? A symbol qualifies only when no tensor's shape, stride or offset holds
it (so no kernel's launch depends on it), and every use of it, through host arithmetic, is
a graph output or one operand of an elementwise add, subtract, multiply, divide or compare
whose other operand is a tensor on the buffer's device: such an op computes the same with
a 0-d tensor as with a Python int, in the same dtype (checked with torch's promotion
rules). Anything else (a shape or slice bound, `arange(s)`, an index, a call this pass
does not know) leaves the symbol a host value, and `DeviceScalars.kept` says why.
Dynamo's guards on the int (Python control) stay Dynamo's: they run before the graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
from torch.fx import Graph, GraphModule, Node

from .graph_values import copy_graph_module, example_value, free_symbols, tensors_in

BUFFER_NAME = "_cgcompile_device_scalars"

# Host arithmetic on ints whose tensor counterpart, on 0-d int64 tensors, computes the same
# value (floordiv and mod round as Python's do); sym_max and sym_min map below.
_SAME_ON_TENSORS = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
                              operator.neg})
_MIN_MAX = {torch.sym_max: (torch.maximum, torch.clamp_min), torch.sym_min: (torch.minimum, torch.clamp_max)}
# Elementwise ops of a tensor and a scalar that take a 0-d tensor in the scalar's place.
_TENSOR_VALUE_OPS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
                               operator.mod, operator.lt, operator.le, operator.gt, operator.ge, operator.eq,
                               operator.ne, torch.add, torch.sub, torch.mul})


@dataclasses.dataclass(frozen=True)
class DeviceScalars:
    """What `read_scalars_from_device` did to one graph.

    inputs: positions among the graph's inputs of the SymInt inputs now read from the
        buffer, in the buffer's order (element j holds the call's value of inputs[j]).
    symbols: their symbols, in the same order.
    device: where the buffer must live (None when nothing was rewritten).
    host_outputs: positions among the graph's outputs of host ints computed from those
        symbols (a replayed graph holds the values it was captured with).
    kept: (input name, why) per SymInt input left a host value.
    """

    inputs: tuple[int, ...] = ()
    symbols: tuple[sympy.Symbol, ...] = ()
    device: torch.device | None = None
    host_outputs: tuple[int, ...] = ()
    kept: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass
class _Uses:
    """A symbol's uses, found by following its host arithmetic (`chain`, in graph order)."""

    chain: list[Node]
    tensor_uses: list[Node]
    outputs: set[Node]


def read_scalars_from_device(gm: GraphModule) -> tuple[GraphModule, DeviceScalars]:
    """A copy of `gm` whose value-only SymInt inputs read the buffer input `BUFFER_NAME`
    (appended last), and what was rewritten; `gm` itself where no input qualifies. `gm`
    is left as it was: Dynamo reads its placeholders after the backend returns."""
    original, gm = gm, copy_graph_module(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_layouts = _symbols_in_layouts(gm)
    chosen, kept, device = [], [], None
    for i, node in enumerate(placeholders):
        symbol = _bare_symbol(example_value(node))
        if symbol is None:
            continue
        uses, why = _value_only_uses(node, symbol, in_layouts)
        device, why = _one_device(uses, device) if why is None else (device, why)
        if why is None:
            chosen.append((i, symbol, uses))
        else:
            kept.append((node.name, why))
    if not chosen:
        return original, DeviceScalars(kept=tuple(kept))
    returned = {node for *_, uses in chosen for node in uses.outputs}
    host_outputs = tuple(k for k, value in enumerate(_output_values(gm)) if value in returned)
    # No tensor op reads them, only host outputs: the buffer is read by nothing, but it
    # lives with the graph's tensors so that no piece sees a tensor of another device.
    device = device or _tensor_device(placeholders) or torch.device("cpu")
    _rewrite(gm, placeholders[-1], [(placeholders[i], uses) for i, _, uses in chosen], device)
    return gm, DeviceScalars(tuple(i for i, *_ in chosen), tuple(s for _, s, _ in chosen), device, host_outputs,
                             tuple(kept))


def host_output_code(gm: GraphModule, positions: tuple[int, ...]) -> GraphModule:
    """A graph of `gm`'s inputs that computes only its outputs at `positions` (host ints):
    the host arithmetic that leads to them, copied."""
    graph, env = Graph(), {}
    wanted = [_output_values(gm)[k] for k in positions]
    needed = _ancestors(wanted)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[v] if isinstance(v, Node) else v for v in wanted))
    return GraphModule(torch.nn.Module(), graph)


# -- which symbols qualify ---------------------------------------------------------------


def _bare_symbol(value: Any) -> sympy.Symbol | None:
    if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
        return value.node.expr
    return None


def _symbols_in_layouts(gm: GraphModule) -> dict[sympy.Symbol, Node]:
    """Per symbol, the first node with a tensor whose sizes, strides or offset hold it."""
    found: dict[sympy.Symbol, Node] = {}
    for node in gm.graph.nodes:
        for tensor in tensors_in(example_value(node)):
            for symbol in free_symbols(tensor):
                found.setdefault(symbol, node)
    return found


def _value_only_uses(node: Node, symbol: sympy.Symbol, in_layouts: dict) -> tuple[_Uses, str | None]:
    """The symbol's uses, and why they are not all values of tensor ops (None if they are)."""
    uses = _Uses([], [], set())
    if symbol in in_layouts:
        return uses, f"{symbol} is in the layout of {in_layouts[symbol].name}'s tensor"
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        for user in current.users:
            if user.op == "output":
                uses.outputs.add(current)
            elif _is_host_arithmetic(user, symbol):
                if user not in seen:
                    seen.add(user)
                    uses.chain.append(user)
                    pending.append(user)
            elif _takes_a_value(user, current):
                uses.tensor_uses.append(user)
            else:
                return uses, f"{symbol} is read by {user.name} ({_name(user)}), which needs a host int"
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    uses.chain.sort(key=order.__getitem__)
    return uses, None


def _is_host_arithmetic(node: Node, symbol: sympy.Symbol) -> bool:
    """Int arithmetic on this symbol alone, which 0-d tensors can repeat."""
    if node.op != "call_function" or node.kwargs:
        return False
    if node.target not in _SAME_ON_TENSORS and node.target not in _MIN_MAX:
        return False
    value = example_value(node)
    return isinstance(value, torch.SymInt) and free_symbols(value) == {symbol} and all(
        isinstance(a, Node) or type(a) is int for a in node.args)


def _takes_a_value(node: Node, scalar: Node) -> bool:
    """An elementwise op of a tensor and `scalar` (an operand, never a keyword) whose result
    a 0-d int64 tensor in the scalar's place leaves in the same dtype."""
    if node.op != "call_function" or node.target not in _TENSOR_VALUE_OPS or len(node.args) != 2:
        return False
    if scalar in node.kwargs.values() or not isinstance(example_value(node), torch.Tensor):
        return False
    other = node.args[1] if node.args[0] is scalar else node.args[0]
    other_value = example_value(other) if isinstance(other, Node) else None
    if not isinstance(other_value, torch.Tensor) or scalar is other:
        return False
    like = torch.empty((1,) * other_value.dim(), dtype=other_value.dtype, device="meta")
    zero_dim = torch.empty((), dtype=torch.int64, device="meta")
    return torch.result_type(like, zero_dim) == torch.result_type(like, 1)


def _one_device(uses: _Uses, device: torch.device | None) -> tuple[torch.device | None, str | None]:
    """The device every tensor op reading the buffer computes on, or why there is none."""
    for user in uses.tensor_uses:
        found = example_value(user).device
        if device is not None and found != device:
            return device, f"{user.name} computes on {found}, another symbol's ops on {device}"
        device = found
    return device, None


# -- the rewrite --------------------------------------------------------------------------


def _rewrite(gm: GraphModule, last_input: Node, chosen: list[tuple[Node, _Uses]], device: torch.device) -> None:
    graph = gm.graph
    fake_mode = torch._guards.detect_fake_mode([v for n in graph.nodes for v in tensors_in(example_value(n))])
    with graph.inserting_after(last_input):
        buffer = graph.placeholder(BUFFER_NAME)
    buffer.meta["example_value"] = _fake(fake_mode, lambda: torch.empty(len(chosen), dtype=torch.int64,
                                                                        device=device))
    order = {n: k for k, n in enumerate(graph.nodes)}
    for j, (node, uses) in enumerate(chosen):
        if not uses.tensor_uses:  # only host outputs read it: nothing to read on the device
            continue
        # Only the host arithmetic that feeds a tensor op is repeated on the device; what
        # leads to host outputs alone stays host code (a device copy of it would be dead
        # code on the buffer's device, which a split would have to place).
        feeding = _ancestors([a for user in uses.tensor_uses for a in user.args if isinstance(a, Node)])
        chain = [host for host in uses.chain if host in feeding]
        readers = [*chain, *uses.tensor_uses]
        # Read where first needed: the piece that needs it takes the buffer, not a view
        # made in an earlier piece.
        with graph.inserting_before(min(readers, key=order.__getitem__)):
            on_device = {node: graph.call_function(operator.getitem, (buffer, j))}
        _set_fake(fake_mode, on_device[node], operator.getitem, (buffer, j))
        for host in chain:
            on_device[host] = _repeat_on_device(graph, host, on_device, fake_mode)
        for user in uses.tensor_uses:
            user.args = tuple(on_device.get(a, a) if isinstance(a, Node) else a for a in user.args)
        for host in reversed(uses.chain):  # host arithmetic nothing reads any more
            if not host.users:
                graph.erase_node(host)
    graph.lint()
    gm.recompile()


def _repeat_on_device(graph: Graph, host: Node, on_device: dict[Node, Node], fake_mode) -> Node:
    args = tuple(on_device[a] if isinstance(a, Node) else a for a in host.args)
    target = host.target
    if target in _MIN_MAX:
        both, one = _MIN_MAX[target]
        tensors = [a for a in args if isinstance(a, Node)]
        ints = [a for a in args if not isinstance(a, Node)]
        target, args = (both, tuple(tensors)) if len(tensors) == 2 else (one, (tensors[0], ints[0]))
    with graph.inserting_after(host):
        node = graph.call_function(target, args)
    _set_fake(fake_mode, node, target, args)
    return node


def _set_fake(fake_mode, node: Node, target, args: tuple) -> None:
    values = tuple(example_value(a) if isinstance(a, Node) else a for a in args)
    node.meta["example_value"] = _fake(fake_mode, lambda: target(*values))


def _fake(fake_mode, make):
    if fake_mode is None:
        return make()
    with fake_mode:
        return make()


def _tensor_device(placeholders: list[Node]) -> torch.device | None:
    """The device of the graph's first tensor input (None: it has none)."""
    for node in placeholders:
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _output_values(gm: GraphModule) -> list:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _ancestors(values: list) -> set[Node]:
    found, pending = set(), [v for v in values if isinstance(v, Node)]
    while pending:
        node = pending.pop()
        if node not in found:
            found.add(node)
            pending.extend(node.all_input_nodes)
    return found


def _name(node: Node) -> str:
    return getattr(node.target, "__name__", str(node.target))
