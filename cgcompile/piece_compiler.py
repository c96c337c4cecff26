"""Compile pieces once per distinct (code, input metadata), and share the result.

The layers of a transformer split into pieces with the same code and the same input
shapes and dtypes; only the parameters they are handed differ. Such pieces get one
compiled function, so compile time does not grow with depth. Symbolic sizes are
compared by position, not by name: layer 0's cache length may be s53 and layer 1's
s66, and their attention pieces still share one compiled function (a compiled
function reads every size from its inputs when it runs).
"""

from __future__ import annotations

from typing import Callable, Sequence

import sympy
import torch

from .compat import inductor_compile
from .passes import PieceSpec, example_value


def describe_input(value) -> str:
    """A compact, stable description of one piece input, e.g. "f32[s0, 64]" or "Sym(s0)"."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = ", ".join(str(s) for s in value.shape)
        return f"{dtype}[{shape}]"
    if isinstance(value, torch.SymInt):
        return f"Sym({value.node.expr})"
    return repr(value)


def _expressions(value) -> list:
    """The size expressions an input carries: shape and strides, or the SymInt itself."""
    if isinstance(value, torch.Tensor):
        return [*value.shape, *value.stride()]
    return [value] if isinstance(value, torch.SymInt) else []


def _canonical(values: list) -> Callable[[object], str]:
    """Rename symbols in order of first appearance (bare sizes first), so that pieces
    that differ only in their symbols' names get the same description."""
    order: dict[sympy.Symbol, sympy.Symbol] = {}
    exprs = [e.node.expr for v in values for e in _expressions(v) if isinstance(e, torch.SymInt)]
    for expr in exprs:
        if isinstance(expr, sympy.Symbol) and expr not in order:
            order[expr] = sympy.Symbol(f"c{len(order)}", integer=True)
    for expr in exprs:
        for symbol in sorted(expr.free_symbols, key=str):
            order.setdefault(symbol, sympy.Symbol(f"c{len(order)}", integer=True))

    def rename(x) -> str:
        return str(x.node.expr.xreplace(order)) if isinstance(x, torch.SymInt) else str(x)

    return rename


def _cache_key(spec: PieceSpec) -> tuple:
    values = [example_value(n) for n in spec.inputs]
    rename = _canonical(values)

    def meta(value):
        if isinstance(value, torch.Tensor):
            return (str(value.dtype), tuple(map(rename, value.shape)), tuple(map(rename, value.stride())), str(value.device))
        return rename(value) if isinstance(value, torch.SymInt) else repr(value)

    attrs = tuple(id(getattr(spec.graph, n.target)) for n in spec.graph.graph.nodes if n.op == "get_attr")
    return (spec.graph.code, tuple(meta(v) for v in values), attrs)


class PieceCompiler:
    """Turns a piece into a callable with Inductor; `compilations` counts real compiles."""

    def __init__(self, compiler: str):
        self.compiler = compiler
        self.compilations = 0
        self._cache: dict[tuple, Callable] = {}

    def compile(self, spec: PieceSpec) -> Callable[..., Sequence]:
        if self.compiler == "eager":
            return spec.graph
        key = _cache_key(spec)
        if key not in self._cache:
            example_inputs = [example_value(n) for n in spec.inputs]
            self._cache[key] = inductor_compile(spec.graph, example_inputs)
            self.compilations += 1
        return self._cache[key]
