"""Whether a call may replay CUDA graphs that read parameters and buffers in place.

Graphs read a graph's parameters and buffers at the addresses they were captured with.
Those addresses can change under the same compiled code:
  - Dynamo reuses one compiled graph for every instance of a module class (parameters
    are graph inputs), so a second model of the same class and shapes, compiled with the
    same backend, calls the first model's graphs with its own parameters;
  - a parameter is replaced (`param.data = ...`, `module.weight = ...`, a new state dict
    loaded into new tensors).
A replay would then compute with the old tensors. `ParameterAddresses.allow(args)` compares
the addresses a call passes with those of the capture. A call that differs runs without
graphs (correct, slower; a warning says so once); a second call in a row with the same new
addresses means they settled (new weights): the graphs are dropped and captured again.
Instances that alternate therefore never replay each other's graphs and never recapture
at every call. The check costs one `data_ptr()` per parameter and buffer per call.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

log = logging.getLogger(__name__)


class ParameterAddresses:
    """indices: positions of the parameters and buffers among a graph's inputs;
    drop_graphs: forgets the graph's CUDA graphs (they are captured again lazily)."""

    def __init__(self, name: str, indices: Sequence[int], names: Sequence[str], drop_graphs: Callable[[], None]):
        self.name = name
        self.indices = tuple(indices)
        self.names = tuple(names)
        self.drop_graphs = drop_graphs
        self.captured: list[int] | None = None  # the addresses the graphs hold
        self._moved: list[int] | None = None  # the addresses of the last call, if they differed
        self.calls_without_graphs = 0
        self.recaptures = 0
        self._warned = False

    def allow(self, args: Sequence) -> bool:
        """Whether this call may replay (or capture) graphs."""
        addresses = [args[i].data_ptr() for i in self.indices]
        if addresses == self.captured:
            self._moved = None
            return True
        if self.captured is None:
            self.captured = addresses
            return True
        if addresses == self._moved:  # the same new addresses twice in a row: settled
            log.info("cgcompile: %s: its parameters and buffers moved (%s); its CUDA graphs are "
                     "captured again", self.name, self._first_difference(addresses))
            self.drop_graphs()
            self.captured, self._moved = addresses, None
            self.recaptures += 1
            return True
        self._moved = addresses
        self.calls_without_graphs += 1
        if not self._warned:
            self._warned = True
            log.warning(
                "cgcompile: %s was captured with other parameters than this call passes (%s), so "
                "this call runs without CUDA graphs. Dynamo reuses compiled code for every instance "
                "of a module class: give each model its own backend (torch.compile(m, "
                "backend=cgcompile.Backend())) to get graphs for each. Weights replaced by new "
                "tensors are captured again from the second call that passes them.",
                self.name, self._first_difference(addresses))
        return False

    def _first_difference(self, addresses: list[int]) -> str:
        for name, now, then in zip(self.names, addresses, self.captured):
            if now != then:
                return f"{name!r} is at {now:#x}, captured at {then:#x}"
        return "no difference"
