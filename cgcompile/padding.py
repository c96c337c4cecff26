"""Which captured size serves a call of size n: padded to a capture size, or exact."""

from __future__ import annotations

import bisect
import logging

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
