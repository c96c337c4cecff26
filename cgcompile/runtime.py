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
    """What the backend hands back to Dynamo for one graph: the stitch with its runners."""

    def __init__(self, stitch: torch.fx.GraphModule, runners: list[PieceRunner]):
        for runner in runners:
            setattr(stitch, runner.piece_name.rsplit(".", 1)[-1], runner)
        self.stitch = stitch
        self.runners = runners

    def __call__(self, *args):
        return self.stitch(*args)


def build_runner(piece, spec, fn, analysis, backend) -> PieceRunner:
    return PieceRunner(piece.name, fn)
