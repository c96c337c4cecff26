"""Padding safety: can the rows that padding appends change a real row's result?

A call of size n replays graphs captured at a capture size N >= n: the capturable pieces
see N rows along the capture dimension, the last N - n of them zeros. That is only sound
when every capturable node keeps rows apart: real row i of every output depends on
row i of the inputs alone (and on tensors without the capture dimension). This pass
proves that per node with a conservative rule, and records why where it cannot.

A node that touches the capture dimension (a tensor input or output with it, or a
scalar argument derived from it) is safe when all of these hold:

  - every tensor it reads or writes has the capture dimension as one plain dimension
    (s0), not inside an expression (s0*7 after a flatten) and not twice ([s0, s0]);
  - if any input has the dimension, an output has it too: otherwise the op reduced or
    contracted over it (mean(0), x.T @ x, a histogram over tokens, x[-1]);
  - it reads the capture size as a shape only (view(s0, -1), zeros(s0, d), an
    arange(s0) or [:s0] of positions, which give row i the value i at any size), never
    as a value (x + x.shape[0], x / s0);
  - the op is known to keep rows apart where the dimension sits: pointwise ops (torch's
    `pointwise` tag) whose operands broadcast elementwise along it, views and reshapes
    that keep the rows' order, reductions and contractions (the two rules above already
    caught those over the dimension), norms, scans, sorts and softmax along other dims,
    per-sample ops (convolutions, pooling) with the dimension as the batch, gathers that
    index other dims;
  - or else, the op is one of torch's own and its decomposition into core ATen ops
    (`aten_trace`, on the node's fake values) passes these rules node by node. That is
    how ops without the tag are proven: hardswish is add, clamp, mul, div; prelu a view
    of its weight over the channels and a where. Rows kept apart by every step are kept
    apart by the whole. A write into an argument is proven only when it goes into the
    argument itself (hardswish(x, inplace=True)), which the rule for writes then checks.

Random ops (`nondeterministic_seeded`: rand_like, bernoulli, dropout and rrelu in
training) are unsafe, although each draws per element: the values a real row draws
depend on the padded size (the generator's offset advances by the padded element
count, and an element's draw by its position among them), so a padded call draws
other numbers for its real rows than an unpadded one, and the generator is left
elsewhere for every later op.

Anything else that touches the dimension, custom ops included, is unsafe: the pass
cannot see inside it. Sums over the dimension are unsafe too even though zero rows add
nothing, because a nonlinear op before the sum may have made the padding rows nonzero.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable

import sympy
import torch
from torch.fx import GraphModule, Node

from .aten_trace import AtenTrace, trace_to_aten
from .attention_mask import additive_attention_mask
from .graph_values import example_value, storage_of, tensors_in
from .mutation import mutated_base, view_base, written_args
from .split_rule import is_floating


@dataclasses.dataclass(frozen=True)
class PaddingHazard:
    """Why padding rows could reach a real row's result at one node."""

    node: str
    detail: str

    def __str__(self) -> str:
        return f"{self.node}: {self.detail} [padding_unsafe]"


def find_padding_hazards(gm: GraphModule, symbol: sympy.Symbol | None) -> dict[Node, PaddingHazard]:
    """Every node of `gm` (a capturable piece) at which padding could change a result."""
    if symbol is None:
        return {}
    hazards = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or is_floating(node):
            continue
        detail = _hazard(node, symbol)
        if detail is not None:
            hazards[node] = PaddingHazard(node.name, detail)
    return hazards


def find_state_hazards(inputs: list[Node], symbol: sympy.Symbol | None,
                       static_inputs: frozenset[str]) -> tuple[PaddingHazard, ...]:
    """Parameters and buffers among a piece's `inputs` sized by the capture dimension (a
    recurrent layer's state held by the module, marked static): a graph reads them in
    place, so they are never padded while the rows around them are."""
    if symbol is None:
        return ()
    return tuple(
        PaddingHazard(node.name, f"module state {_shape(example_value(node))} is sized by the capture "
                                 f"dimension {symbol} and read in place, so it cannot be padded")
        for node in inputs
        if node.op == "placeholder" and node.name in static_inputs
        and isinstance(example_value(node), torch.Tensor) and _mentions(example_value(node), symbol)
    )


# -- the rule ----------------------------------------------------------------------------


