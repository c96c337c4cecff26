"""The concatenated weights of fused sibling linears (Config.fuse_sibling_linears), kept
equal to the parameters they were made from.

`passes.fuse_sibling_linears` adds one graph input per fused weight (and bias): a copy,
`cat(w_1, ..., w_k)`. `FusedWeights.extend(args)` runs first in every call: it appends
those copies to the call's inputs, after checking that no source parameter changed since
they were made. A parameter counts as changed when its address or its version counter
moved: replaced (`module.weight = ...`, `param.data = ...`) or written in place through
the parameter (`load_state_dict`, `param.copy_`, an optimizer step). Then every copy is
made again, in place: the copies keep their addresses, so captured CUDA graphs that read
them stay valid.

Not seen: writes through `param.data` (a tensor with its own version counter). After
such a write, call `Backend.refresh_fused_weights()` (`invalidate` here). The check
costs one address and one counter read per source parameter per call (23 us for 80
parameters on a desktop CPU, 71 us on the H100 machine's host); no GPU work unless
something changed.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..passes import FusedInput

log = logging.getLogger(__name__)


class FusedWeights:
    """fused: what the pass added; source_index: placeholder name -> position in a call's args."""

    def __init__(self, fused: Sequence[FusedInput], source_index: dict[str, int], example_inputs: Sequence):
        self.tensors = tuple(f.tensor for f in fused)
        self._sources = tuple(tuple(source_index[s] for s in f.sources) for f in fused)
        self._watched = tuple(sorted({i for sources in self._sources for i in sources}))
        self._stamp = self._stamp_of(example_inputs)
        self.refreshes = 0

    def extend(self, args: Sequence) -> tuple:
        """The call's inputs with the fused weights appended, refreshed first if stale."""
        stamp = self._stamp_of(args)
        if stamp != self._stamp:
            self.refresh(args)
            self._stamp = stamp
        return (*args, *self.tensors)

    def refresh(self, args: Sequence) -> None:
        """Make every fused weight again from the parameters in `args`, in place."""
        with torch.no_grad():
            for fused, sources in zip(self.tensors, self._sources):
                torch.cat([args[i] for i in sources], dim=0, out=fused)
        self.refreshes += 1
        log.info("cgcompile: a fused linear's parameter changed; %d fused weights were made again", len(self.tensors))

    def invalidate(self) -> None:
        """Make the next call copy every fused weight again."""
        self._stamp = None

    def _stamp_of(self, args: Sequence) -> tuple:
        return tuple((args[i].data_ptr(), args[i]._version) for i in self._watched)


class FusedCopies:
    """The fused weight copies of one Backend: one per set of sources for all its graphs
    (a prefill and a decode graph fuse the same weights). Called as the copy function of
    `passes.fuse_sibling_linears`. A copy handed to a later graph is first made again in
    place: its sources may have been written since (graphs that read it already notice
    that themselves, see `FusedWeights`)."""

    def __init__(self):
        self._copies: dict[tuple, torch.Tensor] = {}

    def __call__(self, parts: list[torch.Tensor]) -> torch.Tensor:
        # A copy made inside a stream capture would live in the graph pool and be filled
        # only by the capture's own run: never the case, as Dynamo compiles before any capture.
        assert not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()), \
            "cgcompile: a fused weight copy was requested during a CUDA graph capture"
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in parts)
        with torch.no_grad():
            if key in self._copies:
                return torch.cat(parts, dim=0, out=self._copies[key])
            self._copies[key] = torch.cat(parts, dim=0)
        return self._copies[key]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._copies.values())
