"""The one exception family for what a user of cgcompile can get wrong, and how it is worded.

Every check of user input goes through `expect` (or raises one of these classes with a
message from `expected`), so every message reads the same way:

    <culprit>: expected <what is allowed>, got <what was given>; <what to do>

The culprit is the field, argument, environment variable or piece at fault.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable

import torch


class CGCompileError(Exception):
    """Base class: the message says what was expected, what was found and what to do."""


class ConfigError(CGCompileError, ValueError):
    """A `Config` field, a `torch.compile(..., options=...)` key or an environment variable is invalid."""


class ArgumentError(CGCompileError, ValueError):
    """An argument to a cgcompile function or method has the wrong type or value."""


class StateError(CGCompileError, RuntimeError):
    """A call made before what it needs, or twice where once is allowed: `plan_memory`
    before the model ran, `uninstall` before `install`, a second manager installed on a model."""


class CaptureError(CGCompileError, RuntimeError):
    """A CUDA graph could not be captured or replayed (names the piece or size), or cannot
    be captured here at all (no CUDA, or CUDA graphs turned off)."""


class DistributedError(CGCompileError, RuntimeError):
    """A process group, a rank's call or a tensor crossing between ranks is not what the
    other ranks expect; the message names the rank (and the tensor)."""


def expected(culprit: str, wanted: str, got: Any, fix: str = "", *, raw: bool = False) -> str:
    """The message "culprit: expected wanted, got <got>; fix" (`raw`: got is already text)."""
    text = f"{culprit}: expected {wanted}, got {got if raw else describe(got)}"
    return f"{text}; {fix}" if fix else text


def expect(ok: bool, culprit: str, wanted: str, got: Any, fix: str = "",
           error: type[CGCompileError] = ArgumentError, *, raw: bool = False) -> None:
    """Raise `error` with the message of `expected` unless `ok`."""
    if not ok:
        raise error(expected(culprit, wanted, got, fix, raw=raw))


def describe(value: Any, limit: int = 80) -> str:
    """A short description: the repr of a plain value with its type (5 vs '5'), else the kind."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float, str, bytes, tuple, list, dict, set, frozenset)):
        text = repr(value)
        text = text if len(text) <= limit else text[: limit - 3] + "..."
        return f"{text} ({type(value).__name__})"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} on {value.device}"
    if inspect.isroutine(value):
        return f"the function {getattr(value, '__qualname__', value)}"
    return f"a {type(value).__name__} object"


def closest(name: str, choices: Iterable[str]) -> str:
    """The hint "did you mean 'x'?" for the choice nearest `name`; empty when none is near."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"did you mean {match[0]!r}?" if match else ""
