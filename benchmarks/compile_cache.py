"""A cold Inductor cache for each measured variant, so warm-up times are cold compiles."""

from __future__ import annotations

import contextlib


def fresh_compile_cache(warm: bool = False):
    """Inductor's caches (on disk and in memory) start empty inside this scope, unless `warm`.

    Without it, a variant measured after another reuses the Triton kernels the first one
    compiled (a fused RMSNorm is the same kernel in both), and its warm-up looks shorter.
    """
    if warm:
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache  # renamed in torch 2.9
    # Kept on disk after the scope: the compiled code stays in use (hf_bench times it later).
    return fresh(delete=False)
