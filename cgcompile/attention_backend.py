"""Which SDPA backend the attention that cgcompile runs eagerly may use.

SDPA's cuDNN backend builds an execution plan for every new shape and looks the plan up
on every call. Measured on an H100 (torch 2.11, bf16, 1.1B Llama, eager generate()):
13.4 s of a first 256-token call went to SDPA, ~45-50 ms for each new key length, while
a later call of the same lengths took 3.7 s in all. Attention split out of the graphs
sees a new key length at every decode step, so by default cgcompile runs its eager pieces
with the cuDNN backend switched off (`Config.cudnn_attention=False`); SDPA then picks
among the others, which take any length with no setup. The caller's setting is
restored when the call returns.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def call_without_cudnn_attention(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) with SDPA's cuDNN backend off; the global flag is restored after."""
    if not torch._C._get_cudnn_sdp_enabled():  # already off (by the user, or an outer call)
        return fn(*args, **kwargs)
    torch._C._set_sdp_use_cudnn(False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch._C._set_sdp_use_cudnn(True)
