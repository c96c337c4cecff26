"""The concatenated weights of fused sibling linears (Config.fuse_sibling_linears), kept
equal to the parameters they were made from.

`passes.fuse_sibling_linears` adds one graph input per fused weight (and bias),
`cat(w_1, ..., w_k)`, made by `FusedWeightStore`:
  - shared (the usual case): where the sources are plain parameters that each own their
    memory alone, each parameter becomes a view of its rows of the fused weight
    (`param.data = fused[rows]`). Fusing then costs no memory, and every write to a
    parameter, in place or through `param.data`, lands in the fused weight. The
    parameters' addresses move once, when their first graph is compiled, before any capture.
    Sources that already lie one after another in one memory (shared so by another
    backend) are read where they are.
  - where sharing cannot be proved safe (a parameter that is a view of larger memory,
    memory another tensor also holds, such as tied weights or a kept `param.data`, the same
    tensor twice, a tensor subclass): a copy, if the store was made with `copies=True`
    (`Config(fuse_sibling_linears=True)`), whose bytes are `stats.fused_weight_bytes`; else
    no fused weight, and the group stays unfused. Either way the reason is logged.

`FusedWeights.extend(args)` runs first in every call: it appends the fused weights to the
call's inputs, after checking that no source parameter changed since they were made. A
parameter counts as changed when its address moved (replaced: `module.weight = ...`,
`param.data = ...`), or, for a copy, when its version counter moved too (written in place
through the parameter: `load_state_dict`, `param.copy_`, an optimizer step; a shared
parameter's writes land in the fused weight itself). Then every part not already in place
is copied into its rows: the fused weights keep their addresses, so captured CUDA graphs
that read them stay valid.

Not seen, for copies: writes through `param.data` (a tensor with its own version counter).
After such a write, call `Backend.refresh_fused_weights()` (`invalidate` here). The check
costs an address read per shared source and an address and a counter read per copied one,
per call (the 8B Llama's 160 shared sources: about 18 us on a desktop CPU); no GPU work
unless something changed.
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
        self._watch(example_inputs)
        self._stamp = self._stamp_of(example_inputs)
        self.refreshes = 0

    def extend(self, args: Sequence) -> tuple:
        """The call's inputs with the fused weights appended, refreshed first if stale."""
        stamp = self._stamp_of(args)
        if stamp != self._stamp:
            self.refresh(args)
            self._watch(args)
            self._stamp = self._stamp_of(args)
        return (*args, *self.tensors)

    def refresh(self, args: Sequence) -> None:
        """Make every fused weight again from the parameters in `args`, in place."""
        with torch.no_grad():
            for fused, sources in zip(self.tensors, self._sources):
                copy_into(fused, [args[i] for i in sources])
        self.refreshes += 1
        log.info("cgcompile: a fused linear's parameter changed; %d fused weights were made again", len(self.tensors))

    def invalidate(self) -> None:
        """Make the next call copy every fused weight again."""
        self._stamp = None

    def _watch(self, args: Sequence) -> None:
        """Split the sources into those whose memory is their rows of a fused weight
        (shared: every write through them lands there, so only a move can make it stale)
        and the others (a copy: their writes must be seen through the version counter)."""
        shared, copied = set(), set()
        for fused, sources in zip(self.tensors, self._sources):
            start = 0
            for i in sources:
                (shared if is_rows_of(args[i], fused, start) else copied).add(i)
                start += args[i].shape[0]
        self._moved_only = tuple(sorted(shared - copied))
        self._written = tuple(sorted(copied))

    def _stamp_of(self, args: Sequence) -> tuple:
        # The call's cost for every fused model: a Python read per source (160 at 8B).
        return (tuple(args[i].data_ptr() for i in self._moved_only),
                tuple((args[i].data_ptr(), args[i]._version) for i in self._written))


