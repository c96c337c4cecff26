"""Which captured size serves a call of size n: padded to a capture size, or exact."""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import Sequence
import sympy
import torch

log = logging.getLogger(__name__)


class PaddingTable:
    """Lookup from a runtime size to its capture size (None above the largest).

    A binary search over the sorted sizes: memory does not grow with the largest size.
    `use` narrows the sizes to those a budgeted capture kept (see `cgcompile.memory_plan`);
    `configured` stays the Config's sizes.
    """

    def __init__(self, capture_sizes: tuple[int, ...]):
        self.configured = tuple(sorted(capture_sizes))
        self.use(self.configured)

    def use(self, sizes) -> None:
        """Pad to these sizes from now on; none at all runs every call without graphs."""
        self.sizes = tuple(sorted(sizes))
        self.largest = self.sizes[-1] if self.sizes else 0

    def padded(self, n: int) -> int | None:
        if not 0 < n <= self.largest:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]


class StepSize:
    """The size of the current call, shared by a graph's runtime and its pieces.

    The runtime sets it once per call, before any piece runs, so every piece of a step
    agrees on it. n: the call's size along the capture dimension (0 for a static graph).
    size: the size graphs run at and are keyed by (n itself, or the capture size n is
    padded to); None runs the pieces without graphs.
    """

    __slots__ = ("n", "size")

    def __init__(self):
        self.n = 0
        self.size: int | None = 0


class SizePolicy:
    """Chooses the size one Dynamo graph's pieces run at, per call.

    padded: the smallest capture size >= n. exact: n itself, captured lazily: every
    capture size (the sizes asked for, ahead of time too), and at most `limit` distinct
    other sizes (a new one past the limit runs without graphs, logged once). Either way,
    sizes above the largest capture size run without graphs.

    Every piece of a graph uses the same size in a call: graphs that share a pool may
    only reuse each other's memory when they never replay in the same step (see
    `capture.CaptureSession`), and all graphs of one size are captured in one call.
    """

    def __init__(self, table: PaddingTable, *, exact: bool, limit: int, name: str):
        self.table = table
        self.exact = exact
        self.limit = limit
        self.name = name
        self.admitted: set[int] = set()
        self._others = 0  # admitted sizes that are not capture sizes: what `limit` bounds
        self._warned = False

    def size_for(self, n: int) -> int | None:
        if not self.exact:
            return self.table.padded(n)
        if n in self.admitted:
            return n
        if not 0 < n <= self.table.largest:
            return None
        if self.table.padded(n) == n:
            # A capture size: always. Counted against the limit, an ahead-of-time capture of
            # many sizes (largest first) would leave out the smallest, decode's own.
            self.admitted.add(n)
            return n
        if self._others < self.limit:
            self._others += 1
            self.admitted.add(n)
            return n
        if not self._warned:
            self._warned = True
            log.warning(
                "cgcompile: %s runs at exact sizes and already holds graphs for %d sizes besides its "
                "capture sizes (Config.exact_size_limit); size %d and later new sizes of that kind run "
                "without CUDA graphs",
                self.name, self.limit, n,
            )
        return None


# --------------------------------------------------------------------------------------
# Layout-exact piece boundaries: a compiled piece gets the strides it was traced with.
#
# Inductor compiles a piece for the sizes and strides of its example inputs and checks
# them on every call (`assert_size_stride`). An input made by an eager piece has whatever
# layout the kernel that ran returns, and that need not be the layout its fake (meta)
# implementation promised at trace time: SDPA's CUDA kernels return heads-outer results
# where the meta function says rows-outer, for one. A compiled piece's output can differ
# too: Inductor drops the empty operand of `cat([tensor([]), k])` and returns k's layout
# where eager's cat is contiguous. So the runners of compiled pieces
# hand every input that comes from an eager piece over in the traced layout: a graph's
# input buffers are allocated with the traced strides (replay copies into them anyway),
# a graph output is only read in place where its layout is the traced one (an eager op
# can return its input unchanged, whose layout its fake result need not have), and a
# call without graphs copies an input whose strides differ (counted in `copies`).


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


