"""One object per model that owns the graph pool and runs the chosen CUDA graph path.

`run_pw_graph(model, inputs)` is the one call a model runner makes each step. The path
is decided once, when the manager is built, and logged: compiled pieces (the
`cgcompile` backend) or breakable CUDA graphs (no compilation). With graphs off
(`Config.cudagraphs=False`, or a model not on CUDA) the model runs eagerly. Both paths,
when both are used, capture into the manager's one pool.

`install()` routes the model's own calls (`model(...)`, `model.generate(...)`) through the
chosen path until `uninstall()`: the compiled path compiles `model.forward`; the breakable
path installs its runners (`breakable.path`). For a framework's models the breakable path
comes from its integration (`cgcompile.breakable.integrations`): transformers models get a runner
per decoder layer, with the cache update and attention as eager steps.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch

from .tools.aot_capture import (
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
from .breakable.boundary import resolve_boundary
from .breakable.integrations import integration_for
from .breakable.path import BreakablePath, boundary_path
from .breakable.segments import SEGMENT_KINDS
from .run.capture import CaptureSession
from .config import USE_BREAKABLE_ENV, Config, as_config
from .errors import ArgumentError, StateError, expect, expected

log = logging.getLogger(__name__)

# model -> the GraphManager installed on it: a second install would stack one path on the
# other (and uninstalling them out of order leave the model patched).
_INSTALLED: "weakref.WeakKeyDictionary[torch.nn.Module, GraphManager]" = weakref.WeakKeyDictionary()


class GraphManager:
    """Owns the pool and holds the compiled-piece path or the breakable path.

    use_breakable: the path this manager runs, from `Config.use_breakable` or the
        CGCOMPILE_USE_BREAKABLE environment variable (decided once, here).
    boundary: what the breakable path captures ("auto", a module, a path, or None).
    segments: "cuda_graphs", or "op_replay": the breakable path's bookkeeping on any
        device, each segment re-run op by op at the tensors it was recorded with (what a
        CUDA graph does, without one); for tests, and for checking a model's breaks on a
        CPU. Needs the breakable path.
    """

    def __init__(self, model: torch.nn.Module, config: Config | None = None, *,
                 boundary: Any = "auto", pool: Any = None, segments: str = "cuda_graphs"):
        _check_model(model)
        self.model = model
        self.config = as_config(config, "GraphManager")
        _check_boundary(model, boundary)
        check_pool("GraphManager", pool)
        check_cudagraphs_setting("GraphManager", self.config)
        self.session = CaptureSession.for_config(self.config, pool=pool)
        self.use_breakable = self.config.resolved_use_breakable()
        _check_segments(segments, self.use_breakable, self.config)
        self.segments = segments
        self.graphs_enabled = segments == "op_replay" or self._graphs_enabled()
        self._boundary = boundary
        self._backend: Backend | None = None
        self._compiled = None
        self._breakable: BreakablePath | None = None
        self._installed: Any = None  # what install() put on model.forward (compiled path)
        self.installed = False
        self._install_called = False  # install() ran, even where graphs off made it change nothing
        self._log_path()

    def _log_path(self) -> None:
        """Say once, here, which path runs. A breakable manager on a model off CUDA records
        nothing (no CUDA graphs there), which a newcomer trying the quick start on a CPU
        would otherwise only see as `describe()` saying 0 graphs: that case is a warning."""
        name = type(self.model).__name__
        if self.use_breakable and not self.graphs_enabled and self.config.graphs.cudagraphs is None:
            log.warning("cgcompile: %s runs eagerly: %s, so there are no CUDA graphs and the breakable path "
                        "records nothing (describe() shows 0 graphs); pass GraphManager(..., "
                        "segments=\"op_replay\") to record the breakable path on this device for inspection "
                        "or tests", name, self._graphs_off_because())
            return
        log.info("cgcompile: %s runs %s", name,
                 "eagerly (CUDA graphs off)" if not self.graphs_enabled
                 else "breakable CUDA graphs" if self.use_breakable else "compiled pieces with CUDA graphs")

    def _graphs_enabled(self) -> bool:
        if self.config.graphs.cudagraphs is not None:
            return self.config.graphs.cudagraphs
        return any(p.is_cuda for p in self.model.parameters())

    def _graphs_off_because(self) -> str:
        if self.config.graphs.cudagraphs is False:
            return "Config.cudagraphs=False"
        return f"a {type(self.model).__name__} with no parameter on CUDA (graphs follow the model's device)"

    # -- the two paths, created on first use ---------------------------------------------------

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            # the compiled path, however use_breakable is set (a Backend refuses use_breakable=True)
            self._backend = Backend(dataclasses.replace(self.config, use_breakable=False), session=self.session)
        return self._backend

    @property
    def compiled(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.model, backend=self.backend)
        return self._compiled

    @property
    def breakable(self) -> BreakablePath:
        """The breakable runners and where they sit (built on first use)."""
        if self._breakable is None:
            integration = integration_for(self.model)
            build = integration.breakable_path if integration is not None else boundary_path
            self._breakable = build(self.model, self._boundary, self.config, self.session, self.segments)
        return self._breakable

    def run_breakable(self, *args, **kwargs):
        """Run the whole model with its captured modules replayed from breakable graphs."""
        return self.breakable(*args, **kwargs)

    def _path(self):
        if self.installed or not self.graphs_enabled:
            return self.model
        return self.run_breakable if self.use_breakable else self.compiled

    # -- the model's own calls ---------------------------------------------------------------

    def install(self) -> "GraphManager":
        """Route the model's own calls (`model(...)`, `model.generate(...)`) through the
        chosen path until `uninstall()`; returns the manager. With graphs off it changes
        nothing (the model runs eagerly, as `run_pw_graph` would). Raises StateError when
        another GraphManager is installed on the model."""
        other = _INSTALLED.get(self.model)
        if other is not None and other is not self:
            raise StateError(expected(
                "GraphManager.install", "a model no other GraphManager is installed on",
                f"a {type(self.model).__name__} another manager installed on", "call uninstall() on that "
                "manager first, or run this one with run_pw_graph (one GraphManager per model)", raw=True))
        self._install_called = True
        if self.installed or not self.graphs_enabled:
            return self
        if self.use_breakable:
            self.breakable.install()
        else:
            self._installed = torch.compile(self.model.forward, backend=self.backend)
            self.model.forward = self._installed
        self.installed = True
        _INSTALLED[self.model] = self
        return self

    def uninstall(self) -> None:
        """Undo `install()`: the model's forward methods are what they were before. Raises
        StateError before any `install()`; a second uninstall does nothing."""
        expect(self._install_called, "GraphManager.uninstall", "a manager installed with install()",
               "one never installed", "call install() first (or use `with manager:`)", StateError, raw=True)
        if not self.installed:
            return
        if self.use_breakable:
            self.breakable.uninstall()
        elif self.model.__dict__.get("forward") is self._installed:
            del self.model.forward
        self._installed, self.installed = None, False
        _INSTALLED.pop(self.model, None)

    def __enter__(self) -> "GraphManager":
        """`with manager.install():` (or `with manager:`) uninstalls at the end of the block."""
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

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
        sizes = requested_sizes("GraphManager.capture", sizes, self.config.sizes.capture_sizes, bounded=True)
        require_cuda_graphs("GraphManager.capture", self.graphs_enabled, self._graphs_off_because())
        captured = capture_all(self.session, self._path(), make_inputs, sizes, progress)
        require_captured("GraphManager.capture", self.session)
        return captured

    def graph_memory(self) -> int:
        return self.session.graph_memory()

    def clear(self) -> None:
        """Release every graph of both paths and the pool; later calls capture again."""
        if self.segments == "op_replay":
            if self._breakable is not None:
                self._breakable.clear()
            return
        self.session.clear()


def _check_model(model: Any) -> None:
    fix = ("wrap it in a torch.nn.Module, or compile it with torch.compile(fn, backend=cgcompile.Backend())"
           if callable(model) else "pass the model to run")
    expect(isinstance(model, torch.nn.Module), "GraphManager: model", "a torch.nn.Module", model, fix)


def _check_segments(segments: Any, use_breakable: bool, config: Config) -> None:
    expect(segments in SEGMENT_KINDS, "GraphManager: segments", f"one of {SEGMENT_KINDS}", segments)
    override = config.use_breakable_override()
    # Where the environment chose the compiled path, Config(use_breakable=True) would change nothing.
    choose = (f"unset {USE_BREAKABLE_ENV}={override} (it overrides Config(use_breakable=...)) or set it to 1"
              if override is not None else "set Config(use_breakable=True)")
    expect(use_breakable or segments == "cuda_graphs", "GraphManager: segments",
           "'cuda_graphs' on the compiled path", segments, f"{choose} to replay breakable segments op by op")


def _check_boundary(model: torch.nn.Module, boundary: Any) -> None:
    """Refuse a wrong boundary now, not at the first breakable call ("auto" may only warn)."""
    if not (isinstance(boundary, str) and boundary == "auto"):
        resolve_boundary(model, boundary)
