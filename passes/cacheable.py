"""The functions the rewrites put into graphs, named for torch's compile caches.

AOTAutograd's cache serves a graph again only if every function it calls is known to
behave the same for the same inputs; a plain Python function it does not know makes it
skip the cache, so a graph holding one of ours was traced again by every process.
`cacheable_functions` names them, with one salt that torch mixes into the cache key: a
digest of the source of the modules that define them (the functions, the helpers they
call in each other's modules, their constants), so any change there gets new keys.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys

from .attention_mask import additive_attention_mask
from .sdpa import grouped_query_attention
from .small_query import small_query_attention

_FUNCTIONS = (additive_attention_mask, grouped_query_attention, small_query_attention)


@functools.cache
def cacheable_functions() -> dict[str, str]:
    """{"module.name": salt} for every function a rewrite inserts, as torch's
    `_inductor.config.unsafe_marked_cacheable_functions` takes them."""
    digest = hashlib.sha256()
    for name in sorted({f.__module__ for f in _FUNCTIONS}):
        digest.update(_source(sys.modules[name]))
    salt = digest.hexdigest()[:16]
    return {f"{f.__module__}.{f.__name__}": salt for f in _FUNCTIONS}


def _source(module) -> bytes:
    try:
        return inspect.getsource(module).encode()
    except OSError:  # no source shipped: its functions' bytecode and constants stand for it
        codes = [f.__code__ for f in vars(module).values() if inspect.isfunction(f)]
        return b"".join(c.co_code + repr(c.co_consts).encode() for c in codes)
