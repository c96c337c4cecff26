"""One Backend per `torch.compile(..., backend="cgcompile")` call, shared by all its graphs.

Dynamo calls a string backend once per graph it captures: the prefill and decode graphs
of a transformers model, each resume after a graph break, each recompilation. No
argument says which `torch.compile` call a graph belongs to, but torch.compile builds
one small object per call (it holds the backend name and `options`) and every graph of
that call reaches the backend through it. That object is the scope here: the first
graph of a call builds a `Backend` from the call's `options`, later graphs of the same
call reuse it, so they share one graph pool, one capture session and one compile cache.

Scope, exactly: one `torch.compile(...)` call (or `module.compile(...)`), whatever it
compiled: a module, a function, with any number of graphs. Two calls never share a
Backend; but where Dynamo finds code it compiled for an equal call (same function,
backend name and options) it runs that code, whose graphs belong to the earlier call's
Backend. The Backend lives as long as that call's object, i.e. as long as
what torch.compile returned. Where the object cannot be found (a torch that calls
backends another way, or the backend function called directly), each graph gets a
Backend of its own, which is safe (separate pools), only larger; that is logged once.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from .compat import torch_compile_call_of, torch_compile_call_on_stack
from .config import Config
from .errors import ArgumentError, expected

log = logging.getLogger(__name__)

# id(per-call object) -> its Backend; an entry leaves with the object (weakref.finalize).
_BACKENDS: dict[int, Any] = {}
_warned_unscoped = False


def backend_for_this_compile(options: dict | None):
    """The Backend of the torch.compile call whose graph is being compiled now."""
    from .backend import Backend  # backend.py imports this module for its entry point

    call = torch_compile_call_on_stack()
    if call is None:
        _warn_unscoped()
        return Backend(Config.from_options(options))
    backend = _BACKENDS.get(id(call))
    if backend is None:
        backend = Backend(Config.from_options(options))
        _BACKENDS[id(call)] = backend
        weakref.finalize(call, _BACKENDS.pop, id(call), None)
    return backend


def backend_of(compiled: Any):
    """The Backend that `torch.compile(model, backend="cgcompile")` built for `compiled`
    (what torch.compile returned, or a module compiled with `module.compile(...)`).

    Raises ArgumentError when `compiled` was not compiled with the string backend or has
    not been called yet (Dynamo compiles on the first call, and the Backend with it).
    """
    backend = _backend_behind(compiled)
    forward = getattr(compiled, "__dict__", {}).get("forward")  # model.forward = torch.compile(model.forward)
    if backend is None and forward is not None:
        backend = _backend_behind(forward)
    if backend is None:
        raise ArgumentError(expected(
            "backend_of", "what torch.compile(..., backend='cgcompile') returned, called at least once",
            compiled, _advice(compiled if forward is None else forward)))
    return backend


def _backend_behind(compiled: Any):
    call = torch_compile_call_of(compiled)
    return _BACKENDS.get(id(call)) if call is not None else None


def _advice(compiled: Any) -> str:
    call = torch_compile_call_of(compiled)
    if call is None:
        return "call it once first; or pass backend=cgcompile.Backend(config) and keep that object"
    if getattr(call, "compiler_name", "cgcompile") != "cgcompile":
        return ("it was compiled with a Backend object: keep that object and use it "
                "(a GraphManager's is GraphManager.backend)")
    return "call it once first (Dynamo compiles at the first call)"


def _warn_unscoped() -> None:
    global _warned_unscoped
    if not _warned_unscoped:
        _warned_unscoped = True
        log.warning("cgcompile: the string backend was called outside torch.compile's per-call "
                    "wrapper; each graph gets its own Backend (own pool and compile cache)")
