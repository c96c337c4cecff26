"""One object per model that owns the graph pool and runs the chosen CUDA graph path.

`run_pw_graph(model, inputs)` is the one call a model runner makes each step. The path
is decided once, when the manager is built, and logged: compiled pieces (the
`cgcompile` backend) or breakable CUDA graphs (no compilation). With graphs off
(`Config.cudagraphs=False`, or a model not on CUDA) the model runs eagerly. Both paths,
when both are used, capture into the manager's one pool.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .aot_capture import (
    MakeInputs,
    call_with,
    capture_all,
    check_capture_call,
    check_cudagraphs_setting,
    check_pool,
    require_captured,
    require_cuda_graphs,
    requested_sizes,
)
from .backend import Backend
from .boundary import resolve_boundary
from .breakable import BreakableRunner
from .capture import CaptureSession
from .config import Config, as_config
from .errors import ArgumentError, expect

log = logging.getLogger(__name__)


class GraphManager:
    """Owns the pool and holds the compiled-piece path or the breakable runner.

    use_breakable: the path this manager runs, from `Config.use_breakable` or the
        CGCOMPILE_USE_BREAKABLE environment variable (decided once, here).
    boundary: what the breakable runner captures ("auto", a module, a path, or None).
    """

    def __init__(self, model: torch.nn.Module, config: Config | None = None, *,
                 boundary: Any = "auto", pool: Any = None):
        _check_model(model)
        self.model = model
        self.config = as_config(config, "GraphManager")
        _check_boundary(model, boundary)
        check_pool("GraphManager", pool)
        check_cudagraphs_setting("GraphManager", self.config)
        self.session = CaptureSession.for_config(self.config, pool=pool)
        self.use_breakable = self.config.resolved_use_breakable()
        self.graphs_enabled = self._graphs_enabled()
        self._boundary = boundary
        self._backend: Backend | None = None
        self._compiled = None
        self._breakable: BreakableRunner | None = None
        log.info(
            "cgcompile: %s runs %s", type(model).__name__,
            "eagerly (CUDA graphs off)" if not self.graphs_enabled
            else "breakable CUDA graphs" if self.use_breakable else "compiled pieces with CUDA graphs",
        )

    def _graphs_enabled(self) -> bool:
        if self.config.cudagraphs is not None:
            return self.config.cudagraphs
        return any(p.is_cuda for p in self.model.parameters())

    def _graphs_off_because(self) -> str:
        if self.config.cudagraphs is False:
            return "Config.cudagraphs=False"
        return f"a {type(self.model).__name__} with no parameter on CUDA (graphs follow the model's device)"

    # -- the two paths, created on first use ---------------------------------------------------

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = Backend(self.config, session=self.session)
        return self._backend

    @property
    def compiled(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.model, backend=self.backend)
        return self._compiled

    @property
    def breakable(self) -> BreakableRunner:
        if self._breakable is None:
            module = resolve_boundary(self.model, self._boundary)
            self._breakable = BreakableRunner(module, self.config, self.session)
        return self._breakable

    def run_breakable(self, *args, **kwargs):
        """Run the whole model with its boundary module replayed from breakable graphs."""
        runner = self.breakable
        if runner.module is self.model:
            return runner(*args, **kwargs)
        module = runner.module
        previous = module.__dict__.get("forward")
        module.forward = runner
        try:
            return self.model(*args, **kwargs)
        finally:
            del module.forward
            if previous is not None:
                module.forward = previous

    def _path(self):
        if not self.graphs_enabled:
            return self.model
        return self.run_breakable if self.use_breakable else self.compiled

    # -- what a model runner calls -------------------------------------------------------------

    def run_pw_graph(self, model: torch.nn.Module, inputs: Any):
        """Run one step: inputs is a tuple of args, a dict of kwargs, or one tensor.

        A list is refused (ArgumentError): write tuple(inputs) for positional args.
        """
        if model is not self.model:
            raise ArgumentError(
                f"run_pw_graph: expected the model this manager was built for "
                f"({type(self.model).__name__}), got another {type(model).__name__}; build one "
                f"GraphManager per model"
            )
        return call_with(self._path(), inputs, "run_pw_graph: inputs")

    def capture(self, make_inputs: MakeInputs, sizes=None, progress: bool = True) -> int:
        """Capture every size ahead of time on the chosen path; returns graphs captured.

        Raises CaptureError before running anything when CUDA graphs are off for this
        manager (no CUDA, Config.cudagraphs=False, or a model not on CUDA), as
        `Backend.capture` does.
        """
        check_capture_call("GraphManager.capture", self.model, make_inputs, progress)
        sizes = requested_sizes("GraphManager.capture", sizes, self.config.capture_sizes, bounded=True)
        require_cuda_graphs("GraphManager.capture", self.graphs_enabled, self._graphs_off_because())
        captured = capture_all(self.session, self._path(), make_inputs, sizes, progress)
        require_captured("GraphManager.capture", self.session)
        return captured

    def graph_memory(self) -> int:
        return self.session.graph_memory()

    def clear(self) -> None:
        """Release every graph of both paths and the pool; later calls capture again."""
        self.session.clear()


def _check_model(model: Any) -> None:
    fix = ("wrap it in a torch.nn.Module, or compile it with torch.compile(fn, backend=cgcompile.Backend())"
           if callable(model) else "pass the model to run")
    expect(isinstance(model, torch.nn.Module), "GraphManager: model", "a torch.nn.Module", model, fix)


def _check_boundary(model: torch.nn.Module, boundary: Any) -> None:
    """Refuse a wrong boundary now, not at the first breakable call ("auto" may only warn)."""
    if not (isinstance(boundary, str) and boundary == "auto"):
        resolve_boundary(model, boundary)
