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

`ReplayPlans` is one of the runtime's three executors (see `cgcompile.run.runtime`): it
declines a call (returns None) until a plan of the call's (n, N) can be made, and the
stitch runs it instead.
"""

from __future__ import annotations

import dataclasses
import keyword
import logging
import math
import operator
from typing import Any, Callable, Protocol

import torch

from .buffers import StaticBuffer, copy_in, narrow
from .capture import Mode

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


class GraphPiece(Protocol):
    """A runner that holds CUDA graphs (`graph_piece.CudaGraphPiece`), as a plan reads it."""

    def captured_graph(self, size: int) -> CapturedGraph | None: ...


class Pieces(Protocol):
    """The runtime's stitch and its runners (`runtime.Stitch`), as plans read them."""

    stitch: torch.fx.GraphModule
    runners: dict[str, Any]  # by submodule name

    def calls(self, n: int, size: int | None) -> dict[str, Callable]: ...


class NotCaptured(Exception):
    """A graph piece holds no graph for the plan's size yet: its call still captures."""


_PLAIN = (bool, int, str, type(None))  # exact types whose repr is source that evaluates back to them


class _Writer:
    """Lines of the generated function, the constants they name, and the source that
    names each stitch node's value (a local, `args[i]`, or a constant)."""

    def __init__(self, stitch: torch.fx.GraphModule, calls: dict[str, Callable], graphs: dict[str, GraphPiece],
                 n: int, size: int):
        self.stitch, self.calls, self.graphs, self.n, self.size = stitch, calls, graphs, n, size
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {}
        self.values: dict[torch.fx.Node, str] = {}
        self.graph_outputs: dict[torch.fx.Node, Any] = {}  # graph piece node -> its full-size output aliases
        self.narrowed: dict[torch.fx.Node, tuple] = {}  # graph piece node -> its outputs at n rows

    def constant(self, value: Any, hint: str = "c") -> str:
        name = f"{hint}{len(self.constants)}"
        self.constants[name] = value
        return name

    def expr(self, arg) -> str:
        """Source for an FX argument. Containers are written as literals (a list is a new
        list per call, as in FX's code); a leaf is a node's value, a plain literal (int,
        bool, str, None, finite float), or else a bound constant: the repr of an IntEnum,
        `torch.Size([])`, `inf`, a dtype or a numpy scalar is not source for the value."""
        if isinstance(arg, torch.fx.Node):
            return self.values[arg]
        if type(arg) in _PLAIN or (type(arg) is float and math.isfinite(arg)):
            return repr(arg)
        if type(arg) is tuple:
            return _tuple(self.expr(a) for a in arg)
        if isinstance(arg, list):  # and FX's immutable_list
            return "[" + ", ".join(self.expr(a) for a in arg) + "]"
        if isinstance(arg, dict):  # and FX's immutable_dict
            return "{" + ", ".join(f"{self.expr(k)}: {self.expr(v)}" for k, v in arg.items()) + "}"
        if not _has_node(arg):
            return self.constant(arg)
        if isinstance(arg, slice):
            bounds = ", ".join(self.expr(a) for a in (arg.start, arg.stop, arg.step))
            return f"{self.constant(slice, 'slice')}({bounds})"
        if isinstance(arg, tuple):  # a namedtuple or torch.Size holding nodes: built as FX's map_aggregate does
            items = ", ".join(self.expr(a) for a in arg)
            make = self.constant(type(arg), "make")
            return f"{make}({items})" if hasattr(arg, "_fields") else f"{make}({_tuple([items] if arg else [])})"
        raise TypeError(f"expected an FX argument (a node, literal, container or slice), got {type(arg).__name__}")

    def call_args(self, args, kwargs) -> str:
        named = []
        for k, v in kwargs.items():
            if not k.isidentifier() or keyword.iskeyword(k):
                raise ValueError(f"expected keyword argument names, got {k!r}")
            named.append(f"{k}={self.expr(v)}")
        return ", ".join([self.expr(a) for a in args] + named)


def _tuple(items) -> str:
    items = list(items)
    return f"({', '.join(items)},)" if items else "()"


def _has_node(arg) -> bool:
    found = []
    torch.fx.node.map_arg(arg, found.append)
    return bool(found)


