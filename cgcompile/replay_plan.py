"""A straight-line replay of one Dynamo graph per call size, with every buffer pre-bound.

The stitch (FX's generated forward) reaches each piece through its runner, and on every
call a graph piece looks its graph up by size, checks every input against its buffer,
launches, and narrows its outputs to the call's rows; parameters are passed to every
piece only to be ignored. Once every graph piece of a Dynamo graph holds a graph for
the size N that calls of n rows run at, all of that is fixed, so the runtime generates
one Python function per (n, N) that does only what must happen per call:

  - copy each graph input that may lie elsewhere into its buffer, behind the same
    address and strides check as `buffers.fill_all`;
  - launch each graph (`CUDAGraph.replay`, bound);
  - call each eager piece with its arguments: graph outputs are views made once, at
    their n rows;
  - return the stitch's outputs.

Why it is sound: a value one graph hands straight to the next lies at the next graph's
buffer (the address and strides it was captured reading in place, compared when the
plan is made): the generic path would check it and copy nothing every call, so the plan
leaves the check out. Every other input is checked as before. A graph output lives at
its alias as long as the graph exists; plans are dropped whenever a graph of the session
is captured or dropped, or a runner is replaced (`CaptureSession.graphs_changed`), and
run only while the session captures lazily (never during an ahead-of-time capture).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable

import torch

from .buffers import StaticBuffer, copy_in, narrow

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """What a graph piece holds for one size, as a plan needs it.

    inputs: (piece input, its buffer) for every tensor input that is not a parameter.
    outputs: non-owning aliases of the graph's outputs at the capture size.
    output_dims: per output, the dims that hold the capture size (narrowed to n rows).
    """

    replay: Callable[[], None]
    inputs: tuple[tuple[int, StaticBuffer], ...]
    outputs: tuple[torch.Tensor, ...]
    output_dims: tuple[tuple[int, ...], ...]


class _Writer:
    """Lines of the generated function and the constants they name."""

    def __init__(self, stitch: torch.fx.GraphModule):
        self.stitch = stitch
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self.values_of: dict[torch.fx.Node, tuple] = {}  # graph piece node -> its outputs at n rows

    def constant(self, value: Any, hint: str = "c") -> str:
        name = f"{hint}{len(self.constants)}"
        self.constants[name] = value
        return name

    def expr(self, arg, values: dict) -> str:
        """Python source for an FX argument: a node's value, a container, or a constant."""
        if isinstance(arg, torch.fx.Node):
            return values[arg]
        if isinstance(arg, (tuple, list)):
            inner = ", ".join(self.expr(a, values) for a in arg)
            return f"({inner},)" if isinstance(arg, tuple) else f"[{inner}]"
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{k!r}: {self.expr(v, values)}" for k, v in arg.items()) + "}"
        if arg is None or isinstance(arg, (bool, int, float, str)):
            return repr(arg)
        return self.constant(arg)


def build_plan(stitch: torch.fx.GraphModule, calls: dict[str, Callable], n: int, size: int) -> Callable | None:
    """The replay function of the stitch for calls of n rows run at `size`, or None when a
    graph piece holds no graph for that size (it still has to capture).

    calls: the runtime's per-piece callables by submodule name (a graph piece's bound
    `forward`, an eager piece's code, a recovery's replacement).
    """
    out = _Writer(stitch)
    values: dict[torch.fx.Node, str] = {}
    graph_outputs: dict[torch.fx.Node, tuple] = {}  # graph piece node -> its full-size output aliases
    placeholders = 0
    last_use = _last_uses(stitch.graph)
    for node in stitch.graph.nodes:
        value = _write_node(out, node, calls, values, graph_outputs, placeholders, n, size)
        if value is _NOT_CAPTURED:
            return None
        values[node] = value
        placeholders += node.op == "placeholder"
        # As FX's own code does: let an eager piece's result go once nothing reads it.
        done = [values[d] for d in last_use.get(node, ()) if values[d].startswith("v_")]
        if done:
            out.lines.append(" = ".join(done) + " = None")
    return _compile(out, stitch, n, size)


