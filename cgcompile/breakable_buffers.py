"""Static input buffers of breakable graphs, shared between the runners of one model.

A captured segment reads each tensor input at the address it had at capture, so every
tensor input that captured ops read gets a static buffer that a call refreshes before
replay. Runners built together (one per decoder layer) share two things, to avoid copies
that would cost a launch each:

  - an input that is another runner's graph output, returned as its static buffer (the
    previous layer's hidden states), is adopted as the static buffer itself: a replay
    sees the same address and copies nothing;
  - an input passed to several runners in one step (rotary cos and sin, given to every
    layer) gets one buffer: the first runner copies into it, the next ones see that the
    same tensor, unchanged since (`Tensor._version`), is already there.

Who owns what: a graph holds its `StaticInput`s (strongly); the registry here holds them
weakly, so a buffer lives exactly as long as a graph that reads it.
"""

from __future__ import annotations

import weakref

import torch


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
