"""What the segments of a breakable graph are recorded into: CUDA graphs, or a list of ops.

The recorder (`breakable.record`) runs a module once and hands every op between two
eager steps to one of these. Each is used the same way: `begin()` a segment where the
previous one ended, `record(...)` each op after it ran, `end(...)` it before the next eager
step. `end` leaves the segment's results computed (so the eager step after it reads real
data: capture and run) and returns what replays it, or None for a segment without ops
(two eager steps in a row).

  CudaGraphSegments  each segment is a CUDA graph in the session's pool, replayed once
                     right after its capture (capture records kernels without running them)
  Observer           nothing is recorded: the ops just run. An observation learns a call's
                     signature without capturing (see `breakable.signature`)
  OpReplay           each segment is the list of ops it ran, re-run at replay on the same
                     tensors, their results copied into the recorded outputs: what a CUDA
                     graph does (fixed addresses, shapes and Python values frozen at
                     capture; in-place view ops such as `squeeze_`, which only change a
                     tensor object's shape, are not re-run), on any device. Tests use it
                     on the CPU; it shows whether a model's breaks are right before a GPU
                     is at hand. No speed-up.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..run.capture import CaptureSession, gc_paused

SEGMENT_KINDS = ("cuda_graphs", "op_replay")


class CudaGraphSegments:
    def __init__(self, session: CaptureSession):
        self.session = session

    def context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(self.session.on_capture_stream())
        stack.enter_context(gc_paused())
        return stack

    def begin(self) -> torch.cuda.CUDAGraph:
        return self.session.begin_graph()

    def record(self, segment, func, args, kwargs, out) -> None:
        pass  # the graph records the kernels itself

    def end(self, graph: torch.cuda.CUDAGraph, name: str, empty: bool) -> Callable[[], None] | None:
        # A segment without ops (two eager steps in a row), or whose ops launch no kernels
        # (views): nothing to replay.
        if self.session.end_graph(graph, name) or empty:
            return None
        graph.replay()  # capture ran nothing: compute the segment's results now
        return graph.replay

    def abandon(self, graph: torch.cuda.CUDAGraph) -> None:
        self.session.abandon(graph)


class Observer:
    """Runs the ops; on CUDA on the capture stream, so an observation is also the warm-up
    (cuBLAS handles and workspaces of that stream) of the capture that may follow."""

    def __init__(self, session: CaptureSession | None):
        self.session = session

    def context(self) -> contextlib.AbstractContextManager:
        return self.session.on_capture_stream() if self.session is not None else contextlib.nullcontext()

    def begin(self) -> object:
        return self

    def record(self, segment, func, args, kwargs, out) -> None:
        pass

    def end(self, segment, name: str, empty: bool) -> None:
        return None

    def abandon(self, segment) -> None:
        pass


class OpReplay:
    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin(self) -> list:
        return []

    def record(self, ops: list, func, args, kwargs, out) -> None:
        if torch.Tag.inplace_view in func.tags:
            return  # squeeze_, t_, ...: a change of the tensor object's shape, made once, as in a graph
        # Aliases (`detach`) keep each result's shape and strides as they were made, whatever
        # an in-place view op does to the result's tensor object later.
        ops.append((func, args, kwargs, [t.detach() for t in _tensors(out)]))

    def end(self, ops: list, name: str, empty: bool) -> Callable[[], None] | None:
        return None if empty else _OpList(ops).replay

    def abandon(self, ops: list) -> None:
        pass


class _OpList:
    __slots__ = ("ops",)

    def __init__(self, ops: list):
        self.ops = ops

    def replay(self) -> None:
        for func, args, kwargs, outs in self.ops:
            for recorded, fresh in zip(outs, _tensors(func(*args, **kwargs))):
                # Views and in-place results already live in the recorded memory. `.data`: a
                # graph replay bumps no version counter, so this copy must not either.
                if fresh.data_ptr() != recorded.data_ptr() or fresh.stride() != recorded.stride():
                    recorded.data.copy_(fresh)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [x for x in value if isinstance(x, torch.Tensor)]
    return []


def segments_for(kind: str, session: CaptureSession):
    """The backend that captures segments of this kind (see SEGMENT_KINDS)."""
    return CudaGraphSegments(session) if kind == "cuda_graphs" else OpReplay()


def observer_for(kind: str, session: CaptureSession) -> Observer:
    return Observer(session if kind == "cuda_graphs" else None)
