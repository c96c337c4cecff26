"""The functions the rewrites put into graphs, named for torch's compile caches.

AOTAutograd's cache serves a graph again only if every function it calls is known to
behave the same for the same inputs; a plain Python function it does not know makes it
skip the cache, so a graph holding one of ours was traced again by every process.
`cacheable_functions` names them, each with a digest of its source as the salt that
torch mixes into the cache key: a changed function gets new keys.
"""

from __future__ import annotations

import hashlib
import inspect

from .attention_mask import additive_attention_mask
from .sdpa import grouped_query_attention
from .small_query import small_query_attention

_FUNCTIONS = (additive_attention_mask, grouped_query_attention, small_query_attention)


def cacheable_functions() -> dict[str, str]:
    """{"module.name": salt} for every function a rewrite inserts, as torch's
    `_inductor.config.unsafe_marked_cacheable_functions` takes them."""
    return {f"{f.__module__}.{f.__name__}": _digest(f) for f in _FUNCTIONS}


def _digest(function) -> str:
    try:
        text = inspect.getsource(function).encode()
    except OSError:  # no source shipped: the bytecode and constants stand for it
        code = function.__code__
        text = code.co_code + repr(code.co_consts).encode()
    return hashlib.sha256(text).hexdigest()[:16]
