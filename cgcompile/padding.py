"""Which captured size serves a call of size n: the smallest capture size >= n."""

from __future__ import annotations


class PaddingTable:
    """O(1) lookup from a runtime size to its capture size (None above the largest)."""

    def __init__(self, capture_sizes: tuple[int, ...]):
        self.sizes = tuple(sorted(capture_sizes))
        self.largest = self.sizes[-1]
        table: list[int | None] = [None] * (self.largest + 1)
        size_iter = iter(self.sizes)
        current = next(size_iter)
        for n in range(1, self.largest + 1):
            if n > current:
                current = next(size_iter)
            table[n] = current
        self._table = table

    def padded(self, n: int) -> int | None:
        return self._table[n] if 0 < n <= self.largest else None
