"""Every compile the backend makes, and the one cache that shares them.

Four kinds of compile, each kept in a `CompileCache` by a `CompileKey` (what makes two
compiles interchangeable):

  piece          a capturable piece, for the symbolic shapes of its graph (`PieceCompiler`).
                 The layers of a transformer split into pieces with the same code and the
                 same input shapes and dtypes; only the parameters they are handed differ.
                 They get one compile, so compile time does not grow with depth.
  piece at size  a piece again with its capture dimension fixed to one of
                 `Config.compile_sizes`, at the first call of that size (`SizeSpecialised`).
  whole graph    a whole Dynamo graph at one call's shapes, for the full graph of one size
                 and host values (`FullGraphCode`, `Config.full_graph_compile`).
  eager piece    an eager piece with attention of a few query rows lowered to matmuls, at
                 one call's shapes, for full graphs (`EagerPieceCompiles`).

Piece compiles are shared across the Dynamo graphs of one Backend, each with its own
ShapeEnv. Three things make that sound:

- A compile is shared only with a graph whose ShapeEnv assumes at least as much about the
  symbols in the piece's input sizes (value ranges; guards such as `s0 >= 8` or
  `Eq(Mod(s0, 2), 0)`): a name like `s0` alone says nothing about them, and Inductor's
  code may depend on them (`SizeAssumptions`).
- A compile may add guards (specialise a size). It is recorded as made under what the
  ShapeEnv assumes after it, so a graph that lacks those guards compiles itself and gets
  them.
- Inductor's own caches re-add a cached compile's guards only through the graph's SymInt
  inputs, and a piece takes a symbol that a tensor dimension carries as no SymInt:
  `compile_keeping_guards` adds those inputs.

The other three kinds compile at concrete shapes, so they assume nothing about sizes: their
key says everything (the fixed size, the host values, the inputs' layouts).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Sequence

import sympy
import torch

from ..compat import (free_unbacked_symbols, inductor_compile, shape_env_of, size_facts,
                     value_range_within)
from ..ops import call_without_cudnn_attention
from ..passes import PieceSpec, example_value, free_symbols, lower_small_query_attention, matvec_as_reduction
from .post_grad import compiling_with, post_grad_pass

log = logging.getLogger(__name__)


# -- the cache -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """What makes two compiles interchangeable, beside the size assumptions (which one
    compile may serve several of: see `CompileCache.get`).

    kind: how the code is compiled: "piece", "piece at size", "whole graph", "eager piece".
    code: the FX code compiled.
    inputs: what the compile depends on of its inputs: their layouts (symbolic for a
        piece, concrete at one call's shapes), or the host values a whole graph holds.
    constants: ids of the tensors the code reads as attributes (get_attr).
    aliasing: which inputs share storage (compiles at one call's shapes).
    size: the capture size fixed by the compile ("piece at size", "whole graph").
    options: the Inductor options, as sorted items.
    """

    kind: str
    code: str
    inputs: tuple
    constants: tuple = ()
    aliasing: tuple = ()
    size: int | None = None
    options: str = ""


def options_key(options: dict[str, Any]) -> str:
    return repr(sorted(options.items()))


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


NOTHING_ASSUMED = SizeAssumptions((), frozenset())  # a compile at concrete shapes


class CompileCache:
    """Compiled code by `CompileKey` and the size assumptions each compile was made under.

    limit: at most this many compiles (None: no bound); a new key beyond it gets none.
    fall_back: a compile that raises is logged once and its key remembered, and `get`
        returns None (the caller then runs its uncompiled code, still right); without it
        the error propagates.
    made / seconds: the compiles made, and the wall seconds they took, by key kind.
    """

    def __init__(self, *, limit: int | None = None, fall_back: bool = False):
        self.limit = limit
        self.fall_back = fall_back
        self.made: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self._entries: dict[CompileKey, list[tuple[SizeAssumptions, Callable]]] = {}
        self._failed: set[CompileKey] = set()

    @property
    def compilations(self) -> int:
        return sum(self.made.values())

    @property
    def compile_s(self) -> float:
        return sum(self.seconds.values())

    def get(self, key: CompileKey, make: Callable[[], Callable], *, what: str,
            assumed: Callable[[], SizeAssumptions] = lambda: NOTHING_ASSUMED) -> Callable | None:
        """The compile of `key` made under assumptions that `assumed()` implies, else a new
        one by `make()`, recorded under `assumed()` as it is after the compile (with
        the guards the compile added, which a graph must have to run this code)."""
        now = assumed()
        fn = next((fn for made_under, fn in self._entries.get(key, ()) if now.imply(made_under)), None)
        if fn is not None or key in self._failed:
            return fn
        if self.limit is not None and self.compilations >= self.limit:
            self._failed.add(key)
            log.info("cgcompile: %s already has %d compiles; this one runs uncompiled", what, self.limit)
            return None
        t0 = time.perf_counter()
        try:
            fn = make()
        except Exception as error:  # Inductor raises many types
            if not self.fall_back:
                raise
            self._failed.add(key)
            log.warning("cgcompile: compiling %s failed (%s: %s); it runs uncompiled", what,
                        type(error).__name__, error)
            return None
        elapsed = time.perf_counter() - t0
        self.made[key.kind] += 1
        self.seconds[key.kind] += elapsed
        log.info("cgcompile: compiled %s in %.1f s", what, elapsed)
        self._entries.setdefault(key, []).append((assumed(), fn))
        return fn


# -- pieces --------------------------------------------------------------------------------


class PieceCompiler:
    """Turns a capturable piece into a callable; compiles go through one `CompileCache`.

    compilations: general compiles (Inductor only; one per distinct piece and assumptions).
    specialised_compilations / specialise_s: compiles at one of `compile_sizes` (with
    compiler="eager" too: a retrace at that size), and the wall seconds they took, the
    warm-up that `compile_sizes` adds.
    all_reduce: `Config.all_reduce`; "auto" compiles every piece with the post-grad pass
        that routes the aten graph's all-reduces (`parallel.inductor_all_reduce`) in
        Inductor's config, and keys the compiles by it; with `fuse_all_reduce_norm` the pass
        also fuses all-reduces with the residual add and RMS norm after them.
    skinny_linears: `Config.skinny_linears`; the same pass hands products of one row to
        the skinny linear ops (`build.post_grad`), and with both of those and
        `fuse_linear_all_reduce` folds each such product that only a fused all-reduce reads
        into it.
    """

    def __init__(self, compiler: str, compile_sizes: tuple[int, ...] = (),
                 inductor_options: dict[str, Any] | None = None, size_options: dict[str, Any] | None = None,
                 all_reduce: str = "nccl", matvec_as_reduction: bool = False, fuse_all_reduce_norm: bool = True,
                 skinny_linears: bool = False, fuse_linear_all_reduce: bool = False):
        self.compiler = compiler
        self.matvec_as_reduction = matvec_as_reduction
        self.matvec_reductions = 0  # one-row linears compiled as reductions (Config.matvec_as_reduction)
        self.compile_sizes = frozenset(compile_sizes)
        self.inductor_options = dict(inductor_options or {})
        self.size_options = {**self.inductor_options, **(size_options or {})}
        self.post_grad_pass = post_grad_pass(self.inductor_options, all_reduce, fuse_all_reduce_norm, skinny_linears,
                                             fuse_linear_all_reduce)
        self.cache = CompileCache()

    @property
    def compilations(self) -> int:
        return self.cache.made["piece"]

    @property
    def compile_s(self) -> float:
        return self.cache.seconds["piece"]

    @property
    def specialised_compilations(self) -> int:
        return self.cache.made["piece at size"]

    @property
    def specialise_s(self) -> float:
        return self.cache.seconds["piece at size"]

    def compile(self, spec: PieceSpec, capture_symbol: sympy.Symbol | None = None) -> Callable[..., Sequence]:
        general = self._general(spec)
        if not self.compile_sizes:
            return general
        probe = find_size_probe(spec, capture_symbol)
        if isinstance(probe, str):
            log.info("cgcompile: %s keeps its general compile at every size: %s", spec.name, probe)
            return general
        # A compile at one size holds whatever the graph assumes about sizes.
        key = piece_key(spec, "piece at size", self._keyed(self._with_rewrites(self.size_options)))
        gm, name = spec.graph, spec.name
        return SizeSpecialised(general, probe, self.compile_sizes,
                               lambda size, args: self._at_size(key, gm, name, size, args))

    def _general(self, spec: PieceSpec) -> Callable:
        if self.compiler == "eager":
            return spec.graph
        values = [example_value(n) for n in spec.inputs]
        key = piece_key(spec, "piece", self._keyed(self._with_rewrites(self.inductor_options)))
        return self.cache.get(key, lambda: self._inductor(compile_keeping_guards,
                                                          self._rewritten(spec.graph, spec.name, values), values,
                                                          self.inductor_options),
                              what=f"piece {spec.name}", assumed=lambda: _size_assumptions(values))

    def _at_size(self, key: CompileKey, gm: torch.fx.GraphModule, name: str, size: int, args: Sequence) -> Callable:
        """The piece's code compiled for the shapes of `args` (capture dimension = size)."""
        if self.compiler == "eager":
            make = lambda: trace_at_size(gm, args)  # noqa: E731
        else:
            make = lambda: self._inductor(inductor_compile, self._rewritten(gm, f"{name} at size {size}", args),  # noqa: E731
                                          list(args), self.size_options)
        return self.cache.get(dataclasses.replace(key, size=size), make, what=f"piece {name} at size {size}")

    def _rewritten(self, gm: torch.fx.GraphModule, name: str, example_inputs: Sequence) -> torch.fx.GraphModule:
        """What an Inductor compile of a piece compiles: `gm`, or with Config.matvec_as_reduction
        a copy whose linears of one row (at static shapes) are reductions."""
        if not self.matvec_as_reduction:
            return gm
        rewritten, count = matvec_as_reduction(gm, example_inputs)
        self.matvec_reductions += count
        if count:
            log.info("cgcompile: piece %s: %d one-row linears compiled as reductions", name, count)
        return rewritten

    def _with_rewrites(self, options: dict[str, Any]) -> dict[str, Any]:
        """Compile-key options, with the graph rewrites that change what is compiled."""
        return {**options, "matvec_as_reduction": True} if self.matvec_as_reduction else options

    @property
    def skinny_linear_count(self) -> int:
        """Products handed to the skinny linear ops (single or grouped) by the compiles Inductor ran."""
        return 0 if self.post_grad_pass is None else self.post_grad_pass.rewritten_linears

    @property
    def grouped_skinny_linear_count(self) -> int:
        """Of those, the products run in groups by the grouped skinny linear op."""
        return 0 if self.post_grad_pass is None else self.post_grad_pass.grouped_linears

    @property
    def gated_skinny_linear_count(self) -> int:
        """Of those, the products that make their gated input as they read it (cgcompile::silu_mul_linear)."""
        return 0 if self.post_grad_pass is None else self.post_grad_pass.gated_linears

    def _inductor(self, compile_fn: Callable, *args) -> Callable:
        """compile_fn(*args) with the post-grad pass in Inductor's config."""
        with compiling_with(self.post_grad_pass):
            return compile_fn(*args)

    def _keyed(self, options: dict[str, Any]) -> dict[str, Any]:
        """The options a compile is keyed by: with the post-grad pass (its rewrites and recorded
        all-reduce choices) where there is one."""
        return options if self.post_grad_pass is None else {**options, "post_grad_pass": self.post_grad_pass}


def describe_input(value) -> str:
    """A compact, stable description of one piece input, e.g. "f32[s0, 64]" or "Sym(s0)"."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = ", ".join(str(s) for s in value.shape)
        return f"{dtype}[{shape}]"
    if isinstance(value, torch.SymInt):
        return f"Sym({value.node.expr})"
    return repr(value)


def piece_key(spec: PieceSpec, kind: str, options: dict[str, Any]) -> CompileKey:
    """A piece compile's key: its code, its inputs' symbolic layouts and devices, and the
    constants it reads (the size of a compile at one size is added at its first call)."""
    def layout(value):
        if isinstance(value, torch.Tensor):
            return (describe_input(value), tuple(map(str, value.stride())), str(value.device))
        return describe_input(value)

    constants = tuple(id(getattr(spec.graph, n.target)) for n in spec.graph.graph.nodes if n.op == "get_attr")
    inputs = tuple(layout(example_value(n)) for n in spec.inputs)
    return CompileKey(kind, spec.graph.code, inputs, constants, options=options_key(options))


def _size_symbols(values: Sequence) -> set[sympy.Symbol]:
    return set().union(*(free_symbols(v) for v in values if isinstance(v, (torch.Tensor, torch.SymInt))))


def _size_assumptions(values: Sequence) -> SizeAssumptions:
    symbols = _size_symbols(values)
    if not symbols:
        return NOTHING_ASSUMED
    ranges, facts = size_facts(shape_env_of(values), symbols)
    return SizeAssumptions(tuple(sorted((str(s), r) for s, r in ranges.items())), frozenset(map(str, facts)))


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


@dataclasses.dataclass(frozen=True)
class SizeProbe:
    """Where a size can be read from a call's inputs: input `index`, dimension `dim` (None:
    the input is the size itself, a SymInt)."""

    index: int
    dim: int | None

    def read(self, args: Sequence) -> int:
        value = args[self.index]
        return int(value) if self.dim is None else value.shape[self.dim]


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


# -- hot sizes (`Config.compile_sizes`) ----------------------------------------------------
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
# compile; `find_size_probe` says so). The size is read from one input that is the capture
# symbol itself, so a call of size n is routed by n, never guessed: a dimension, or the
# SymInt the split hands a piece whose tensors are sized by expressions of it (2*s).


def find_size_probe(spec: PieceSpec, symbol: sympy.Symbol | None) -> SizeProbe | str:
    """Where a piece that can be specialised reads its capture size, or a sentence saying
    why it cannot be."""
    if symbol is None:
        return "the graph has no capture dimension (its compile is static already)"
    values = [example_value(n) for n in spec.inputs]
    others = _size_symbols(values) - {symbol}
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


# -- what a full graph runs: the pieces' code in order, or the whole graph compiled ---------
#
# By default the full graph of a size captures the pieces' own compiled code, one piece
# after another: nothing is compiled beyond the pieces, but every value that crosses a
# piece boundary is written out by the piece that makes it and read back by the next, and
# nothing fuses across a boundary (the residual add and norm after attention, a cache
# write and the projection before it). With `Config.full_graph_compile`, the first capture
# of each size compiles the whole Dynamo graph once more with Inductor, at that call's
# shapes, and the full graph captures that instead.
#
# Why a compile at one call's shapes is right for every call that replays it: every shape
# in the graph is an expression of its symbols, and the full path replays a graph only
# for calls whose capture size and other symbols' values equal the captured ones (the
# plan's key). So a compile is kept per (size, symbol values), and a capture under a new
# key compiles anew; after `limit` compiles a graph's further keys capture the pieces'
# code, as does any size whose compile fails (logged, with the error).
#
# `Config.small_query_attention` makes decode attention fast inside a full graph either
# way: inside the whole-graph compile, attention calls of a few query rows are lowered to
# batched matmuls (`passes.small_query`); without it, each eager piece that holds such a
# call is compiled by Inductor, lowered, at the shapes of the call that captures it
# (`EagerPieceCompiles`): in the full graph the eager pieces are captured like the rest,
# so nothing about them has to stay eager, and identical layers share one compile.


def lower_attention(gm: torch.fx.GraphModule, kernel: bool) -> int:
    """`lower_small_query_attention` on `gm`, to `cgcompile::decode_attention` where `kernel`
    (`Config.decode_attention_kernel`) and the traced operands suit it; returns how many."""
    if not kernel:
        return lower_small_query_attention(gm)
    from ..kernels.decode_attention import attention_with_kernel, grouped_attention_with_kernel

    return lower_small_query_attention(gm, attention=attention_with_kernel,
                                       grouped_attention=grouped_attention_with_kernel)


def compile_at_shapes(gm: torch.fx.GraphModule, args: Sequence, options: dict[str, Any],
                      cudnn_attention: bool) -> Callable:
    """Inductor's compile of `gm` at the real `args`' shapes; without cuDNN attention, it
    is compiled and runs with SDPA's cuDNN backend off (SDPA picks its kernel while
    Inductor traces, so the switch must hold then too)."""
    compile_now = lambda: inductor_compile(gm, list(args), options)  # noqa: E731
    if cudnn_attention:
        return compile_now()
    return functools.partial(call_without_cudnn_attention, call_without_cudnn_attention(compile_now))


class FullGraphCode:
    """`for_call(size, host_values, args)`: the function a full graph of that size and those
    symbol values captures.

    pieces: the pieces' code in order (`full_graph.plain_function`), used where there is
        no whole-graph compile.
    gm: the Dynamo graph to compile as one, or None: always the pieces' code.
    compiles: the whole-graph compiles, by (size, symbol values); at most `limit`.
    """

    def __init__(self, name: str, pieces: Callable, gm: torch.fx.GraphModule | None = None,
                 options: dict[str, Any] | None = None, cudnn_attention: bool = False,
                 small_query_attention: bool = False, attention_kernel: bool = True, limit: int = 4):
        # Inductor's pre-grad passes rewrite the graph they are handed (and so may we);
        # the dump and the split keep the original.
        self.gm = None if gm is None else torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if self.gm is not None and small_query_attention:
            lowered = lower_attention(self.gm, attention_kernel)
            log.info("cgcompile: %s: %d attention calls of few query rows lowered%s", name, lowered,
                     " (decode attention kernel where the operands suit it)" if attention_kernel else "")
        self.name = name
        self.pieces = pieces
        self.options = dict(options or {})
        self.cudnn_attention = cudnn_attention
        self.compiles = CompileCache(limit=limit, fall_back=True)

    def for_call(self, size: int, host_values: Sequence, args: Sequence) -> Callable:
        if self.gm is None:
            return self.pieces
        key = CompileKey("whole graph", self.gm.code, tuple(host_values), size=size,
                         options=options_key(self.options))
        fn = self.compiles.get(key, lambda: compile_at_shapes(self.gm, args, self.options, self.cudnn_attention),
                               what=f"{self.name} as one graph")
        return self.pieces if fn is None else fn


class EagerPieceCompiles:
    """Compiles of eager pieces for full graphs that run the pieces' code
    (`Config.small_query_attention`: without `full_graph_compile`, or where a whole-graph
    compile failed), one per distinct (piece code, input layouts and values, aliasing),
    shared by every Dynamo graph of a Backend.

    `for_piece(gm)` returns the function a full graph calls for that eager piece: the
    piece lowered and compiled at the shapes of its first call with them (the lowered FX
    code where there is no compile); or None when the piece holds no attention to lower
    (it then runs as it is).
    """

    def __init__(self, options: dict[str, Any], cudnn_attention: bool, attention_kernel: bool = True,
                 limit: int = 16):
        self.options = dict(options)
        self.cudnn_attention = cudnn_attention
        self.attention_kernel = attention_kernel  # Config.decode_attention_kernel
        self.compiles = CompileCache(limit=limit, fall_back=True)

    def for_piece(self, gm: torch.fx.GraphModule) -> Callable | None:
        lowered = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if not lower_attention(lowered, self.attention_kernel):
            return None
        return lambda *args: self._run(lowered, args)

    def _run(self, gm: torch.fx.GraphModule, args: tuple):
        key = CompileKey("eager piece", gm.code, tuple(_concrete(a) for a in args), aliasing=_aliasing(args),
                         options=options_key(self.options))
        fn = self.compiles.get(key, lambda: compile_at_shapes(gm, args, self.options, self.cudnn_attention),
                               what="an attention piece for a full graph")
        return (fn or gm)(*args)


def _concrete(value) -> tuple:
    """What a compile at concrete shapes depends on: a tensor's layout, an int's value."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, tuple(value.shape), value.stride(), value.data_ptr() % 16 == 0)
    return (type(value).__name__, value)


def _aliasing(args: tuple) -> tuple:
    """Which tensor arguments share storage (a compile treats aliased inputs it writes
    into differently): per argument, the first argument with the same storage."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(a.untyped_storage().data_ptr(), i) if isinstance(a, torch.Tensor) else None
                 for i, a in enumerate(args))
