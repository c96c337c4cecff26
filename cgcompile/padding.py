"""Which captured size serves a call of size n: the smallest capture size >= n."""

from __future__ import annotations

import bisect


class PaddingTable:
    """Lookup from a runtime size to its capture size (None above the largest).

    A binary search over the sorted sizes: memory does not grow with the largest size.
    """

    def __init__(self, capture_sizes: tuple[int, ...]):
        self.sizes = tuple(sorted(capture_sizes))
        self.largest = self.sizes[-1]

    def padded(self, n: int) -> int | None:
        if not 0 < n <= self.largest:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]
