"""Numerics for comparing compiled runs with eager ones."""

import contextlib

import torch


@contextlib.contextmanager
def exact_fp32_matmuls():
    """No TF32 inside the block: eager and CUDA graph replays then run the same fp32 kernels
    and round alike. The previous settings come back afterwards, so no test changes the
    next one's numerics."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
