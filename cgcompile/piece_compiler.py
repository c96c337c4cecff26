"""Compile capturable pieces once per distinct (code, input metadata), and share the result.

The layers of a transformer split into pieces with the same code and the same input
shapes and dtypes; only the parameters they are handed differ. Such pieces get one
compiled function, so compile time does not grow with depth.
"""

from __future__ import annotations

from typing import Callable, Sequence

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


def _cache_key(spec: PieceSpec) -> tuple:
    def meta(value):
        if isinstance(value, torch.Tensor):
            return (describe_input(value), tuple(map(str, value.stride())), str(value.device))
        return describe_input(value)

    attrs = tuple(id(getattr(spec.graph, n.target)) for n in spec.graph.graph.nodes if n.op == "get_attr")
    return (spec.graph.code, tuple(meta(example_value(n)) for n in spec.inputs), attrs)


class PieceCompiler:
    """Turns a capturable piece into a callable; `compilations` counts real compiles."""

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
