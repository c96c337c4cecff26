"""Where a model's breakable runners sit: on its boundary module, or on each decoder layer.

`BreakablePath` owns the runners of one model and routes calls through them by setting
each captured module's `forward` (an instance attribute; `uninstall` puts back what was
there, and classes are never touched). `GraphManager` builds one: through an integration
for a framework's models (`cgcompile.breakable.integrations`: for transformers, a runner per decoder
layer), else `boundary_path`: one runner on the boundary module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..run.capture import CaptureSession
from ..config import Config
from .boundary import resolve_boundary
from .runner import BreakableRunner

_MISSING = object()


class BreakablePath:
    """The runners of one model, and the forwards they are installed as.

    forwards: what each runner's module.forward becomes while installed (default: the
    runner itself; an integration may wrap it).
    """

    def __init__(self, model: torch.nn.Module, runners: list[BreakableRunner],
                 forwards: list[Callable] | None = None):
        self.model = model
        self.runners = runners
        self.forwards = forwards if forwards is not None else list(runners)
        self.installed = False
        self._previous: list[Any] = []

    def install(self) -> None:
        """Route calls of the model through the runners until `uninstall`."""
        if self.installed:
            return
        self._previous = [runner.module.__dict__.get("forward", _MISSING) for runner in self.runners]
        for runner, forward in zip(self.runners, self.forwards):
            runner.module.forward = forward
        self.installed = True

    def uninstall(self) -> None:
        """Put every module's forward back as it was before `install`."""
        if not self.installed:
            return
        for runner, previous in zip(self.runners, self._previous):
            if previous is _MISSING:
                runner.module.__dict__.pop("forward", None)
            else:
                runner.module.forward = previous
        self.installed = False

    @contextlib.contextmanager
    def active(self):
        """Installed for the duration of the block (a no-op when installed already)."""
        if self.installed:
            yield
            return
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    def __call__(self, *args, **kwargs):
        """Run the whole model with its captured modules replayed from breakable graphs."""
        if not self.installed and len(self.runners) == 1 and self.runners[0].module is self.model:
            return self.runners[0](*args, **kwargs)
        with self.active():
            return self.model(*args, **kwargs)

    def graph_count(self) -> int:
        return sum(runner.graph_count() for runner in self.runners)

    def describe(self) -> str:
        """What each runner captured, step by step (identical layers once)."""
        groups = list(dict.fromkeys(runner.group for runner in self.runners))
        return "\n".join(group.describe() for group in groups)

    def clear(self) -> None:
        for runner in self.runners:
            runner.clear()


def boundary_path(model: torch.nn.Module, boundary: Any, config: Config, session: CaptureSession,
                  segments: str) -> BreakablePath:
    """One runner on the boundary module ("auto": the layer stack)."""
    module = resolve_boundary(model, boundary)
    return BreakablePath(model, [BreakableRunner(module, config, session, segments=segments)])
