"""Static buffers of captured graphs: which size a call runs at, in which layout, and how
its tensors get into the buffers a graph reads.

Three parts, used by every path (graph pieces, whole graphs, breakable graphs):
  - sizes: which captured size serves a call of size n, padded to a capture size or
    exact (`PaddingTable`, `SizePolicy`);
  - layout: the strides a compiled piece was traced with (`TracedLayout`);
  - static buffers: allocate, fill before each replay (rows only, padding zeroed), narrow
    the outputs back, and read in place what already lies there (`StaticBuffer`,
    `LiveBuffers`; shared between breakable runners: `StaticInput`, `SharedStatics`).
"""

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
    `use` narrows the sizes to those a budgeted capture kept (see `cgcompile.tools.memory_plan`);
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

    def padded_copy(self, index: int, arg: torch.Tensor, dims: tuple[int, ...], n: int,
                    size: int) -> torch.Tensor:
        """A fresh buffer for input `index` at capture size `size` (padded along `dims`, in
        the traced layout), holding `arg`'s n rows; its padding rows zero."""
        buf = self.zeros(index, arg, padded_shape(arg, dims, size), size)
        copy_rows(buf, arg, dims, n)
        return buf

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
# Static input buffers: the one way every path gets a call's tensors to a captured graph.
#
# A captured graph reads each tensor input at the address it had at capture. So each such
# input has a static buffer, and every path (graph pieces, whole graphs, breakable graphs)
# uses it the same way:
#
#   allocate  at capture, at the capture size (padded along `dims`), with the traced layout
#             where a compiled piece needs it (`TracedLayout.padded_copy`, `empty_like_strided`);
#   fill      before each replay: unless the caller's tensor already lies at the buffer
#             (same address and strides: it is read in place), copy its n rows in and zero
#             the padding rows (`fill_all`, `copy_in`, `copy_rows`);
#   narrow    the graph's outputs back to the call's n rows (`narrow`, `narrow_all`).
#
# Which tensors a new graph reads in place instead of copying at all (outputs of other
# graphs, buffers their owner keeps) is `LiveBuffers`. The breakable path shares its
# buffers between the runners of one model (`StaticInput`, `SharedStatics`).


def padded_shape(t: torch.Tensor, dims: tuple[int, ...], size: int) -> tuple[int, ...]:
    """`t`'s shape with every dim in `dims` at the capture size."""
    shape = list(t.shape)
    for d in dims:
        shape[d] = size
    return tuple(shape)


def narrow(t: torch.Tensor, dims: tuple[int, ...], n: int) -> torch.Tensor:
    """The first n rows of `t` along each of `dims` (a view)."""
    for d in dims:
        t = t.narrow(d, 0, n)
    return t


def narrow_all(outputs: Sequence[torch.Tensor], dims: Sequence[tuple[int, ...]], n: int) -> tuple:
    """A graph's outputs cut back to the call's n rows, per output along its dims."""
    return tuple(narrow(o, d, n) for o, d in zip(outputs, dims))


def repeated_dims(t: torch.Tensor) -> tuple[int, ...]:
    """Dims along which `t` repeats one element (stride 0, more than one element)."""
    return tuple(d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, dims: tuple[int, ...] = (), n: int | None = None,
              repeated: tuple[int, ...] | None = None) -> None:
    """Write `src` (n rows along `dims`) into the first n rows of `dst`, the one way every
    padded input is filled: by a graph's replay, its capture and the padded CPU run alike.

    `dst` has the traced layout, which may repeat one element along a dim (stride 0: a
    broadcast such as RoPE's `inv_freq[None, :, None].expand(B, -1, 1)`). Such a dim holds
    one value whatever its size, so only its first element is written (a write through a
    repeated element is refused), and its padding rows read that same value, harmless
    where padding is safe at all: padded rows never reach a real one. `repeated`: those
    dims, when the caller knows them already (a replay, every step).
    """
    if n is not None:
        dst = narrow(dst, dims, n)
    for d in repeated_dims(dst) if repeated is None else repeated:
        dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)


def copy_in(dst: torch.Tensor, src: torch.Tensor, dims: tuple[int, ...], n: int, size: int,
            repeated: tuple[int, ...] | None = None) -> None:
    """Make the static buffer `dst` hold `src`: its n rows along `dims`, the padding rows
    (n to size) zero. Zeroed at every fill, not once: an earlier call of the same size
    with more rows left its data there. The whole buffer is zeroed, one launch as for the
    padding rows alone, but no view to make (padding along several dims, as an [s, s]
    mask's, is not one slice anyway)."""
    if n == size or not dims:
        copy_rows(dst, src, repeated=repeated)
        return
    dst.zero_()
    copy_rows(dst, src, dims, n, repeated)


