"""The split rule: which nodes cannot live inside a CUDA graph, and why.

`classify_nodes` is a pure function of the graph and its fake-tensor metadata. A node
is eager (not capturable) when any rule below holds; the first rule that holds is its
reason. Size computations (ints, SymInts, `torch.Size`) are never classified: the split
pass copies them into every piece that needs them.

Rules, in order:
  split_op      the op is attention or another op the user or torch marks as unsafe
  host_sync     the op reads device data on the host (`.item()`, `.tolist()`, nonzero)
  device_copy   the output lives on another device than the inputs (`.to("cpu")`), or
                the op builds an accelerator tensor from host data (`torch.tensor(list,
                device="cuda")`): a copy from host memory that a graph cannot replay
  cpu_tensor    the graph runs on an accelerator but this op computes on the CPU, or
                reads a CPU tensor: a graph input, a constant (`get_attr`), a 0-dim
                scalar (`x + torch.tensor(eps)`), CPU indices, or a CPU tensor whose
                size it reads (the split hands that tensor to the piece); a CUDA graph
                would replay the value it was captured with
  collective    the graph runs on an accelerator and a functional collective (or the
                wait for one) uses a process group whose backend there is not NCCL:
                only NCCL kernels can be captured (gloo copies through the host)
  dynamic_shape an input or output shape depends on a symbolic size that is not the
                capture dimension (a growing KV cache's length, data-dependent sizes)
  dynamic_scalar the op reads the value of such a symbolic size as a scalar argument
                (`arange(n) + cache_len` for rotary positions, `x * t.item()`): the
                output shape is fixed, but a CUDA graph would replay the value it
                was captured with
  input_mutation the op writes (in place, into a schema-marked argument, or `out=`: see
                `mutation.py`) into a graph input that is copied into the graph rather
                than read at its own address (as parameters, buffers, tensors marked
                static and, under CUDA graphs, fixed-shape tensors the graph writes in
                place are: the `mutable_inputs` the caller passes leave those out), or
                into a value an earlier piece made (one made before the last eager
                node); a graph would write into its private copy instead. Views of
                such a graph input or value that an op writes into (or through) are
                eager too: made in a graph, they would view its copy
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import sympy
import torch
from torch.fx import GraphModule, Node

from .graph_values import example_value, free_symbols, is_size_value, tensors_in
from .mutation import view_base, view_parent, written_args


@dataclasses.dataclass(frozen=True)
class SplitReason:
    rule: str
    detail: str
    node: str

    def __str__(self) -> str:
        return f"{self.node}: {self.detail} [{self.rule}]"


_HOST_SYNC_METHODS = frozenset({"item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__"})
_HOST_SYNC_FUNCTIONS = frozenset({torch.nonzero, torch.Tensor.item, torch.Tensor.tolist})
# Aten ops that wait for the device (their result is a host value, or its shape depends on
# data): the split rule's host_sync, and what the breakable recorder breaks at.
HOST_SYNC_ATEN_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero", "aten::equal",
    "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
})
_FROM_HOST_DATA_FUNCTIONS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_FROM_HOST_DATA_METHODS = frozenset({"new_tensor"})


def is_floating(node: Node) -> bool:
    """Size computations and constants: copied into each consumer piece, never a piece input."""
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    return is_size_value(example_value(node)) and _host_sync(node) is None


def classify_nodes(
    gm: GraphModule,
    *,
    op_reason: Callable[[Any], str | None],
    capture_symbol: sympy.Symbol | None,
    on_accelerator: bool,
    mutable_inputs: frozenset[str],
) -> dict[Node, SplitReason]:
    """Map every node that must run eagerly to its reason; absent nodes are capturable.

    op_reason(target) says why an op is a splitting op (or None); mutable_inputs holds the
    names of placeholders that are neither parameters nor buffers.
    """
    allowed = {capture_symbol} if capture_symbol is not None else set()
    cpu_reads = _CpuReads(gm) if on_accelerator else None
    eager = {}
    written_views = _views_written_through(gm)
    position: dict[Node, int] = {}
    last_eager = -1
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        reason = (_reason(node, op_reason, allowed, cpu_reads, mutable_inputs)
                  or _written_input_view_rule(node, written_views, mutable_inputs)
                  or _earlier_piece_rule(node, position, last_eager, written_views))
        if reason is not None:
            eager[node] = SplitReason(reason[0], reason[1], node.name)
            last_eager = i
    return eager


def _reason(node, op_reason, allowed, cpu_reads: _CpuReads | None, mutable_inputs) -> tuple[str, str] | None:
    """cpu_reads: None when the graph runs on the CPU (nothing there is captured)."""
    why = op_reason(node.target) if node.op == "call_function" else None
    if why:
        return "split_op", why
    sync = _host_sync(node)
    if sync:
        return "host_sync", sync
    if is_floating(node):
        return None
    on_accelerator = cpu_reads is not None
    collective = _collective_rule(node) if on_accelerator else None
    if collective:
        return "collective", collective
    outputs = tensors_in(example_value(node))
    return (
        _device_rule(node, outputs, on_accelerator)
        or (_cpu_read_rule(node, cpu_reads) if on_accelerator else None)
        or _symbol_rule(node, outputs, allowed)
        or _scalar_rule(node, allowed)
        or _mutation_rule(node, mutable_inputs)
    )


def _host_sync(node: Node) -> str | None:
    if node.op == "call_method" and node.target in _HOST_SYNC_METHODS:
        return f"Tensor.{node.target}() copies device data to the host"
    if node.op == "call_function":
        if node.target in _HOST_SYNC_FUNCTIONS:
            return f"{node.target.__name__} copies device data to the host"
        name = getattr(getattr(node.target, "_schema", None), "name", None)
        if name in HOST_SYNC_ATEN_OPS:
            return f"{name} copies device data to the host"
    return None


def _collective_rule(node: Node) -> str | None:
    """Why a functional collective, or the wait for one, cannot be captured (None if it can)."""
    collective = _waited_collective(node)
    if collective is None:
        return None
    schema = collective.target._schema
    names = [a.name for a in schema.arguments]
    group = collective.kwargs.get("group_name")
    if group is None and "group_name" in names and names.index("group_name") < len(collective.args):
        group = collective.args[names.index("group_name")]
    devices = {t.device.type for t in tensors_in(example_value(collective))} or {"cuda"}
    backend = process_group_backend(group, devices.pop()) if isinstance(group, str) else None
    if backend == "nccl":
        return None
    return (f"{schema.name} on process group {group!r} with backend {backend or 'unknown'}: "
            f"only NCCL collectives can be captured in a CUDA graph")


def _waited_collective(node: Node) -> Node | None:
    """The `_c10d_functional` collective `node` runs or waits for (None for other ops)."""
    name = getattr(getattr(node.target, "_schema", None), "name", "") if node.op == "call_function" else ""
    if not name.startswith("_c10d_functional::"):
        return None
    if name == "_c10d_functional::wait_tensor":
        source = node.args[0] if node.args else None
        return _waited_collective(source) if isinstance(source, Node) else None
    return node


def _device_rule(node: Node, outputs: list[torch.Tensor], on_accelerator: bool) -> tuple[str, str] | None:
    if on_accelerator and _builds_from_host_data(node):
        name = getattr(node.target, "__name__", node.target)
        return "device_copy", f"{name}(...) copies host data to the device on every call"
    in_devices = {t.device for a in node.all_input_nodes for t in tensors_in(example_value(a))}
    for out in outputs:
        if in_devices and out.device not in in_devices:
            return "device_copy", f"copies from {sorted(map(str, in_devices))} to {out.device}"
    if on_accelerator and any(out.device.type == "cpu" for out in outputs):
        return "cpu_tensor", "computes on CPU tensors, which a CUDA graph cannot hold"
    return None


def _cpu_read_rule(node: Node, cpu_reads: _CpuReads) -> tuple[str, str] | None:
    found = cpu_reads.read_by(node)
    if found is None:
        return None
    arg, source = found
    through = "" if arg is source else f" through the size computation {arg.name}, which hands it to the piece"
    # No semicolon: reasons are joined with "; ".
    return ("cpu_tensor", f"reads a CPU tensor {source.name}{through}, and a CUDA graph would replay "
                          f"the value it was captured with")


class _CpuReads:
    """Which CPU tensor, if any, each node reads: one of its arguments, a constant
    (`get_attr`, copied into every piece that reads it), or a tensor that a size computation
    among its arguments reads. Size computations are floating (`is_floating`): the split
    copies them into the piece and hands the piece the tensors they read, so
    `x.view(t.size(0), -1)` makes a CPU `t` an input of `x`'s piece."""

    def __init__(self, gm: GraphModule):
        # The CPU tensor each node is, or (a size computation) reads; in graph order, so
        # every argument's entry is there before its users'.
        self._source: dict[Node, Node | None] = {}
        for node in gm.graph.nodes:
            if any(t.device.type == "cpu" for t in tensors_in(_value(gm, node))):
                self._source[node] = node
            elif node.op != "get_attr" and is_floating(node):
                found = self.read_by(node)
                self._source[node] = found[1] if found else None

    def read_by(self, node: Node) -> tuple[Node, Node] | None:
        """(the argument, the CPU tensor it is or reads) for the first such argument, or None."""
        for arg in node.all_input_nodes:
            source = self._source.get(arg)
            if source is not None:
                return arg, source
        return None


