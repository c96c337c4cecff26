"""Compile capturable pieces once per distinct (code, input metadata), under the size
assumptions of their graph, and share the result.

The layers of a transformer split into pieces with the same code and the same input
shapes and dtypes; only the parameters they are handed differ. Such pieces get one
compiled function, so compile time does not grow with depth. With `compile_sizes`, each
such function also gets one specialised compile per listed size (see `size_specialise`),
shared the same way.

Three things make sharing sound across the Dynamo graphs of one Backend, each with its
own ShapeEnv:

- A compile is shared only with a graph whose ShapeEnv assumes at least as much about the
  symbols in the piece's input sizes (value ranges; guards such as `s0 >= 8` or
  `Eq(Mod(s0, 2), 0)`): a name like `s0` alone says nothing about them, and Inductor's
  code may depend on them.
- A compile may add guards (specialise a size). It is recorded as made under what the
  ShapeEnv assumes after it, so a graph that lacks those guards compiles itself and gets
  them.
- Inductor's own caches re-add a cached compile's guards only through the graph's SymInt
  inputs, and a piece takes a symbol that a tensor dimension carries as no SymInt:
  `compile_keeping_guards` adds those inputs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import sympy
import torch

from .compat import (free_unbacked_symbols, inductor_compile, shape_env_of, size_facts,
                     value_range_within)
from .passes import PieceSpec, example_value, free_symbols

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


def _size_symbols(values: Sequence) -> set[sympy.Symbol]:
    return set().union(*(free_symbols(v) for v in values if isinstance(v, (torch.Tensor, torch.SymInt))))


@dataclasses.dataclass(frozen=True)
class SizeAssumptions:
    """What a ShapeEnv assumes about the size symbols of a piece's inputs: each one's value
    range, and the guards and runtime asserts over these symbols only. Symbol names are
    kept: the code and input descriptions in the cache key name them too, and identical
    layers of one graph share them."""

    ranges: tuple[tuple[str, Any], ...]  # (symbol, ValueRanges), sorted by symbol
    facts: frozenset[str]

    def imply(self, other: SizeAssumptions) -> bool:
        """True when every size these allow, `other` allows too: code compiled under
        `other` is valid here."""
        if [name for name, _ in self.ranges] != [name for name, _ in other.ranges]:
            return False
        return self.facts >= other.facts and all(
            value_range_within(mine, theirs) for (_, mine), (_, theirs) in zip(self.ranges, other.ranges))


def _size_assumptions(values: Sequence) -> SizeAssumptions:
    symbols = _size_symbols(values)
    if not symbols:
        return SizeAssumptions((), frozenset())
    ranges, facts = size_facts(shape_env_of(values), symbols)
    return SizeAssumptions(tuple(sorted((str(s), r) for s, r in ranges.items())), frozenset(map(str, facts)))


def _cache_key(spec: PieceSpec) -> tuple:
    def meta(value):
        if isinstance(value, torch.Tensor):
            return (describe_input(value), tuple(map(str, value.stride())), str(value.device))
        return describe_input(value)

    attrs = tuple(id(getattr(spec.graph, n.target)) for n in spec.graph.graph.nodes if n.op == "get_attr")
    return (spec.graph.code, tuple(meta(example_value(n)) for n in spec.inputs), attrs)


def _unpassed_size_probes(values: Sequence) -> list[SizeProbe]:
    """Where to read each backed symbol of the inputs' sizes that no input passes as a
    SymInt: a tensor dimension that is the symbol itself. The split gives every piece
    each symbol its inputs hold as one or the other (`passes/split.py`)."""
    passed = {v.node.expr for v in values if isinstance(v, torch.SymInt)}
    probes: dict[sympy.Symbol, SizeProbe] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    probes.setdefault(size.node.expr, SizeProbe(i, d))
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    missing = sorted(_size_symbols(tensors) - free_unbacked_symbols(tensors) - passed, key=str)
    assert all(s in probes for s in missing), f"size symbols {missing} not all carried by the piece's inputs"
    return [probes[s] for s in missing]


def _with_size_inputs(gm: torch.fx.GraphModule, sizes: Sequence[torch.SymInt]) -> torch.fx.GraphModule:
    """`gm` with one leading placeholder per size in `sizes`, used by nothing."""
    graph = torch.fx.Graph()
    for size in sizes:
        graph.placeholder(str(size.node.expr)).meta["example_value"] = size
    graph.output(graph.graph_copy(gm.graph, {}))
    wrapped = torch.fx.GraphModule(gm, graph)
    wrapped.meta.update(gm.meta)
    return wrapped


class _SizesFirst:
    """Calls code compiled by `compile_keeping_guards` with its leading size inputs, read
    from the call's tensors."""

    __slots__ = ("compiled", "reads")

    def __init__(self, compiled: Callable, probes: Sequence[SizeProbe]):
        self.compiled = compiled
        self.reads = tuple((p.index, p.dim) for p in probes)

    def __call__(self, *args):
        return self.compiled(*[args[i].shape[d] for i, d in self.reads], *args)


