"""The one exception family for what a user of cgcompile can get wrong."""


class CGCompileError(Exception):
    """Base class: the message says what was expected, what was found and what to do."""


class ConfigError(CGCompileError, ValueError):
    """A `Config` field or a `torch.compile(..., options=...)` key is invalid."""


class CaptureError(CGCompileError, RuntimeError):
    """A CUDA graph could not be captured or replayed safely (names the piece)."""
