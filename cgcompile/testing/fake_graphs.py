"""CUDA graphs faked on CPU: graph pieces, whole graphs and their replay plans run there as
they run on the GPU, so their logic (static buffers, padding, replay order, recovery) is
tested without one.

`fake_cuda_graphs(monkeypatch)` replaces the one seam the engine makes graphs through,
`capture.CaptureSession.graphs`: the analysis then says graphs are on for CPU tensors,
and a capture returns a `FakeGraph`. Everything else runs unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from ..run.capture import CaptureSession, CudaGraphs
from ..errors import CaptureError


class FakeGraph:
    """A stand-in for a captured CUDA graph: a replay runs the captured function again on
    the captured (static) inputs and writes the captured outputs, so a replay that left a
    buffer unfilled reads what it held before, as on the GPU.

    capturing: True while a fake capture runs (an op may refuse to run then, as a
    host-reading op does under a real capture); replays, captures: counts so far."""

    capturing = False
    replays = 0
    captures = 0

    def __init__(self, fn: Callable, args: list, outputs: tuple):
        self.fn, self.args, self.outputs = fn, args, outputs
        FakeGraph.captures += 1

    def replay(self) -> None:
        FakeGraph.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.args)):
            out.copy_(new)

    def reset(self) -> None:
        self.fn = self.args = self.outputs = None


class _ZeroedBuffers(TorchFunctionMode):
    """Buffers made for a capture (`torch.empty_strided`) hold zeros, not garbage: the fake
    capture runs on them, and garbage ids would index out of range."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.empty_strided:
            span = 1 + sum((size - 1) * stride for size, stride in zip(out.shape, out.stride()))
            out = out.new_zeros(span if out.numel() else 0).as_strided(out.shape, out.stride())
        return out


class FakeCudaGraphs(CudaGraphs):
    """`capture.CudaGraphs` on CPU: warm-up runs the function; capture runs it once on the
    buffers and undoes what it wrote into them, since a real capture records without running."""

    def runs_on(self, device: torch.device) -> bool:
        return True

    def warm_up(self, session, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)

    def capture(self, session, name: str, fn: Callable, make_args: Callable[[], tuple]):
        with _ZeroedBuffers():
            args = make_args()
        saved = [(a, a.clone()) for a in args if isinstance(a, torch.Tensor)]
        FakeGraph.capturing = True
        try:
            outputs = tuple(fn(*args))
        except RuntimeError as e:
            raise CaptureError(f"capturing {name} failed: {e}") from e
        finally:
            FakeGraph.capturing = False
            for tensor, before in saved:
                tensor.copy_(before)
        return FakeGraph(fn, args, outputs), args, outputs


def fake_cuda_graphs(monkeypatch) -> None:
    """Make graph pieces run on CPU as on the GPU until the test ends (`monkeypatch` undoes
    it): only the capture itself is faked. Resets the `FakeGraph` counts."""
    monkeypatch.setattr(CaptureSession, "graphs", FakeCudaGraphs())
    FakeGraph.replays = FakeGraph.captures = 0