def _hazard(node: Node, symbol: sympy.Symbol, decompose: bool = True) -> str | None:
    """Why padding could change a result at `node`, or None. decompose: whether an op
    the rules do not know is traced to ATen and judged by its parts (not for those parts)."""
    inputs = [t for a in _tensor_args(node) for t in tensors_in(example_value(a))]
    outputs = tensors_in(example_value(node))
    if not inputs and not outputs:
        return None  # no rows involved: assertions on sizes, grad-mode switches
    scalars = _capture_scalars(node, symbol)
    if not scalars and not any(_mentions(t, symbol) for t in inputs + outputs):
        return None
    op = _op_name(node)
    return (
        _layout_rule(op, inputs, outputs, symbol)
        or _write_through_view_rule(op, node, symbol)
        or _reduction_rule(op, inputs, outputs, symbol)
        or _scalar_rule(op, node, scalars)
        or _op_rule(op, node, symbol, decompose)
    )


def _layout_rule(op: str, inputs, outputs, symbol) -> str | None:
    for role, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            dims = capture_dims(t, symbol)
            if dims is None:
                return (
                    f"{op} has an {role} of shape {_shape(t)}, with the capture dimension {symbol} "
                    f"inside an expression: padding cannot tell its real rows from the padding"
                )
            if len(dims) > 1:
                return (
                    f"{op} has an {role} of shape {_shape(t)}, with the capture dimension in dims "
                    f"{dims}: rows meet padding rows"
                )
    return None


def _write_through_view_rule(op: str, node: Node, symbol) -> str | None:
    target, base = mutated_base(node)
    return _view_write_rule(op, target, base, symbol)


def _view_write_rule(op: str, target, base: Node | None, symbol) -> str | None:
    # cache[:n].copy_(v): the view has the capture dimension, the buffer under it does
    # not, and a padded graph would write its padding rows into the buffer's rows n..
    if base is None or base is target:
        return None
    if capture_dims(example_value(target), symbol) and not capture_dims(example_value(base), symbol):
        return (
            f"{op} writes into a view of {base.name} {_shape(example_value(base))} that runs along the capture "
            f"dimension: a padded graph would write its padding rows there too"
        )
    return None


def _reduction_rule(op: str, inputs, outputs, symbol) -> str | None:
    source = next((t for t in inputs if capture_dims(t, symbol)), None)
    if source is None or op in _METADATA_ONLY or op == "setitem":  # setitem returns None
        return None
    if not any(capture_dims(t, symbol) for t in outputs):
        dim = capture_dims(source, symbol)[0]
        return f"{op} reduces or indexes over the capture dimension (dim {dim} of {_shape(source)})"
    return None


def _scalar_rule(op: str, node: Node, scalars: list[tuple[Any, Any]]) -> str | None:
    for position, value in scalars:
        if not _is_shape_position(node, op, position) and op == "setitem":
            return (f"setitem writes rows up to the capture size ({value}): a padded graph would write "
                    f"its padding rows there too")
        if not _is_shape_position(node, op, position):
            return f"{op} uses the capture size ({value}) as a value, and a padded graph would use the padded size"
    return None


def _op_rule(op: str, node: Node, symbol, decompose: bool) -> str | None:
    if op in _ROW_WISE or _unpacks_tuple(node, op) or _is_inactive_dropout(op, node):
        return None
    if _is_pointwise(node, op):
        return _broadcast_rule(op, node, symbol)
    if node.target is additive_attention_mask:  # the mask rewrite's own function: elementwise
        return None
    if op in _RESHAPES:
        return _reshape_rule(op, node, symbol)
    if op in _ALONG_DIM:
        return _along_dim_rule(op, node, symbol)
    if op in _TRAILING_NORMS:
        return _trailing_norm_rule(op, node, symbol)
    if op in _PER_SAMPLE:
        return _per_sample_rule(op, node, symbol)
    if op in _INDEXING:
        return _indexing_rule(op, node, symbol)
    return _decomposition_rule(op, node, symbol, decompose)


# -- per kind of op ------------------------------------------------------------------------


def _broadcast_rule(op: str, node: Node, symbol) -> str | None:
    # Broadcasting aligns dims from the right: an operand's row dim must land on the
    # output's, so that output row i reads row i of each operand (and one row, or none,
    # of an operand without the dimension).
    outputs = tensors_in(example_value(node))
    if not outputs:
        return None
    out_dims = capture_dims(outputs[0], symbol) or ()
    for t in (t for a in _tensor_args(node) for t in tensors_in(example_value(a))):
        for d in capture_dims(t, symbol) or ():
            if d + outputs[0].dim() - t.dim() not in out_dims:
                return (f"{op} broadcasts {_shape(t)} to {_shape(outputs[0])} with the capture dimension in "
                        f"another place: rows meet other rows")
    return None


