"""What a full graph runs: the pieces' code in order, or the whole Dynamo graph compiled as one.

By default the full graph of a size captures the pieces' own compiled code, one piece
after another: nothing is compiled beyond the pieces, but every value that crosses a
piece boundary is written out by the piece that makes it and read back by the next, and
nothing fuses across a boundary (the residual add and norm after attention, a cache
write and the projection before it). With `Config.full_graph_compile`, the first capture
of each size compiles the whole Dynamo graph once more with Inductor, at that call's
shapes, and the full graph captures that instead.

Why a compile at one call's shapes is right for every call that replays it: every shape
in the graph is an expression of its symbols, and the full path replays a graph only
for calls whose capture size and other symbols' values equal the captured ones (the
plan's key). So a compile is kept per (size, symbol values), and a capture under a new
key compiles anew; after `limit` compiles a graph's further keys capture the pieces'
code, as does any size whose compile fails (logged, with the error).

`Config.small_query_attention` makes decode attention fast inside a full graph either way:
inside the whole-graph compile, attention calls of a few query rows are lowered to
batched matmuls (`passes.small_query`); without it, each eager piece that holds such a call is
compiled by Inductor, lowered, at the shapes of the call that captures it
(`EagerPieceCompiles`): in the full graph the eager pieces are captured like the rest, so
nothing about them has to stay eager, and identical layers share one compile.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from typing import Any, Callable, Sequence

import torch

from .attention_backend import call_without_cudnn_attention
from .compat import inductor_compile
from .passes import lower_small_query_attention

log = logging.getLogger(__name__)


class CompileCache:
    """Inductor compiles at concrete shapes, kept by key: timed, at most `limit` of them,
    a failure logged once and remembered. `get` returns None where there is no compile
    (over the limit, or failed): the caller then runs its uncompiled code, still right.

    compilations / compile_s: the compiles made and the wall seconds they took.
    """

    def __init__(self, options: dict[str, Any], cudnn_attention: bool, limit: int):
        self.options = dict(options)
        self.cudnn_attention = cudnn_attention
        self.limit = limit
        self.compilations = 0
        self.compile_s = 0.0
        self._compiled: dict[tuple, Callable] = {}
        self._failed: set[tuple] = set()

    def get(self, key: tuple, gm: torch.fx.GraphModule, args: Sequence, what: str) -> Callable | None:
        fn = self._compiled.get(key)
        if fn is not None or key in self._failed:
            return fn
        if len(self._compiled) >= self.limit:
            self._failed.add(key)
            log.info("cgcompile: %s already has %d compiles; this one runs uncompiled", what, self.limit)
            return None
        t0 = time.perf_counter()
        # SDPA picks its kernel while Inductor traces: the cuDNN switch must hold then too.
        compile_now = lambda: inductor_compile(gm, list(args), self.options)  # noqa: E731
        try:
            compiled = compile_now() if self.cudnn_attention else call_without_cudnn_attention(compile_now)
        except Exception as error:  # Inductor raises many types; the uncompiled code stays right
            self._failed.add(key)
            log.warning("cgcompile: compiling %s failed (%s: %s); it runs uncompiled", what,
                        type(error).__name__, error)
            return None
        elapsed = time.perf_counter() - t0
        self.compilations += 1
        self.compile_s += elapsed
        log.info("cgcompile: compiled %s in %.1f s", what, elapsed)
        if not self.cudnn_attention:
            compiled = functools.partial(call_without_cudnn_attention, compiled)
        self._compiled[key] = compiled
        return compiled


class FullGraphCode:
    """`for_call(size, host_values, args)`: the function a full graph of that size and those
    symbol values captures.

    pieces: the pieces' code in order (`full_graph.plain_function`), used where there is
        no whole-graph compile.
    gm: the Dynamo graph to compile as one, or None: always the pieces' code.
    compiles: the whole-graph compiles, by (size, symbol values).
    """

    def __init__(self, name: str, pieces: Callable, gm: torch.fx.GraphModule | None = None,
                 options: dict[str, Any] | None = None, cudnn_attention: bool = False,
                 small_query_attention: bool = False, limit: int = 4):
        # Inductor's pre-grad passes rewrite the graph they are handed (and so may we);
        # the dump and the split keep the original.
        self.gm = None if gm is None else torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if self.gm is not None and small_query_attention:
            lowered = lower_small_query_attention(self.gm)
            log.info("cgcompile: %s: %d attention calls of few query rows lowered to batched matmuls", name, lowered)
        self.name = name
        self.pieces = pieces
        self.compiles = CompileCache(options or {}, cudnn_attention, limit)

    def for_call(self, size: int, host_values: Sequence, args: Sequence) -> Callable:
        if self.gm is None:
            return self.pieces
        fn = self.compiles.get((size, tuple(host_values)), self.gm, args, f"{self.name} as one graph")
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

    def __init__(self, options: dict[str, Any], cudnn_attention: bool, limit: int = 16):
        self.compiles = CompileCache(options, cudnn_attention, limit)

    def for_piece(self, gm: torch.fx.GraphModule) -> Callable | None:
        lowered = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        if not lower_small_query_attention(lowered):
            return None
        return lambda *args: self._run(lowered, args)

    def _run(self, gm: torch.fx.GraphModule, args: tuple):
        key = (gm.code, tuple(_describe(a) for a in args), _aliasing(args))
        fn = self.compiles.get(key, gm, args, "an attention piece for a full graph") or gm
        return fn(*args)


def _describe(value) -> tuple:
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
