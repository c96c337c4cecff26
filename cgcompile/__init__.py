"""cgcompile: piecewise CUDA graphs for any PyTorch model.

    torch.compile(model, backend="cgcompile")                      # registered entry point
    torch.compile(model, backend=cgcompile.Backend(cgcompile.Config(...)))
"""

from .backend import Backend
from .config import Config
from .errors import CaptureError, CGCompileError, ConfigError
from .piece import BackendStats, Piece

__all__ = [
    "Backend",
    "BackendStats",
    "CaptureError",
    "CGCompileError",
    "Config",
    "ConfigError",
    "Piece",
]