def _decomposition_rule(op: str, node: Node, symbol, decompose: bool) -> str | None:
    unknown = f"{op} is not known to keep rows apart along the capture dimension; padding it is unproven"
    if _draws_random(node):
        return (f"{op} draws random numbers: a padded call draws other numbers for the real rows (the "
                f"generator advances by the padded element count)")
    if not decompose:
        return unknown
    trace = trace_to_aten(node)
    if isinstance(trace, str):
        return f"{unknown} ({trace})"
    for inner in trace.gm.graph.nodes:
        if inner.op == "call_function" and not is_floating(inner):
            detail = _hazard(inner, symbol, decompose=False) or _argument_write_rule(op, inner, trace, symbol)
            if detail is not None:
                return f"{op} decomposes into {inner.target}, and {detail}"
    return None


def _argument_write_rule(op: str, inner: Node, trace: AtenTrace, symbol) -> str | None:
    """A write of a decomposed op into memory of the call's arguments: proven only into an
    argument itself (a view of it may run along rows, which the trace does not show)."""
    placeholders = [n for n in trace.gm.graph.nodes if n.op == "placeholder"]
    sources = {storage_of(example_value(p)): (p, s) for p, s in zip(placeholders, trace.sources)}
    for target in written_args(inner):
        placeholder, source = sources.get(storage_of(example_value(target)), (None, None))
        if source is None:
            continue  # memory the op allocated itself
        if target is not placeholder:
            return f"it writes into part of its argument {source.name}"
        if hazard := _view_write_rule(op, source, view_base(source), symbol):
            return hazard
    return None


def _is_inactive_dropout(op: str, node: Node) -> bool:
    """Dropout with training=False (every module in eval mode): the identity."""
    return op == "dropout" and _arg(node, 2, "training" if "training" in node.kwargs else "train") is False