def _last_uses(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each node, the nodes whose last reader it is."""
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        for read in node.all_input_nodes:
            last[read] = node
    by_user: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for read, user in last.items():
        by_user.setdefault(user, []).append(read)
    return by_user


_NOT_CAPTURED = object()
_UNMADE = object()


def _write_node(out: _Writer, node: torch.fx.Node, calls: dict, values: dict, graph_outputs: dict,
                placeholders: int, n: int, size: int):
    """Write what `node` does per call; return the source that names its value (a local,
    or a constant), or _NOT_CAPTURED."""
    var = f"v_{node.name}"
    if node.op == "placeholder":
        return f"args[{placeholders}]"  # read where used: most are parameters, never read
    elif node.op == "get_attr":
        return out.constant(_fetch_attr(out.stitch, node.target), "attr")
    elif node.op == "call_module":
        graph = _captured(calls[node.target], size)
        if graph is _NOT_CAPTURED:
            return graph
        if graph is not None:
            _write_replay(out, node, graph, values, graph_outputs, n, size)
            graph_outputs[node] = graph.outputs
            with torch.inference_mode(False):  # views usable in and outside inference mode
                narrowed = tuple(narrow(o, d, n) for o, d in zip(graph.outputs, graph.output_dims))
            out.values_of[node] = narrowed
            return out.constant(narrowed, "out")
        args = ", ".join(out.expr(a, values) for a in node.args)
        out.lines.append(f"{var} = {out.constant(calls[node.target], 'call')}({args})")
    elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in graph_outputs:
        source, index = node.args
        graph_outputs[node] = graph_outputs[source][index]
        return out.constant(out.values_of[source][index], "out")
    elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        out.lines.append(f"{var} = {values[node.args[0]]}[{node.args[1]}]")
    elif node.op == "call_function":
        args = ", ".join([out.expr(a, values) for a in node.args]
                         + [f"{k}={out.expr(v, values)}" for k, v in node.kwargs.items()])
        out.lines.append(f"{var} = {out.constant(node.target, 'fn')}({args})")
    elif node.op == "output":
        out.lines.append(f"return {out.expr(node.args[0], values)}")
        return ""
    else:
        raise AssertionError(f"unexpected stitch node {node.format_node()}")
    return var


def _captured(call: Callable, size: int):
    """The graph a call replays at `size` (a `CapturedGraph`), None for an eager call, or
    _NOT_CAPTURED for a graph piece with no graph of that size yet."""
    runner = getattr(call, "__self__", None)
    captured = getattr(runner, "captured_graph", None)
    if captured is None:
        return None
    graph = captured(size)
    return _NOT_CAPTURED if graph is None else graph


def _write_replay(out: _Writer, node: torch.fx.Node, graph: CapturedGraph, values: dict,
                  graph_outputs: dict, n: int, size: int) -> None:
    """Fill the graph's buffers from its arguments, then launch it."""
    for i, static in graph.inputs:
        arg = node.args[i]
        source = graph_outputs.get(arg)
        if isinstance(source, torch.Tensor) and static.reads_in_place(source):
            continue  # another graph's output, already where this graph reads it
        x = out.expr(arg, values)
        if not static.repeated and (n == size or not static.dims):  # what copy_in comes down to
            fill = f"{out.constant(static.buffer.copy_, 'copy')}({x})"
        else:
            fill = (f"{out.constant(copy_in, 'copy_in')}({out.constant(static.buffer, 'buf')}, {x}, "
                    f"{static.dims!r}, {n}, {size}, {static.repeated!r})")
        out.lines.append(f"if {x}.data_ptr() != {static.address} or {x}.stride() != {static.stride!r}: {fill}")
    out.lines.append(f"{out.constant(graph.replay, 'replay')}()")


def _fetch_attr(module: torch.nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _compile(out: _Writer, stitch: torch.fx.GraphModule, n: int, size: int) -> Callable:
    source = "def replay(args):\n" + "".join(f"    {line}\n" for line in out.lines)
    namespace = dict(out.constants)
    exec(compile(source, f"<cgcompile replay plan n={n} size={size}>", "exec"), namespace)
    replay = namespace["replay"]
    replay.source = source
    return replay


class ReplayPlans:
    """One runtime's replay plans by (n, size), made at the first call that finds every
    graph piece captured at that size, and all dropped when the session's graphs change
    (`CaptureSession.graphs_changed`).

    calls: the runtime's per-piece callables by submodule name, read when a plan is made
    (a recovery replaces entries, and says so through `graphs_changed`).
    """

    def __init__(self, stitch: torch.fx.GraphModule, calls: dict[str, Callable], session):
        self.stitch = stitch
        self.calls = calls
        self.session = session
        self.made = 0  # plans made over the runtime's life (a plan per size, again after a change)
        self._plans: dict[tuple[int, int], Callable | None] = {}
        session.add_plans(self)

    def clear(self) -> None:
        self._plans.clear()

    def get(self, n: int, size: int) -> Callable | None:
        """The plan for a call of n rows at `size`; None: run the stitch (it captures)."""
        plan = self._plans.get((n, size), _UNMADE)  # every call: one lookup
        if plan is _UNMADE:
            plan = self._plans[(n, size)] = build_plan(self.stitch, self.calls, n, size)
            self.made += plan is not None
            if plan is not None:
                log.debug("cgcompile: replay plan for n=%d at size %d:\n%s", n, size, plan.source)
        return plan
