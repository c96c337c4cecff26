"""cgcompile: piecewise CUDA graphs for any PyTorch model.

    torch.compile(model, backend="cgcompile")                      # registered entry point
    torch.compile(model, backend=cgcompile.Backend(cgcompile.Config(...)))
"""

import importlib.util
import os
import sys


def _load_passes_beside_the_package() -> None:
    """Import the checkout's top-level `passes/` as `cgcompile.passes` when run from a checkout.

    `passes/` sits beside this folder in the repository and becomes `cgcompile.passes` only
    when installed: a wheel copies it inside the package (pyproject's package-dir), an
    editable install maps it with a finder. Python started in the repository root imports
    this source folder first (the current directory leads sys.path), shadowing any
    installed copy; after a regular `pip install .` nothing then maps `passes/` into it.
    So where the package folder has no `passes/` but its parent has one, load that one
    under the same name (the same files an editable install maps). Nothing else of the
    parent folder becomes part of the package, unlike an extended `__path__`.
    """
    name = f"{__name__}.passes"
    here = os.path.dirname(os.path.abspath(__file__))
    sibling = os.path.join(os.path.dirname(here), "passes")
    if name in sys.modules or os.path.isdir(os.path.join(here, "passes")):
        return
    if not os.path.isfile(os.path.join(sibling, "__init__.py")):
        return  # an installed package always has passes/ inside; nothing to do here
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(sibling, "__init__.py"), submodule_search_locations=[sibling]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # what the import system does for a package it finds itself
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    globals()["passes"] = module  # and the attribute it binds on the parent


_load_passes_beside_the_package()

from .backend import Backend, CaptureMemoryProfile  # noqa: E402  (after the passes are importable)
from .compile_scope import backend_of  # noqa: E402
from .breakable import BreakableRunner, eager_break  # noqa: E402
from .config import Config  # noqa: E402
from .errors import ArgumentError, CaptureError, CGCompileError, ConfigError, DistributedError, StateError  # noqa: E402
from .manager import GraphManager  # noqa: E402
from .memory_plan import MemoryPlan, SizePlan  # noqa: E402
from .piece import BackendStats, Piece  # noqa: E402
from .pool import GraphPool  # noqa: E402

__all__ = [
    "ArgumentError",
    "backend_of",
    "Backend",
    "BackendStats",
    "BreakableRunner",
    "CaptureMemoryProfile",
    "CaptureError",
    "CGCompileError",
    "Config",
    "ConfigError",
    "DistributedError",
    "GraphManager",
    "GraphPool",
    "MemoryPlan",
    "Piece",
    "SizePlan",
    "StateError",
    "eager_break",
]