def _draws_random(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _reshape_rule(op: str, node: Node, symbol) -> str | None:
    # A reshape keeps each row's elements together when the elements before the capture
    # dimension are as many in the output as in the input: rows then stay rows.
    source, result = _first_tensor(node), example_value(node)
    before = _elements_before_capture_dim(source, symbol)
    after = _elements_before_capture_dim(result, symbol)
    if before is None or after is None or sympy.simplify(before - after) != 0:
        return f"{op} from {_shape(source)} to {_shape(result)} moves elements across rows of the capture dimension"
    return None


def _along_dim_rule(op: str, node: Node, symbol) -> str | None:
    source = _first_tensor(node)
    dims = _resolve_dims(node, _ALONG_DIM[op], source.dim())
    if dims is None:
        return f"{op} works over all elements or over dims that cannot be read from the graph"
    hit = set(dims) & set(capture_dims(source, symbol) or ())
    if hit:
        return f"{op} mixes rows along the capture dimension (dim {min(hit)} of {_shape(source)})"
    return None


def _trailing_norm_rule(op: str, node: Node, symbol) -> str | None:
    source = _first_tensor(node)
    shape = _arg(node, 1, "normalized_shape")
    count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
    if any(d >= source.dim() - count for d in capture_dims(source, symbol) or ()):
        return f"{op} normalises over the capture dimension ({_shape(source)}, last {count} dims)"
    return None


def _per_sample_rule(op: str, node: Node, symbol) -> str | None:
    source = _first_tensor(node)
    if capture_dims(source, symbol) not in ((), (0,)):
        return f"{op} computes per sample over dims 1.., and the capture dimension is one of them ({_shape(source)})"
    if op == "batch_norm" and _arg(node, 5, "training") is not False:
        return f"{op} in training mode takes statistics over the batch, which holds the padding rows"
    return None


def _indexing_rule(op: str, node: Node, symbol) -> str | None:
    source = _first_tensor(node)
    dims = capture_dims(source, symbol) or ()
    if op in ("embedding", "embedding_bag"):
        weight = example_value(_arg(node, 1, "weight"))
        return f"{op} looks rows up in a table with the capture dimension" if capture_dims(weight, symbol) else None
    if op in _WRITES and not dims and _capture_args(node, symbol):
        return (
            f"{op} writes rows chosen along the capture dimension into {_shape(source)}, which "
            f"has none: a padded graph would write its padding rows there too"
        )
    if op in ("getitem", "setitem"):
        return _subscript_rule(op, node, source, dims, symbol)
    spec = (2, "dim", None) if op == "take_along_dim" else (1, "dim", None)
    indexed = _resolve_dims(node, spec, source.dim())
    if indexed is None or set(indexed) & set(dims):
        return f"{op} takes elements across rows of the capture dimension ({_shape(source)})"
    return None


def _subscript_rule(op: str, node: Node, source: torch.Tensor, dims: tuple[int, ...], symbol) -> str | None:
    index = node.args[1] if len(node.args) > 1 else None
    per_dim = _index_per_dim(index, source.dim())
    if per_dim is None:
        return f"{op} with index {index!r} cannot be mapped to dims"
    for d, item in per_dim.items():
        if d in dims and not _keeps_rows(item):
            return f"{op} picks rows of the capture dimension (dim {d} of {_shape(source)}) with {item!r}"
        if d not in dims and _holds_row_positions(item, symbol):
            # A mask [B, L] whose B is another symbol, indexed with arange(n) (transformers'
            # padding mask function): padded, the positions run past its end.
            return (f"{op} indexes dim {d} of {_shape(source)}, which is not the capture dimension, with "
                    f"positions up to the capture size ({item.name}): a padded graph indexes past its rows")
    return None


# Ops that keep a tensor of row positions one (views, casts, a constant offset).
_KEEPS_POSITIONS = frozenset({"getitem", "unsqueeze", "view", "reshape", "expand", "to", "long", "int",
                              "contiguous", "clone", "add", "sub"})


def _holds_row_positions(item, symbol, depth: int = 0) -> bool:
    """Whether `item` holds 0..n-1 along the capture dimension (an `arange` up to its size,
    viewed or offset by a constant): values up to the padded size in a padded graph."""
    if not isinstance(item, Node) or not isinstance(example_value(item), torch.Tensor) or depth > 16:
        return False
    op = _op_name(item)
    if op == "arange":
        return any(symbol in value.node.expr.free_symbols
                   for position, arg in _positions(item) for _, value in _scalar_leaves(arg, (position,)))
    if op in _KEEPS_POSITIONS:
        tensors = [a for a in item.args if isinstance(a, Node) and isinstance(example_value(a), torch.Tensor)]
        return len(tensors) == 1 and _holds_row_positions(tensors[0], symbol, depth + 1)
    return False


def _capture_args(node: Node, symbol) -> bool:
    return any(capture_dims(t, symbol) for a in _tensor_args(node) for t in tensors_in(example_value(a)))


def _unpacks_tuple(node: Node, op: str) -> bool:
    return op == "getitem" and isinstance(node.args[0], Node) and not isinstance(example_value(node.args[0]), torch.Tensor)


def _keeps_rows(item) -> bool:
    """A full slice, or [:s0] / [0:s0] (the first n rows: the same rows at every size)."""
    if not isinstance(item, slice) or item.step not in (None, 1) or item.start not in (None, 0):
        return False
    return item.stop is None or isinstance(item.stop, Node)


def _index_per_dim(index, ndim: int) -> dict[int, Any] | None:
    """Map each item of a subscript to the input dim it applies to (None: cannot tell)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        return None
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    result, d = {}, 0
    for item in items:
        if item is Ellipsis:
            d += ndim - consumed
        elif item is not None:
            result[d] = item
            d += 1
    return result


# -- reading the graph ---------------------------------------------------------------------


def capture_dims(value, symbol) -> tuple[int, ...] | None:
    """The dims of a tensor whose size is the capture symbol; None when it sits inside an
    expression (s0*7, s0 + 1); () for non-tensors and tensors without it."""
    if not isinstance(value, torch.Tensor):
        return ()
    dims = []
    for d, size in enumerate(value.shape):
        if not isinstance(size, torch.SymInt):
            continue
        expr = size.node.expr
        if expr == symbol:
            dims.append(d)
        elif symbol in expr.free_symbols:
            return None
    return tuple(dims)


def _mentions(t: torch.Tensor, symbol) -> bool:
    return any(isinstance(s, torch.SymInt) and symbol in s.node.expr.free_symbols for s in t.shape)


def _tensor_args(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes if tensors_in(example_value(a))]


def _capture_scalars(node: Node, symbol) -> list[tuple[tuple, Any]]:
    """(path, value) of every scalar argument derived from the capture symbol.

    path: the argument's position (an index into node.args or a kwarg name), then the
    index into each list, tuple or slice ("slice", k) that holds it."""
    found = []
    for position, arg in _positions(node):
        for path, value in _scalar_leaves(arg, (position,)):
            if symbol in value.node.expr.free_symbols:
                found.append((path, value))
    return found


def _positions(node: Node) -> Iterable[tuple[Any, Any]]:
    yield from enumerate(node.args)
    yield from node.kwargs.items()


def _scalar_leaves(arg, path: tuple) -> Iterable[tuple[tuple, Any]]:
    if isinstance(arg, Node):
        value = example_value(arg)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            yield path, value
    elif isinstance(arg, slice):
        for k, part in enumerate((arg.start, arg.stop, arg.step)):
            yield from _scalar_leaves(part, path + (("slice", k),))
    elif isinstance(arg, (tuple, list)):
        for k, item in enumerate(arg):
            yield from _scalar_leaves(item, path + (k,))


def _is_shape_position(node: Node, op: str, path: tuple) -> bool:
    """Whether the capture size at `path` is read as a size (fine) rather than a value."""
    position = path[0]
    if op in _SHAPE_METHODS and node.op == "call_method":
        return position != 0
    if op in _SHAPE_FACTORIES:
        return position in (0, "size") or (op != "full" and isinstance(position, int))
    if op == "new_full":
        return position in (1, "size")
    if op == "arange":
        # arange(s0) or arange(start, s0, step): the first n values do not depend on the size.
        return position in ("end", 0 if len(node.args) == 1 else 1)
    if op == "narrow":
        return position in (3, "length")
    if op == "getitem":
        # x[:s0] or x[a, :s0]: the first n entries, the same at every size. Not for a
        # write (setitem): a padded graph would write its padding rows there too.
        return position == 1 and path[-1] == ("slice", 1)
    return False


def _resolve_dims(node: Node, spec: tuple, ndim: int) -> tuple[int, ...] | None:
    """The dims an op works along, from its (position, keyword, default) spec."""
    position, keyword, default = spec
    value = _arg(node, position, keyword, default)
    if value is None:
        return None
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(v, int) for v in values) or ndim == 0:
        return None if ndim else ()
    return tuple(v % ndim for v in values)


def _arg(node: Node, position: int, keyword: str, default=None):
    """An argument of the op by its position after the input (or keyword), as a value."""
    # The input is args[0] in both forms: torch.softmax(x, 1) and x.softmax(1).
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    if position < len(node.args):
        return node.args[position]
    return default


def _first_tensor(node: Node) -> torch.Tensor:
    for arg in node.args:
        for a in ([arg] if isinstance(arg, Node) else [x for x in arg if isinstance(x, Node)] if isinstance(arg, (tuple, list)) else []):
            value = example_value(a)
            if isinstance(value, torch.Tensor):
                return value
    return tensors_in(example_value(node))[0]


def _elements_before_capture_dim(value, symbol):
    dims = capture_dims(value, symbol)
    if not dims or len(dims) != 1:
        return None
    return sympy.sympify(math.prod(_expr(s) for s in value.shape[: dims[0]]))


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _op_name(node: Node) -> str:
    """The op's plain name: "softmax" for torch.softmax, F.softmax, Tensor.softmax and
    aten.softmax; in-place and operator forms map to their op ("add" for add_ and iadd)."""
    target = node.target
    if node.op == "call_method":
        name = target
    elif node.op == "call_module":
        return f"module {target}"
    elif isinstance(target, torch._ops.OpOverload):
        namespace, _, name = target._schema.name.partition("::")
        if namespace != "aten":
            return f"{namespace}::{name}"
    elif isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        if namespace != "aten":
            return f"{namespace}::{name}"
    else:
        name = getattr(target, "__name__", str(target))
    name = _OPERATOR_NAMES.get(name, name)
    if name.endswith("_") and not name.startswith("_") and name[:-1] not in ("and", "or"):
        name = name[:-1]
    return name


@functools.lru_cache(maxsize=None)
def _aten_pointwise(name: str) -> bool:
    # A target that is no op (a method-wrapper such as `h.__eq__`, a builtin, a Python
    # function) has a name that may hit a plain attribute of the namespace: aten.__eq__
    # is the module's own method-wrapper. Only an op packet carries tags.
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return _packet_pointwise(packet)


def _packet_pointwise(packet: torch._ops.OpOverloadPacket) -> bool:
    # By name the overload is unknown: pointwise when one overload is and none draws
    # random numbers (rrelu is both; its decomposition tells training from eval).
    tags = [getattr(packet, o).tags for o in packet.overloads()]
    return any(torch.Tag.pointwise in t for t in tags) and not any(torch.Tag.nondeterministic_seeded in t for t in tags)


def _is_pointwise(node: Node, op: str) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.pointwise in target.tags and torch.Tag.nondeterministic_seeded not in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket) and "::" in op:
        return _packet_pointwise(target)
    return "::" not in op and _aten_pointwise(op)


# -- the op tables ----------------------------------------------------------------------------

_OPERATOR_NAMES = {
    "iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "div", "truediv": "div",
    "floordiv": "floor_divide", "ifloordiv": "floor_divide", "mod": "remainder", "imod": "remainder",
    "and_": "bitwise_and", "or_": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not",
    "iand": "bitwise_and", "ior": "bitwise_or", "ixor": "bitwise_xor", "ipow": "pow", "pos": "positive",
    "imatmul": "matmul", "__getitem__": "getitem", "__setitem__": "setitem", "sym_size": "size",
}

# Row-wise beyond what the layout and reduction rules check: conversions, copies, views
# that keep every dim, structural ops whose shapes show any crossing of rows, reductions
# and contractions (over the capture dimension they drop it from the output), and
# metadata-only constructors.
_ROW_WISE = frozenset({
    "to", "float", "half", "bfloat16", "double", "int", "long", "bool", "type", "type_as",
    "contiguous", "clone", "detach", "copy", "fill", "zero", "floor_divide",
    "alias", "lift_fresh_copy", "masked_fill", "where", "positive", "getattr",
    "transpose", "swapaxes", "permute", "t", "unsqueeze", "squeeze", "expand", "expand_as",
    "broadcast_to", "movedim", "split", "chunk", "tensor_split", "cat", "concat", "stack",
    "unbind", "repeat_interleave_self", "one_hot", "tril", "triu",
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean",
    "norm", "logsumexp", "all", "any", "argmax", "argmin", "count_nonzero", "nansum", "aminmax",
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "outer", "dot", "mv",
    "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "zeros", "ones", "empty", "full", "arange", "size", "dim",
    # Tensor-parallel collectives: row i of the result reduces row i of every rank's input,
    # and the ranks of a group run the same batch, so pad to the same size: padding rows
    # only ever meet padding rows (`cgcompile.parallel.distributed.check_same_rows` checks it).
    "_c10d_functional::all_reduce", "_c10d_functional::all_reduce_", "_c10d_functional::wait_tensor",
    "cgcompile::all_reduce",  # the same all-reduce, routed to symmetric memory (fast_all_reduce.py)
})
_METADATA_ONLY = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "size", "dim"})
_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"})
# op -> (position of the dim argument among the op's arguments, keyword, default)
_ALONG_DIM = {
    "softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "_softmax": (1, "dim", None),
    "cumsum": (1, "dim", None), "cumprod": (1, "dim", None), "cummax": (1, "dim", None),
    "cummin": (1, "dim", None), "logcumsumexp": (1, "dim", None), "sort": (1, "dim", -1),
    "argsort": (1, "dim", -1), "topk": (2, "dim", -1), "kthvalue": (2, "dim", -1),
    "flip": (1, "dims", None), "roll": (2, "dims", None), "normalize": (2, "dim", 1),
    "glu": (1, "dim", -1), "diff": (2, "dim", -1), "median": (1, "dim", None), "mode": (1, "dim", -1),
    "msort": (99, "", 0), "fliplr": (99, "", 1), "flipud": (99, "", 0),
}
_TRAILING_NORMS = frozenset({"layer_norm", "rms_norm"})
_PER_SAMPLE = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d",
    "group_norm", "instance_norm", "batch_norm", "interpolate", "upsample", "pixel_shuffle",
    "pixel_unshuffle", "unfold", "fold", "pad",
})
_INDEXING = frozenset({
    "embedding", "embedding_bag", "getitem", "setitem", "index_select", "gather", "take_along_dim",
    "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill", "index_put",
})
_WRITES = frozenset({"setitem", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy",
                     "index_fill", "index_put"})
_SHAPE_METHODS = frozenset({"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "repeat"})
_SHAPE_FACTORIES = frozenset({"zeros", "ones", "empty", "rand", "randn", "full", "broadcast_to", "reshape",
                             "view", "expand"})
