"""The device buffer a graph reads its value-only host ints from, written before every call.

`passes.read_scalars_from_device` rewrites a graph so that host ints it uses only as
values of tensor ops (a sliding-window cache's offset) are read from a [k] int64 buffer,
a graph input appended last. `DeviceScalarBuffer` owns that buffer:

  - `extend(args)` runs at the start of every call, before any executor: it writes the
    call's ints into the buffer (one host-to-device copy of 8k bytes, on the current
    stream, from pinned memory that the caching host allocator keeps until the copy has
    run) and appends the buffer to the call's inputs. Full graph, replay plan and stitch
    all run after it on the same stream, so whichever runs reads this call's values, and
    a replay never reads a stale one. The buffer keeps its address for the graph's life
    (it is marked static: captured pieces read it in place, no copy).
  - `host_outputs(args, outputs)`: a replayed full graph returns the host ints it was
    captured with; those the graph computes from the symbols are computed again here,
    by the graph's own host arithmetic (`passes.host_output_code`), for the call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..passes import DeviceScalars, host_output_code


class DeviceScalarBuffer:
    """found: what the pass rewrote; gm: the rewritten graph (its host outputs are copied
    out of it); values: the [k] int64 buffer on `found.device` (made by the caller, static)."""

    def __init__(self, found: DeviceScalars, gm: torch.fx.GraphModule, values: torch.Tensor):
        self.values = values
        self.inputs = found.inputs
        self.positions = found.host_outputs
        self._pinned = values.is_cuda
        self._host_code = host_output_code(gm, found.host_outputs).forward if found.host_outputs else None

    def extend(self, args: Sequence) -> tuple:
        """The call's inputs with the buffer appended, holding this call's ints."""
        host = torch.tensor([args[i] for i in self.inputs], dtype=torch.int64, pin_memory=self._pinned)
        self.values.copy_(host, non_blocking=self._pinned)
        return (*args, self.values)

    def host_outputs(self, args: Sequence, outputs: tuple) -> tuple:
        """`outputs` with the host ints that depend on the symbols computed for `args`."""
        if self._host_code is None:
            return outputs
        outputs = list(outputs)
        for k, value in zip(self.positions, self._host_code(*args)):
            outputs[k] = value
        return tuple(outputs)