def build_plan(stitch: torch.fx.GraphModule, calls: dict[str, Callable], n: int, size: int,
               graphs: dict[str, GraphPiece] | None = None) -> Callable:
    """The replay function of the stitch for calls of n rows run at `size`.

    calls: what the stitch calls per piece at (n, size), by submodule name (an eager
    piece's code, a recovery's re-split; see `runtime.Stitch.calls`). graphs: the graph
    pieces by submodule name (`runtime.PieceRunner.replays_graphs`): their graphs are launched
    directly, never called.
    Raises NotCaptured when a graph piece holds no graph for that size (it still has to
    capture); any other exception means the plan cannot be made (`ReplayPlans` falls back).
    """
    out = _Writer(stitch, calls, graphs or {}, n, size)
    last_use = _last_uses(stitch.graph)
    placeholders = 0
    for node in stitch.graph.nodes:
        if node.op == "output":  # the last line: nothing runs after a return
            out.lines.append(f"return {out.expr(node.args[0])}")
            break
        out.values[node] = f"args[{placeholders}]" if node.op == "placeholder" else _write_node(out, node)
        placeholders += node.op == "placeholder"  # read where used: most are parameters, never read
        # As FX's own code does: let an eager piece's result go once nothing reads it.
        done = [out.values[d] for d in last_use.get(node, ()) if out.values[d].startswith("v_")]
        if done:
            out.lines.append(" = ".join(done) + " = None")
    return _compile(out, n, size)


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


def _write_node(out: _Writer, node: torch.fx.Node) -> str:
    """Write what `node` does per call; return the source that names its value (a local,
    or a constant)."""
    var = f"v_{node.name}"
    if node.op == "get_attr":
        return out.constant(_fetch_attr(out.stitch, node.target), "attr")
    if node.op == "call_module":
        return _write_module_call(out, node, var)
    if node.op == "call_function" and node.target is operator.getitem and _is_node_in(node.args[0], out.narrowed):
        source, index = node.args
        out.graph_outputs[node] = out.graph_outputs[source][index]
        return out.constant(out.narrowed[source][index], "out")
    if node.op == "call_function" and node.target is operator.getitem and type(node.args[1]) is int:
        out.lines.append(f"{var} = {out.expr(node.args[0])}[{node.args[1]}]")
    elif node.op == "call_function":
        out.lines.append(f"{var} = {out.constant(node.target, 'fn')}({out.call_args(node.args, node.kwargs)})")
    elif node.op == "call_method":
        if not (node.target.isidentifier() and not keyword.iskeyword(node.target)):
            raise ValueError(f"expected a method name, got {node.target!r} at {node.format_node()}")
        receiver, *args = node.args
        out.lines.append(f"{var} = {out.expr(receiver)}.{node.target}({out.call_args(args, node.kwargs)})")
    else:
        raise ValueError(f"expected a stitch node, got {node.format_node()}")
    return var


def _is_node_in(arg, nodes: dict) -> bool:
    return isinstance(arg, torch.fx.Node) and arg in nodes


def _write_module_call(out: _Writer, node: torch.fx.Node, var: str) -> str:
    """A piece: a graph piece replays its graph (its outputs are constants, views of the
    graph's output buffers); an eager piece is called with its arguments."""
    graph = _captured(out.graphs.get(node.target), out.size)
    if graph is None:
        call = out.calls[node.target]
        out.lines.append(f"{var} = {out.constant(call, 'call')}({out.call_args(node.args, node.kwargs)})")
        return var
    if node.kwargs:
        raise ValueError(f"expected a graph piece called with positional arguments, got {node.format_node()}")
    _write_replay(out, node, graph)
    out.graph_outputs[node] = graph.outputs
    with torch.inference_mode(False):  # views usable in and outside inference mode
        out.narrowed[node] = tuple(narrow(o, d, out.n) for o, d in zip(graph.outputs, graph.output_dims))
    return out.constant(out.narrowed[node], "out")


def _captured(runner: GraphPiece | None, size: int) -> CapturedGraph | None:
    """The graph a graph piece replays at `size`, or None for a piece that is called;
    raises NotCaptured for a graph piece with no graph of that size yet."""
    if runner is None:
        return None
    graph = runner.captured_graph(size)
    if graph is None:
        raise NotCaptured(size)
    return graph