def empty_like_strided(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer with `t`'s shape and strides (stride-0 dims included): what a
    graph's input buffer is, allocated inside capture so that it comes from the pool."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


class StaticBuffer:
    """An input buffer a captured graph reads, bound once at capture.

    buffer: the tensor the graph reads (graph pieces and whole graphs hold a non-owning
        alias, `capture.weak_alias`; breakable graphs own theirs).
    address, stride: where it lies; a tensor there with those strides is read in place.
    dims: the dims padded to the capture size (zeroed past n at every fill); a breakable
        input decides per call (`StaticInput.refresh`).
    repeated: the dims it repeats one element along (stride 0), see `copy_rows`.
    """

    __slots__ = ("buffer", "address", "stride", "dims", "repeated", "__weakref__")

    def __init__(self, buffer: torch.Tensor, dims: tuple[int, ...] = ()):
        self.buffer = buffer
        self.address = buffer.data_ptr()
        self.stride = buffer.stride()
        self.dims = dims
        self.repeated = repeated_dims(buffer)

    def reads_in_place(self, x: torch.Tensor) -> bool:
        """Whether a graph reading this buffer reads x itself: x lies at its address with
        its strides (the check `fill_all` inlines in its hot loop)."""
        return x.data_ptr() == self.address and x.stride() == self.stride


def fill_all(inputs: tuple[tuple[int, StaticBuffer], ...], args: Sequence, n: int, size: int) -> None:
    """Before a replay: fill each (argument index, buffer) from the call's arguments.

    The replay's hot loop: one address and stride check per input, a copy only where the
    argument is not already the buffer (it lies there: an earlier graph's output, or a
    persistent buffer, read in place)."""
    for i, static in inputs:
        x = args[i]
        if x.data_ptr() != static.address or x.stride() != static.stride:
            copy_in(static.buffer, x, static.dims, n, size, static.repeated)


class LiveBuffers:
    """Tensors a graph being captured reads in place instead of copying into a buffer.

    Two kinds, one question (`holds`: does this input, at this padded shape, lie in one?):
      - outputs of graphs (`add_output`), by address, padded shape and strides, held
        weakly: an entry lasts as long as whoever holds the tensor. A graph piece's outputs
        are registered while its capturing call holds them (the next piece of that call
        reads them in place; after the call their memory is the pool's to share); a
        breakable graph's, as long as the graph that owns them.
      - persistent buffers (`add_persistent`), which live as long as their owner (a
        pipeline stage's receive buffers): whoever fills one feeds the graph with no copy.
    A graph that read an input in place keeps its address; a later call whose tensor lies
    elsewhere copies into that memory (`fill_all`), as into a buffer of its own.

    Each owner holds its own: the `CaptureSession` (graph pieces' outputs, persistent
    buffers) and each breakable group (its runners' outputs). Not one for both: a graph
    piece keeps only the address, sound for memory that lives as long as every graph of
    the session, not for a breakable graph's output, which dies with that one graph.
    """

    def __init__(self):
        self._outputs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._persistent: dict[tuple, torch.Tensor] = {}

    def add_output(self, tensor: torch.Tensor, padded: Sequence[int]) -> None:
        """Let graphs read `tensor` (of the capture size `padded`) in place while it lives."""
        self._outputs[(tensor.data_ptr(), tuple(padded), tensor.stride())] = tensor

    def add_persistent(self, buffer: torch.Tensor) -> None:
        """Let graphs read `buffer`, or any leading slice `buffer[:k]`, in place.

        The caller owns `buffer` and keeps it alive, at this address, for as long as
        graphs replay (they hold no reference to it)."""
        self._persistent[(buffer.data_ptr(), buffer.stride()[1:])] = buffer

    def holds(self, x: torch.Tensor, padded: Sequence[int]) -> bool:
        """Whether a graph may read `x`, padded to `padded`, in place."""
        key = (x.data_ptr(), tuple(padded), x.stride())
        return self._outputs.get(key) is not None or self._is_persistent(x, padded)

    def _is_persistent(self, x: torch.Tensor, padded: Sequence[int]) -> bool:
        """Whether `x` starts a persistent buffer whose rows cover `padded`."""
        buffer = self._persistent.get((x.data_ptr(), x.stride()[1:])) if x.dim() else None
        return (buffer is not None and buffer.dtype == x.dtype and buffer.stride() == x.stride()
                and tuple(buffer.shape[1:]) == tuple(padded[1:]) and padded[0] <= buffer.shape[0])

    def clear_outputs(self) -> None:
        """Forget graph outputs (their graphs are gone); persistent buffers stay."""
        self._outputs.clear()


# --------------------------------------------------------------------------------------
# Static buffers of breakable graphs, shared between the runners of one model.
#
# A breakable graph's size is dim 0 of its first tensor input, so its buffers are padded
# along dim 0 only, and only for inputs that have the call's n rows. Runners built
# together (one per decoder layer) share two things, to avoid copies that would cost a
# launch each:
#
#   - an input that is another runner's graph output, returned as its static buffer (the
#     previous layer's hidden states), is adopted as the static buffer itself
#     (`LiveBuffers`): a replay sees the same address and copies nothing;
#   - an input passed to several runners in one step (rotary cos and sin, given to every
#     layer) gets one buffer: the first runner copies into it, the next ones see that the
#     same tensor, unchanged since (`Tensor._version`), is already there.
#
# Who owns what: a graph holds its `StaticInput`s and its outputs (strongly); the
# registries here hold them weakly, so a buffer lives exactly as long as a graph that
# reads it.

_ROWS = (0,)  # a breakable graph's padded dim


def _rows_of(x: torch.Tensor, n: int, size: int) -> tuple[int, ...]:
    """The dims of `x` padded to the size: dim 0 when x has the call's n rows and n < size."""
    return _ROWS if x.dim() > 0 and x.shape[0] == n and n != size else ()


def padded_rows_copy(x: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """A copy of `x` at the size: padded along dim 0 (zero rows) when x has the call's n rows."""
    # Normal tensors even under inference_mode: a later replay outside it copies into them.
    with torch.inference_mode(False):
        if not _rows_of(x, n, size):
            return x.clone()
        buffer = torch.zeros(padded_shape(x, _ROWS, size), dtype=x.dtype, device=x.device)
        copy_rows(buffer, x, _ROWS, n, ())
        return buffer


class StaticInput(StaticBuffer):
    """A breakable graph's input buffer (owned), and the tensor last copied into it.

    `refresh(x, n, size)` makes the buffer hold x (the first n rows of a padded buffer,
    the rest zero): a copy, unless x lies at the buffer or is the same unchanged tensor
    as last time.
    """

    __slots__ = ("_source", "_version")

    def __init__(self, buffer: torch.Tensor, source: torch.Tensor | None = None):
        super().__init__(buffer)  # padded or not is decided per call: see `refresh`
        self._source = None
        self._version = None
        if source is not None:
            self._remember(source)

    @classmethod
    def copy_of(cls, x: torch.Tensor, n: int, size: int) -> "StaticInput":
        return cls(padded_rows_copy(x, n, size), x)

    def refresh(self, x: torch.Tensor, n: int, size: int) -> None:
        # Every replay, for every input: `_unchanged` inlined; then fill as `fill_all` does.
        if self._source is not None and self._source() is x and self._version is not None \
                and x._version == self._version:
            return
        if x.data_ptr() != self.address or x.stride() != self.stride:
            # Padded this call when the buffer has the size's rows and x the call's n.
            padded = _rows_of(x, n, size) and self.buffer.shape[0] == size
            copy_in(self.buffer, x, _ROWS if padded else (), n, size, self.repeated)
        self._remember(x)

    def holds(self, x: torch.Tensor) -> bool:
        """Whether the buffer holds x now: x is the buffer, or the tensor copied in last
        and unchanged since."""
        return x is self.buffer or self._unchanged(x)

    def _unchanged(self, x: torch.Tensor) -> bool:
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
        self.live = LiveBuffers()  # the runners' graph outputs

    def static_for(self, x: torch.Tensor, n: int, size: int) -> StaticInput:
        """The buffer a new graph should read x from: one that holds x already (the buffer
        another runner copied x into in this step, or adopted), another runner's graph
        output (adopted: read in place), else a fresh copy; registered for later runners."""
        shape = padded_shape(x, _rows_of(x, n, size), size)
        for static in self._inputs:
            if static.holds(x) and static.buffer.shape == shape and not static.buffer.is_inference():
                return static
        if not x.is_inference() and self.live.holds(x, shape):
            static = StaticInput(x, x)
        else:
            static = StaticInput.copy_of(x, n, size)
        self._inputs.add(static)
        return static

    def add_outputs(self, outputs: list[torch.Tensor]) -> None:
        """Register a graph's static outputs (which the graph keeps alive) so that a runner
        they are passed to adopts them as its input buffers."""
        for t in outputs:
            self.live.add_output(t, t.shape)