def compile_keeping_guards(gm: torch.fx.GraphModule, values: list, options: dict[str, Any]) -> Callable:
    """Inductor's compile of a piece for the fake `values`, such that one served from
    Inductor's caches adds the guards to the ShapeEnv that a fresh compile adds.

    Why this works: on a cache hit, FxGraphCache and AOTAutogradCache re-evaluate the
    stored guards on the graph's backed SymInt inputs, and store only the guards over
    those symbols. A piece takes as a SymInt only the symbols no tensor dimension of its
    inputs carries, so the others are added here as leading inputs.
    """
    probes = _unpassed_size_probes(values)
    if not probes:
        return inductor_compile(gm, values, options)
    sizes = [values[p.index].shape[p.dim] for p in probes]
    return _SizesFirst(inductor_compile(_with_size_inputs(gm, sizes), [*sizes, *values], options), probes)


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
        self._cache: dict[tuple, list[tuple[SizeAssumptions, Callable]]] = {}
        self._specialised: dict[tuple, Callable] = {}  # (piece key, size) -> compiled code

    def compile(self, spec: PieceSpec, capture_symbol: sympy.Symbol | None = None) -> Callable[..., Sequence]:
        general = self._general(spec)
        if not self.compile_sizes:
            return general
        probe = find_size_probe(spec, capture_symbol)
        if isinstance(probe, str):
            log.info("cgcompile: %s keeps its general compile at every size: %s", spec.name, probe)
            return general
        key = _cache_key(spec)  # a compile at one size holds for any size assumptions
        return SizeSpecialised(general, probe, self.compile_sizes,
                               lambda size, args: self._at_size(key, spec.graph, size, args))

    def _general(self, spec: PieceSpec) -> Callable:
        if self.compiler == "eager":
            return spec.graph
        values = [example_value(n) for n in spec.inputs]
        assumed = _size_assumptions(values)
        entries = self._cache.get(_cache_key(spec), [])
        fn = next((fn for made_under, fn in entries if assumed.imply(made_under)), None)
        if fn is None:
            fn = compile_keeping_guards(spec.graph, values, self.inductor_options)
            self.compilations += 1
            # Recorded as the ShapeEnv is after the compile: with the guards it added (a
            # specialised size shows in the input descriptions), which a graph must have
            # to run this code.
            self._cache.setdefault(_cache_key(spec), []).append((_size_assumptions(values), fn))
        return fn

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


# --------------------------------------------------------------------------------------
# Specialised compiles for hot sizes (`Config.compile_sizes`).
#
# A capturable piece is compiled once for the symbolic capture dimension, so Inductor
# cannot specialise for the sizes that matter most (a matmul with one row, say, is a
# bandwidth-bound matrix-vector product that wants other tiles). For each size in
# `compile_sizes` the piece is also compiled with that dimension fixed; a call whose
# capture dimension has that size runs the specialised code, any other size the general
# compile.
#
# The specialised compile happens at the first call of its size, with that call's own
# (real) inputs as example inputs, so every shape in it is a plain int. A CUDA graph of
# that size never captures a cold piece (the warm-up before capture is that first call),
# so the graph replays the specialised code.
#
# Why this is sound: a piece is only specialised when the capture symbol is the only
# symbol in its inputs' shapes, so fixing the inputs' shapes fixes exactly that symbol and
# nothing else (a piece that also depends on a cache length, say, keeps the general
# compile; `why_not_specialised` says so). The size is read from one input that is the
# capture symbol itself, so a call of size n is routed by n, never guessed: a dimension, or
# the SymInt the split hands a piece whose tensors are sized by expressions of it (2*s).


log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SizeProbe:
    """Where a call's capture size can be read: input `index`, dimension `dim` (None: the
    input is the size itself, a SymInt)."""

    index: int
    dim: int | None

    def read(self, args: Sequence) -> int:
        value = args[self.index]
        return int(value) if self.dim is None else value.shape[self.dim]


def find_size_probe(spec: PieceSpec, symbol: sympy.Symbol | None) -> SizeProbe | str:
    """The probe of a piece that can be specialised, or a sentence saying why not."""
    if symbol is None:
        return "the graph has no capture dimension (its compile is static already)"
    values = [example_value(n) for n in spec.inputs]
    others = set().union(*(free_symbols(v) for v in values if isinstance(v, (torch.Tensor, torch.SymInt))))
    others.discard(symbol)
    if others:
        names = ", ".join(sorted(map(str, others)))
        return f"its inputs depend on {names} besides the capture dimension {symbol}"
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                    return SizeProbe(i, d)
        elif isinstance(value, torch.SymInt) and value.node.expr == symbol:
            return SizeProbe(i, None)
    return f"no input has the capture dimension {symbol} as a plain dimension"


class SizeSpecialised:
    """Calls the specialised code of the call's size where `compile_sizes` has it, the
    general compile otherwise. `compile_at(size, args)` compiles for one size; it runs at
    the first call of that size, and its result is kept."""

    def __init__(self, general: Callable, probe: SizeProbe, sizes: frozenset[int],
                 compile_at: Callable[[int, Sequence], Callable]):
        self.general = general
        self.probe = probe
        self.sizes = sizes
        self.specialised: dict[int, Callable] = {}
        self._compile_at = compile_at

    def __call__(self, *args):
        size = self.probe.read(args)
        if size not in self.sizes:
            return self.general(*args)
        fn = self.specialised.get(size)
        if fn is None:
            fn = self.specialised[size] = self._compile_at(size, args)
        return fn(*args)


def trace_at_size(gm: torch.fx.GraphModule, args: Sequence) -> torch.fx.GraphModule:
    """The piece's FX code retraced with the inputs' concrete shapes (compiler="eager"):
    every size in it becomes a constant, as in an Inductor compile at that size."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # Fake tensors without a shape environment: static shapes, and nothing runs (a piece
    # that writes into its inputs must not write twice).
    return make_fx(gm, tracing_mode="fake")(*args)
