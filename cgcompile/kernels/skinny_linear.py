"""`cgcompile::skinny_linear`: `F.linear` for inputs of a few rows, at the weight's read speed.

At one to eight rows (a decode step's tokens) a linear reads its whole weight to make a
few outputs per feature, so its time is the weight's bytes over the share of the memory
bandwidth its kernel reaches. cuBLAS picks its kernels for matrix products; at these
sizes they read the weights of a tensor-parallel shard or a 1B decoder at 40-60% of the
copy bandwidth (`benchmarks/gemv_bench.py`). `skinny_linear_kernel` reads each weight
element once, applies every row to it, and sums in float32.

The op takes any input: it runs the kernel where `kernel_problem` finds nothing against
it (CUDA, bf16/fp16, at most `MAX_ROWS` rows, unit stride along the features, Triton
importable) and `F.linear` otherwise, so a compile with a symbolic row count stays valid
for every size, and its backward is `F.linear`'s.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # beyond this cuBLAS's tensor-core kernels read the weight as fast
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch configuration of the kernel."""

    block_n: int  # output features per program
    block_k: int  # input features per step of the loop
    num_warps: int
    num_stages: int
    dot: bool  # rows on the tensor cores (padded to 16) instead of a float32 multiply-add

    def rows(self, m: int) -> int:
        return 16 if self.dot else max(1, 1 << (m - 1).bit_length())


def choose_launch(m: int, n: int, k: int) -> Launch:
    """The launch for an [m, k] x [n, k]^T product (see `benchmarks/gemv_bench.py --sweep`)."""
    block_k = 512 if k % 512 == 0 else 256
    if m == 1:
        return Launch(block_n=4, block_k=block_k, num_warps=4, num_stages=3, dot=False)
    return Launch(block_n=16, block_k=min(block_k, 256), num_warps=4, num_stages=3, dot=True)


def kernel_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why `skinny_linear` runs `F.linear` for these operands (None: it runs the kernel)."""
    rows = math.prod(x.shape[:-1])
    if x.device.type != "cuda":
        return f"the input is on {x.device.type}, the kernel runs on CUDA"
    if x.dtype not in HALF_DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"dtypes {x.dtype}/{weight.dtype}; the kernel takes bf16 or fp16, all operands alike"
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows; the kernel takes 1 to {MAX_ROWS}"
    if weight.dim() != 2 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        return "the weight is not a matrix with unit stride along its input features"
    if not _triton_available():
        return "triton cannot be imported"
    return None


def skinny_linear_kernel_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                              launch: Launch | None = None) -> torch.Tensor:
    """The kernel on operands that `kernel_problem` accepts; `launch` overrides the choice."""
    from .skinny_linear_kernel import skinny_linear_kernel

    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    launch = launch or choose_launch(m, n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton_cdiv(n, launch.block_n),)
    skinny_linear_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        ROWS=launch.rows(m), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, HAS_BIAS=bias is not None,
        EVEN_K=k % launch.block_k == 0, DOT=launch.dot, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return y.view(*x.shape[:-1], n)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_available() -> bool:
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


_TRITON: bool | None = None
