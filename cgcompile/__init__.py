"""cgcompile: piecewise CUDA graphs for any PyTorch model.

    torch.compile(model, backend="cgcompile")                      # registered entry point
    torch.compile(model, backend=cgcompile.Backend(cgcompile.Config(...)))
"""

import importlib.util

if importlib.util.find_spec(f"{__name__}.passes") is None:  # pyproject's package-dir maps passes/ here
    raise ImportError(
        "cgcompile: expected cgcompile.passes to be installed with the package, got a source folder "
        f"without it ({__path__[0]}); from a checkout, install it editable (pip install -e .), or run "
        "from another folder so that the installed package is imported"
    )

from .backend import Backend, CaptureMemoryProfile, backend_of
from .breakable import BreakableRunner, eager_break
from .run.capture import GraphPool
from .config import Compile, Config, Debug, FullGraphOptions, Graphs, Manager, Rewrites, Sizes, Split
from .errors import ArgumentError, CaptureError, CGCompileError, ConfigError, DistributedError, StateError
from .manager import GraphManager
from .tools.memory_plan import MemoryPlan, SizePlan
from .stats import BackendStats, Piece

__all__ = [
    "ArgumentError",
    "backend_of",
    "Backend",
    "BackendStats",
    "BreakableRunner",
    "CaptureMemoryProfile",
    "CaptureError",
    "CGCompileError",
    "Compile",
    "Config",
    "Debug",
    "FullGraphOptions",
    "Graphs",
    "Manager",
    "Rewrites",
    "Sizes",
    "Split",
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
