"""Run a split graph: the stitching module calls one runner per piece, in order."""

from __future__ import annotations

from typing import Callable

import torch


class PieceRunner(torch.nn.Module):
    """Runs one piece: its FX code (eager pieces, compiler="eager") or a compiled function."""

    def __init__(self, name: str, fn: Callable):
        super().__init__()
        self.piece_name = name
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class GraphRuntime:
    """What the backend hands back to Dynamo for one graph: the stitch with its runners.

    clone_outputs: positions of graph outputs that are CUDA graph static buffers; they
    are copied before returning so a later call cannot overwrite what the caller holds.
    """

    def __init__(self, stitch: torch.fx.GraphModule, runners: list[PieceRunner], clone_outputs: tuple[int, ...]):
        for runner in runners:
            setattr(stitch, runner.piece_name.rsplit(".", 1)[-1], runner)
        self.stitch = stitch
        self.runners = runners
        self.clone_outputs = clone_outputs

    def __call__(self, *args):
        outputs = self.stitch(*args)
        if not self.clone_outputs:
            return outputs
        outputs = list(outputs)
        for i in self.clone_outputs:
            outputs[i] = outputs[i].clone()
        return tuple(outputs)