def _write_replay(out: _Writer, node: torch.fx.Node, graph: CapturedGraph) -> None:
    """Fill the graph's buffers from its arguments, then launch it."""
    n, size = out.n, out.size
    for i, static in graph.inputs:
        arg = node.args[i]
        source = out.graph_outputs.get(arg) if isinstance(arg, torch.fx.Node) else None
        if isinstance(source, torch.Tensor) and static.reads_in_place(source):
            continue  # another graph's output, already where this graph reads it
        x = out.expr(arg)
        if not static.repeated and (n == size or not static.dims):  # what copy_in comes down to
            fill = f"{out.constant(static.buffer.copy_, 'copy')}({x})"
        else:
            fill = (f"{out.constant(copy_in, 'copy_in')}({out.constant(static.buffer, 'buf')}, {x}, "
                    f"{out.expr(static.dims)}, {n}, {size}, {out.expr(static.repeated)})")
        check = f"{x}.data_ptr() != {out.expr(static.address)} or {x}.stride() != {out.expr(static.stride)}"
        out.lines.append(f"if {check}: {fill}")
    out.lines.append(f"{out.constant(graph.replay, 'replay')}()")


def _fetch_attr(module: torch.nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _compile(out: _Writer, n: int, size: int) -> Callable:
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

    A plan is a fast path, never a requirement: where one cannot be made (an argument it
    cannot write, a node it does not know), the calls of that (n, size) run the stitch
    from then on, after one warning for the graph.

    stitch: the runtime's `runtime.Stitch`, whose runners are read when a plan is made
    (a recovery replaces one, and says so through `graphs_changed`).
    name: the graph's, for the log ("graph<k>").
    """

    kind = "replay plan"

    def __init__(self, stitch: Pieces, session, name: str = "graph"):
        self.stitch = stitch
        self.session = session
        self.name = name
        self.made = 0  # plans made over the runtime's life (a plan per size, again after a change)
        self._plans: dict[tuple[int, int], Callable | None] = {}
        # (n, size) -> why no plan could be made; kept over `clear`: the stitch it failed on stays
        self.failures: dict[tuple[int, int], str] = {}
        session.add_plans(self)

    def clear(self) -> None:
        self._plans.clear()

    def run(self, args: tuple, n: int, size: int | None):
        """The call's outputs from its plan; None (declined) where there is none yet, or
        no graph runs, or graphs are captured ahead of time."""
        if size is None or self.session.mode is not Mode.LAZY:
            return None
        plan = self.get(n, size)
        return None if plan is None else plan(args)

    def get(self, n: int, size: int) -> Callable | None:
        """The plan for a call of n rows at `size`; None: run the stitch (it captures, or no
        plan can be made)."""
        plan = self._plans.get((n, size), _UNMADE)  # every call: one lookup
        if plan is _UNMADE:
            plan = self._plans[(n, size)] = self._make(n, size)
        return plan

    def _make(self, n: int, size: int) -> Callable | None:
        if (n, size) in self.failures:
            return None
        try:
            graphs = {name: r for name, r in self.stitch.runners.items() if r.replays_graphs}
            plan = build_plan(self.stitch.stitch, self.stitch.calls(n, size), n, size, graphs)
        except NotCaptured:
            return None
        except Exception as e:  # a fast path that fails to build must not fail the call
            self._fall_back(n, size, e)
            return None
        self.made += 1
        log.debug("cgcompile: replay plan for %s, n=%d at size %d:\n%s", self.name, n, size, plan.source)
        return plan

    def _fall_back(self, n: int, size: int, error: Exception) -> None:
        """Warn once per graph; other sizes that fail after it log at debug level."""
        level = logging.DEBUG if self.failures else logging.WARNING
        self.failures[(n, size)] = f"{type(error).__name__}: {error}"
        log.log(level, "cgcompile: no replay plan for %s at n=%d, size %d (%s: %s); its calls of that size "
                "run the stitch instead", self.name, n, size, type(error).__name__, error)


_UNMADE = object()
