"""Specialised compiles for hot sizes (`Config.compile_sizes`).

A capturable piece is compiled once for the symbolic capture dimension, so Inductor
cannot specialise for the sizes that matter most (a matmul with one row, say, is a
bandwidth-bound matrix-vector product that wants other tiles). For each size in
`compile_sizes` the piece is also compiled with that dimension fixed; a call whose
capture dimension has that size runs the specialised code, any other size the general
compile.

The specialised compile happens at the first call of its size, with that call's own
(real) inputs as example inputs, so every shape in it is a plain int. A CUDA graph of
that size never captures a cold piece (the warm-up before capture is that first call),
so the graph replays the specialised code.

Why this is sound: a piece is only specialised when the capture symbol is the only
symbol in its inputs' shapes, so fixing the inputs' shapes fixes exactly that symbol and
nothing else (a piece that also depends on a cache length, say, keeps the general
compile; `why_not_specialised` says so). The size is read from one input that is the
capture symbol itself, so a call of size n is routed by n, never guessed: a dimension, or
the SymInt the split hands a piece whose tensors are sized by expressions of it (2*s).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import sympy
import torch

from .compat import free_symbols
from .passes import PieceSpec, example_value

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
