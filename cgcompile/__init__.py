"""cgcompile: piecewise CUDA graphs for any PyTorch model.

    torch.compile(model, backend="cgcompile")                      # registered entry point
    torch.compile(model, backend=cgcompile.Backend(cgcompile.Config(...)))
"""

from .backend import Backend, CaptureMemoryProfile
from .breakable import BreakableRunner, eager_break
from .config import Config
from .errors import CaptureError, CGCompileError, ConfigError
from .manager import GraphManager
from .piece import BackendStats, Piece
from .pool import GraphPool

__all__ = [
    "Backend",
    "BackendStats",
    "BreakableRunner",
    "CaptureMemoryProfile",
    "CaptureError",
    "CGCompileError",
    "Config",
    "ConfigError",
    "GraphManager",
    "GraphPool",
    "Piece",
    "eager_break",
]
