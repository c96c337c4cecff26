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

    @property
    def step_fn(self) -> Callable:
        """What the runtime calls every step: the piece's code itself, without the layers
        of nn.Module.__call__ (hook checks) around this runner and around an FX piece."""
        return self.fn.forward if isinstance(self.fn, torch.fx.GraphModule) else self.fn


class _StitchNamespace:
    """The `self` the stitch's generated forward runs with on the hot path.

    The generated code reaches each piece as `self.submod_<k>(...)`. On the GraphModule
    that is nn.Module.__getattr__ and then nn.Module.__call__ per piece and per step;
    here it is a plain attribute holding the runner's `step_fn`. Anything else the code
    reads (get_attr constants) comes from the stitch itself.
    """

    def __init__(self, stitch: torch.fx.GraphModule, calls: dict[str, Callable]):
        self._stitch = stitch
        self.__dict__.update(calls)

    def __getattr__(self, name: str):
        return getattr(self._stitch, name)


class GraphRuntime:
    """What the backend hands back to Dynamo for one graph: the stitch with its runners.

    The runners are registered on the stitch (so it prints and dumps with them); each
    step runs the stitch's code against a `_StitchNamespace` instead (see there).

    clone_outputs: positions of graph outputs that are CUDA graph static buffers; they
    are copied before returning so a later call cannot overwrite what the caller holds.
    """

    def __init__(self, stitch: torch.fx.GraphModule, runners: list[PieceRunner], clone_outputs: tuple[int, ...]):
        calls = {}
        for runner in runners:
            name = runner.piece_name.rsplit(".", 1)[-1]
            setattr(stitch, name, runner)
            calls[name] = runner.step_fn
        self.stitch = stitch
        self.runners = runners
        self.clone_outputs = clone_outputs
        self._namespace = _StitchNamespace(stitch, calls)
        self._code = type(stitch).forward  # the generated function; `self` is its first argument

    def __call__(self, *args):
        outputs = self._code(self._namespace, *args)
        if not self.clone_outputs:
            return outputs
        outputs = list(outputs)
        for i in self.clone_outputs:
            outputs[i] = outputs[i].clone()
        return tuple(outputs)
