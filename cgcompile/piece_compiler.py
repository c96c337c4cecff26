"""Compile capturable pieces once per distinct (code, input metadata), and share the result.

The layers of a transformer split into pieces with the same code and the same input
shapes and dtypes; only the parameters they are handed differ. Such pieces get one
compiled function, so compile time does not grow with depth. With `compile_sizes`, each
such function also gets one specialised compile per listed size (see `size_specialise`),
shared the same way.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import sympy
import torch

from .compat import inductor_compile
from .passes import PieceSpec, example_value
from .size_specialise import SizeSpecialised, find_size_probe, trace_at_size

log = logging.getLogger(__name__)


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
    """Turns a capturable piece into a callable.

    compilations: general compiles (Inductor only; one per distinct piece).
    specialised_compilations / specialise_s: compiles at one of `compile_sizes` (with
    compiler="eager" too: a retrace at that size), and the wall seconds they took, the
    warm-up that `compile_sizes` adds.
    """

    def __init__(self, compiler: str, compile_sizes: tuple[int, ...] = (),
                 inductor_options: dict[str, Any] | None = None, size_options: dict[str, Any] | None = None):
        self.compiler = compiler
        self.compile_sizes = frozenset(compile_sizes)
        self.inductor_options = dict(inductor_options or {})
        self.size_options = {**self.inductor_options, **(size_options or {})}
        self.compilations = 0
        self.specialised_compilations = 0
        self.specialise_s = 0.0
        self._cache: dict[tuple, Callable] = {}
        self._specialised: dict[tuple, Callable] = {}  # (piece key, size) -> compiled code

    def compile(self, spec: PieceSpec, capture_symbol: sympy.Symbol | None = None) -> Callable[..., Sequence]:
        general = self._general(spec)
        if not self.compile_sizes:
            return general
        probe = find_size_probe(spec, capture_symbol)
        if isinstance(probe, str):
            log.info("cgcompile: %s keeps its general compile at every size: %s", spec.name, probe)
            return general
        key = _cache_key(spec)
        return SizeSpecialised(general, probe, self.compile_sizes,
                               lambda size, args: self._at_size(key, spec.graph, size, args))

    def _general(self, spec: PieceSpec) -> Callable:
        if self.compiler == "eager":
            return spec.graph
        key = _cache_key(spec)
        if key not in self._cache:
            example_inputs = [example_value(n) for n in spec.inputs]
            self._cache[key] = inductor_compile(spec.graph, example_inputs, self.inductor_options)
            self.compilations += 1
        return self._cache[key]

    def _at_size(self, key: tuple, gm: torch.fx.GraphModule, size: int, args: Sequence) -> Callable:
        """The piece's code compiled for the shapes of `args` (capture dimension = size)."""
        if (key, size) not in self._specialised:
            t0 = time.perf_counter()
            if self.compiler == "eager":
                fn = trace_at_size(gm, args)
            else:
                fn = inductor_compile(gm, list(args), self.size_options)
            self._specialised[key, size] = fn
            self.specialised_compilations += 1
            self.specialise_s += time.perf_counter() - t0
        return self._specialised[key, size]
