"""The memory pool that every CUDA graph of one owner (a Backend, a manager) shares.

Sharing is safe because of one invariant: graphs that share a pool replay in the order
they were captured within one step, and a graph's memory is only reused by graphs
captured after the last reader of that memory was captured (Python refcounts decide it
during the capturing call). See `capture.CaptureSession`.
"""

from __future__ import annotations

import torch


class GraphPool:
    """Owns one CUDA graph pool handle; pass it to other graph users to share memory."""

    def __init__(self, device: torch.device | int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
        self.handle = torch.cuda.graph_pool_handle()

    def bytes_reserved(self) -> int:
        """Bytes of device memory the pool holds now (its segments, used or cached)."""
        return sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", ())) == tuple(self.handle)
        )


def as_pool(pool) -> GraphPool | None:
    """Accept a GraphPool, a raw handle from torch.cuda.graph_pool_handle(), or None."""
    if pool is None or isinstance(pool, GraphPool):
        return pool
    wrapped = GraphPool.__new__(GraphPool)
    wrapped.device = torch.device("cuda", torch.cuda.current_device())
    wrapped.handle = tuple(pool)
    return wrapped
