"""Layout-exact piece boundaries: a compiled piece gets the strides it was traced with.

Inductor compiles a piece for the sizes and strides of its example inputs and checks
them on every call (`assert_size_stride`). An input made by an eager piece has whatever
layout the kernel that ran returns, and that need not be the layout its fake (meta)
implementation promised at trace time: SDPA's CUDA kernels return heads-outer results
where the meta function says rows-outer, for one. A compiled piece's output can differ
too: Inductor drops the empty operand of `cat([tensor([]), k])` and returns k's layout
where eager's cat is contiguous. So the runners of compiled pieces
hand every input that comes from an eager piece over in the traced layout: a graph's
input buffers are allocated with the traced strides (replay copies into them anyway),
a graph output is only read in place where its layout is the traced one (an eager op
can return its input unchanged, whose layout its fake result need not have), and a
call without graphs copies an input whose strides differ (counted in `copies`).
"""

from __future__ import annotations

from typing import Sequence

import sympy
import torch


class TracedLayout:
    """The traced strides of a piece's inputs, evaluated for a concrete capture size.

    values: the piece's example inputs (fake tensors with symbolic strides).
    symbol: the capture dimension's symbol, or None for a static graph.
    checked: the inputs to check and copy on calls without graphs (those other pieces
        make); the graph's own inputs have the traced layout (Dynamo guards on it).
    """

    def __init__(self, values: Sequence, symbol: sympy.Symbol | None, checked: tuple[int, ...]):
        self._strides = [_stride_exprs(v) for v in values]
        self.symbol = symbol
        self.checked = tuple(i for i in checked if self._strides[i] is not None)
        self.copies = 0
        self._cache: dict[tuple[int, int], tuple[int, ...] | None] = {}

    def strides(self, index: int, size: int) -> tuple[int, ...] | None:
        """Input `index`'s traced strides at capture size `size`; None where unknown."""
        key = (index, size)
        if key not in self._cache:
            self._cache[key] = _evaluate(self._strides[index], self.symbol, size)
        return self._cache[key]

    def has_layout(self, index: int, arg: torch.Tensor, size: int) -> bool:
        """Whether `arg` already has input `index`'s traced layout (or that is unknown)."""
        expected = self.strides(index, size)
        return expected is None or _same_layout(arg, expected)

    def conform(self, args: Sequence, size: int) -> Sequence:
        """`args`, with every checked input whose layout differs copied into the traced one."""
        changed = None
        for i in self.checked:
            arg, expected = args[i], self.strides(i, size)
            if expected is None or _same_layout(arg, expected):
                continue
            if changed is None:
                changed = list(args)
            changed[i] = torch.empty_strided(arg.shape, expected, dtype=arg.dtype, device=arg.device).copy_(arg)
            self.copies += 1
        return args if changed is None else changed

    def zeros(self, index: int, like: torch.Tensor, shape: Sequence[int], size: int) -> torch.Tensor:
        """Zeros of `shape` in input `index`'s traced layout at `size` (else `like`'s order).

        Traced strides that depend on another size (a strided view of a graph input marked
        dynamic: `x[:, ::2]` traces as strides (16*s1, s1)) are `like`'s own: Dynamo's
        guards tie a graph input's strides to the traced ones, and a compiled piece that is
        handed s1 checks them."""
        expected = self.strides(index, size)
        if expected is None and len(shape) == like.dim() and not overlaps(shape, like.stride()):
            expected = like.stride()
        if expected is not None and len(expected) == len(shape):
            return torch.empty_strided(shape, expected, dtype=like.dtype, device=like.device).zero_()
        order = sorted(range(like.dim()), key=lambda d: -like.stride(d))
        buf = like.new_zeros([shape[d] for d in order])
        return buf.permute([order.index(d) for d in range(like.dim())])


def overlaps(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two elements of a tensor of this shape and strides share memory (dims
    sorted by stride must nest; a conservative test: some exotic layouts count too)."""
    reach = 0  # elements the smaller-strided dims already span, minus one
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _stride_exprs(value) -> tuple | None:
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(s.node.expr if isinstance(s, torch.SymInt) else s for s in value.stride())


def _evaluate(exprs: tuple | None, symbol, size: int) -> tuple[int, ...] | None:
    if exprs is None:
        return None
    result = []
    for e in exprs:
        if isinstance(e, int):
            result.append(e)
            continue
        value = e.subs(symbol, size) if symbol is not None else e
        if not value.is_number:
            return None  # depends on another symbol: such pieces are never compiled
        result.append(int(value))
    return tuple(result)


def _same_layout(arg: torch.Tensor, expected: tuple[int, ...]) -> bool:
    # Strides of size-1 dims never matter (Inductor's check skips them too).
    return all(size <= 1 or s == e for size, s, e in zip(arg.shape, arg.stride(), expected))