def _value(gm: GraphModule, node: Node) -> Any:
    value = example_value(node)
    if value is None and node.op == "get_attr":  # a constant without metadata: the real one
        value = _fetch_attr(gm, node.target)
    return value


def _fetch_attr(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value


def _builds_from_host_data(node: Node) -> bool:
    """torch.tensor(data, device=...) and kin, with data to copy (`torch.tensor([])`, as
    Hugging Face's caches start, copies nothing and stays capturable)."""
    if node.op == "call_method":
        builds, data = node.target in _FROM_HOST_DATA_METHODS, node.args[1:2]
    else:
        builds, data = node.op == "call_function" and node.target in _FROM_HOST_DATA_FUNCTIONS, node.args[:1]
    empty = bool(data) and isinstance(data[0], (list, tuple)) and len(data[0]) == 0
    return builds and not empty


def _symbol_rule(node: Node, outputs: list[torch.Tensor], allowed: set) -> tuple[str, str] | None:
    # Inputs count too: a matmul that contracts over the cache length has an output of
    # fixed shape, but its kernel reads a buffer whose size a CUDA graph would freeze.
    inputs = [t for a in node.all_input_nodes for t in tensors_in(example_value(a))]
    for role, tensors in (("output", outputs), ("input", inputs)):
        for t in tensors:
            other = free_symbols(t) - allowed
            if other:
                where = "shape" if other & _shape_symbols(t) else "strides"  # only in the strides: say so
                layout = tuple(t.shape) if where == "shape" else tuple(t.stride())
                return "dynamic_shape", f"{role} {where} {layout} {_not_capture_dim(other, allowed)}"
    return None


def _shape_symbols(t: torch.Tensor) -> set:
    return {sym for d in t.shape if isinstance(d, torch.SymInt) for sym in d.node.expr.free_symbols}


def _scalar_rule(node: Node, allowed: set) -> tuple[str, str] | None:
    # A shape argument such as view(s1, -1) names s1 in the output shape too, so
    # `_symbol_rule` has already fired for it; this rule catches values, not shapes.
    for arg in node.all_input_nodes:
        value = example_value(arg)
        if isinstance(value, torch.Tensor) or not is_size_value(value):
            continue
        other = free_symbols(value) - allowed
        if other:
            return (
                "dynamic_scalar",
                f"reads a scalar that {_not_capture_dim(other, allowed)}, "
                f"and a CUDA graph would replay the value it was captured with",
            )
    return None


def _not_capture_dim(symbols: set, allowed: set) -> str:
    names = ", ".join(sorted(map(str, symbols)))
    if not allowed:  # every input's capture candidate has a fixed size (batch-1 decode, say)
        # No semicolon: reasons are joined with "; ".
        return f"depends on the dynamic size {names} (a graph without a capture dimension captures fixed shapes only)"
    return f"depends on {names}, not on the capture dimension ({', '.join(map(str, allowed))})"


def _mutation_rule(node: Node, mutable_inputs: frozenset[str]) -> tuple[str, str] | None:
    for target in written_args(node):
        base = view_base(target)
        if base.op == "placeholder" and base.name in mutable_inputs:
            return "input_mutation", f"writes in place into graph input {base.name}"
    return None


def _written_input_view_rule(node: Node, written_views: set[Node],
                             mutable_inputs: frozenset[str]) -> tuple[str, str] | None:
    """A view of a graph input (not a parameter or buffer) that an op writes into or
    through. The write is eager (`_mutation_rule`), but a graph that made the view would
    make it of its static copy of the input: the write would land in the copy, and a
    view read after a write into the input would read the copy."""
    if node not in written_views:
        return None
    base = view_base(node)
    if base.op == "placeholder" and base.name in mutable_inputs:
        return ("input_mutation", f"a view of graph input {base.name}, which an op writes into: "
                                  f"made in a graph, it would view the graph's copy of the input")
    return None


def _earlier_piece_rule(node: Node, position: dict[Node, int], last_eager: int,
                        written_views: set[Node]) -> tuple[str, str] | None:
    """An in-place write into a value made before the last eager node, or a view of such
    a value that a later op writes through: the value belongs to an earlier piece, and a
    graph of this one would hold (and write into) its own copy of it."""
    if node in written_views:
        base = _origin(view_base(node))
        if base.op != "placeholder" and position.get(base, last_eager + 1) <= last_eager:
            return "input_mutation", f"a view of {base.name}, which an earlier piece made and an op writes into"
        return None
    for target in written_args(node):
        base = _origin(view_base(target))
        if base.op != "placeholder" and position.get(base, last_eager + 1) <= last_eager:
            return "input_mutation", f"writes in place into {base.name}, which an earlier piece made"
    return None


def _origin(node: Node) -> Node:
    """The node whose piece holds `node`: an element of a tuple lives with the op that made it."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node):
        if not isinstance(example_value(node.args[0]), torch.Tensor):
            return node.args[0]
    return node


def _views_written_through(gm: GraphModule) -> set[Node]:
    """Every view of a tensor that some op writes into, directly or through a view: such a
    view must alias the real tensor, so it may not be made inside a graph from its copy."""
    written = set()
    for node in gm.graph.nodes:
        written.update(_origin(view_base(target)) for target in written_args(node))
    return {
        node for node in gm.graph.nodes
        if node.op in ("call_function", "call_method") and view_parent(node) is not None
        and _origin(view_base(node)) in written
    }


def process_group_backend(group_name: str, device_type: str) -> str | None:
    """The backend ("nccl", "gloo") that the process group a functional collective names
    uses for `device_type`, or None when torch.distributed cannot resolve it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        group = _resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        return None
    for entry in dist.get_backend_config(group).split(","):
        kind, _, name = entry.partition(":")
        if kind == device_type:
            return name
    return None