class FusedWeightStore:
    """The fused weights of one Backend: one per set of sources for all its graphs (a
    prefill and a decode graph fuse the same weights), shared with the parameters where
    they allow it, else copies (see the module's docstring). Called as the `concat` of
    `passes.fuse_sibling_linears`. A copy handed to a later graph is first made again in
    place: its sources may have been written since (graphs that read it already notice
    that themselves, see `FusedWeights`)."""

    def __init__(self, copies: bool = True):
        self.copies = copies  # False: a group that cannot share gets no fused weight (None)
        self._copies: dict[tuple, torch.Tensor] = {}
        self._shared: list[torch.Tensor] = []

    def __call__(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        # A weight made inside a stream capture would live in the graph pool and be filled
        # only by the capture's own run: never the case, as Dynamo compiles before any capture.
        assert not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()), \
            "cgcompile: a fused weight was requested during a CUDA graph capture"
        for fused in self._shared:
            if laid_out_in(fused, parts):  # a later graph over parameters already shared
                return fused
        in_place = adjacent_rows(parts)
        if in_place is not None:  # shared already (by another backend), or laid out so by the model
            self._shared.append(in_place)
            return in_place
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in parts)
        with torch.no_grad():
            if key in self._copies:
                copy_into(self._copies[key], parts)
                return self._copies[key]
            why = why_not_shared(parts)
            if why is not None and not self.copies:
                log.info("cgcompile: %d sibling linears stay unfused: %s (Config(fuse_sibling_linears=True) "
                         "fuses them through a copy of their weights)", len(parts), why)
                return None
            fused = torch.cat(parts, dim=0)
            if why is None:
                share(fused, parts)
                self._shared.append(fused)
            else:
                log.info("cgcompile: a fused weight of %d parameters %s is a copy (%.1f MB): %s", len(parts),
                         tuple(fused.shape), fused.numel() * fused.element_size() / 2**20, why)
                self._copies[key] = fused
        return fused

    @property
    def bytes(self) -> int:
        """The memory the copies take beyond the parameters (shared weights take none)."""
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    @property
    def shared(self) -> int:
        return len(self._shared)


def why_not_shared(parts: Sequence[torch.Tensor]) -> str | None:
    """Why the parameters `parts` cannot become views of their fused weight, or None.
    Each must be a plain parameter that spans all of its memory and is that memory's only
    holder: otherwise another tensor (a tied weight, a kept `param.data`, a larger tensor
    it is a view of) would stop seeing the parameter's values once it moved."""
    storages = set()
    for p in parts:
        if not isinstance(p, torch.nn.Parameter) or type(p.data) is not torch.Tensor:
            return f"a source is a {type(p).__name__}, not a plain parameter"
        storage = p.untyped_storage()
        if not p.is_contiguous() or p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
            return f"a parameter of shape {tuple(p.shape)} is a view of larger memory"
        # Holders of the memory: the parameter, and `storage` just made here.
        if torch._C._storage_Use_Count(storage._cdata) > 2:
            return f"a parameter of shape {tuple(p.shape)} shares its memory with another tensor (tied weights?)"
        storages.add(storage.data_ptr())
    if len(storages) != len(parts):
        return "one tensor is the weight of two of the linears"
    return None


def adjacent_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A tensor whose consecutive rows `parts` are, over their own memory, where they lie one
    after another in one memory (parameters another backend made views of its fused
    weight, or a model that keeps them so), else None."""
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        if type(p.data) is not torch.Tensor or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            return None
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def share(fused: torch.Tensor, parts: Sequence[torch.nn.Parameter]) -> None:
    """Make each parameter a view of its rows of `fused` (which holds their values)."""
    start = 0
    for p in parts:
        p.data = fused.narrow(0, start, p.shape[0])
        start += p.shape[0]


def laid_out_in(fused: torch.Tensor, parts: Sequence[torch.Tensor]) -> bool:
    """Whether `parts`, in order, are exactly the consecutive rows of `fused`."""
    start = 0
    for p in parts:
        if not is_rows_of(p, fused, start):
            return False
        start += p.shape[0]
    return start == fused.shape[0]


def is_rows_of(part: torch.Tensor, fused: torch.Tensor, start: int) -> bool:
    """Whether `part` is rows start.. of `fused`, in the same memory and layout."""
    if type(part.data) is not torch.Tensor or part.dtype != fused.dtype or part.device != fused.device:
        return False
    if part.shape[1:] != fused.shape[1:] or start + part.shape[0] > fused.shape[0]:
        return False
    rows = fused.narrow(0, start, part.shape[0])
    return part.data_ptr() == rows.data_ptr() and part.stride() == rows.stride()


def copy_into(fused: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Copy each part into its rows of `fused`, except parts that are those rows already
    (shared parameters): so a shared weight with one replaced parameter is refreshed too."""
    start = 0
    for p in parts:
        if not is_rows_of(p, fused, start):
            fused.narrow(0, start, p.shape[0]).copy_(p)
        start += p.shape[0]