# --------------------------------------------------------------------------------------
# Static input buffers of breakable graphs, shared between the runners of one model.
#
# A captured segment reads each tensor input at the address it had at capture, so every
# tensor input that captured ops read gets a static buffer that a call refreshes before
# replay. Runners built together (one per decoder layer) share two things, to avoid copies
# that would cost a launch each:
#
#   - an input that is another runner's graph output, returned as its static buffer (the
#     previous layer's hidden states), is adopted as the static buffer itself: a replay
#     sees the same address and copies nothing;
#   - an input passed to several runners in one step (rotary cos and sin, given to every
#     layer) gets one buffer: the first runner copies into it, the next ones see that the
#     same tensor, unchanged since (`Tensor._version`), is already there.
#
# Who owns what: a graph holds its `StaticInput`s (strongly); the registry here holds them
# weakly, so a buffer lives exactly as long as a graph that reads it.


class StaticInput:
    """A buffer a captured graph reads, and the tensor last copied into it.

    `refresh(x, n, size)` makes the buffer hold x (the first n rows of a padded buffer,
    the rest zero): a copy, unless x is the buffer or the same unchanged tensor as last
    time.
    """

    __slots__ = ("buffer", "_source", "_version", "__weakref__")

    def __init__(self, buffer: torch.Tensor, source: torch.Tensor | None = None):
        self.buffer = buffer
        self._source = None
        self._version = None
        if source is not None:
            self._remember(source)

    @classmethod
    def copy_of(cls, x: torch.Tensor, n: int, size: int) -> "StaticInput":
        # Normal tensors even under inference_mode: a later replay outside it copies into them.
        with torch.inference_mode(False):
            if x.dim() > 0 and x.shape[0] == n and n != size:
                buffer = torch.zeros((size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
                buffer[:n].copy_(x)
            else:
                buffer = x.clone()
        return cls(buffer, x)

    def refresh(self, x: torch.Tensor, n: int, size: int) -> None:
        if self._source is not None and self._source() is x and self._version is not None \
                and x._version == self._version:
            return
        buffer = self.buffer
        if x.data_ptr() != buffer.data_ptr():
            if buffer.shape[0] == size and x.shape[0] == n and n != size:
                buffer[n:].zero_()
                buffer[:n].copy_(x)
            else:
                buffer.copy_(x)
        self._remember(x)

    def holds(self, x: torch.Tensor) -> bool:
        """Whether the buffer holds x now: x is the buffer, or the tensor copied in last
        and unchanged since."""
        if x is self.buffer:
            return True
        return self._source is not None and self._source() is x and self._version is not None \
            and x._version == self._version

    def _remember(self, x: torch.Tensor) -> None:
        self._source = weakref.ref(x)
        # Inference tensors keep no version counter: never trust them to be unchanged.
        self._version = None if x.is_inference() else x._version


class SharedStatics:
    """The static buffers and graph outputs of the runners built together (weakly held)."""

    def __init__(self):
        self._inputs: weakref.WeakSet[StaticInput] = weakref.WeakSet()

    def static_for(self, x: torch.Tensor, n: int, size: int) -> StaticInput:
        """The buffer a new graph should read x from: one that holds x already (another
        runner's graph output, or the buffer another runner copied x into in this step),
        else a fresh copy, registered for later runners."""
        for static in self._inputs:
            if static.holds(x) and static.buffer.shape == _padded_shape(x, n, size) \
                    and not static.buffer.is_inference():
                return static
        static = StaticInput.copy_of(x, n, size)
        self._inputs.add(static)
        return static

    def add_outputs(self, outputs: list[torch.Tensor]) -> list[StaticInput]:
        """Register a graph's static outputs so that a runner they are passed to adopts
        them as its input buffers. Returns the holders; the graph keeps them alive."""
        holders = [StaticInput(t, t) for t in outputs]
        for holder in holders:
            self._inputs.add(holder)
        return holders


def _padded_shape(x: torch.Tensor, n: int, size: int) -> torch.Size:
    if x.dim() > 0 and x.shape[0] == n and n != size:
        return torch.Size((size,) + tuple(x.shape[1:]))
    return x.shape
