"""`cgcompile::skinny_linear`: `F.linear` of one row (a batch-1 decode step), at the weight's read speed.

At one row a linear reads its whole weight to make one output per feature, so its time is
the weight's bytes over the share of the memory bandwidth its kernel reaches. With the
launch `choose_launch` picks, `skinny_linear_kernel` was faster than cuBLAS's kernels at
every decoder shape measured on an H200, from 256 to 28672 output features
(`benchmarks/skinny_sweep.py`: every launch configuration per shape, against cuBLAS; the
tables are in benchmarks/RESULTS.md). At 4 or 8 rows cuBLAS's tensor-core kernels beat
this kernel's best form (which multiplied the rows on the tensor cores): so the op takes
one row, and at most `MAX_FEATURES` output features (`kernel_problem`).

The op takes any operands: it runs the kernel where `kernel_problem` finds nothing against
it and `F.linear` otherwise, so a graph that calls it is valid at every size.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from ..passes.matvec_reduction import HALF_DTYPES

MAX_FEATURES = 131072  # output features: vocabulary heads of up to 128256 included (benchmarks/skinny_sweep.py)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch configuration of the kernel."""

    block_n: int  # output features per program
    block_k: int  # input features per step of the loop
    num_warps: int = 4
    num_stages: int = 3


def choose_launch(n: int, k: int, gated: bool = False) -> Launch:
    """The launch for a [k] x [n, k]^T product (`gated`: the SiLU-gated kernel's, which makes
    its input from two vectors as it loads them), from sweeps on an H200.

    From 4096 features up, taller blocks over shorter steps along K (`benchmarks/skinny_sweep.py --wide`)
    read faster: a program then keeps several steps' loads in flight even where K is short,
    and the grid stays a few hundred to a few thousand programs. Each band's launch came
    within 4% of the best of 56 launches at every shape measured in it (4096 to 28672
    features, K of 1024 to 14336), and read faster than cuBLAS at all of them (1.02x to 1.43x).

    Under 4096 features, where K is 2048 or more, each step loads 64 weight elements a thread
    (`benchmarks/launch_rules.py`): 4 features over 2048 inputs with 4 warps, as fast as the
    short-step launch below or faster at all 11 plain shapes measured (256 to 3072 features,
    K of 2048 to 8192; up to 1.22x). The gated kernel takes 8 features with 8 warps, so that
    the gating each program recomputes for its steps is spread over twice the rows: 1.15x to
    1.53x at its 6 shapes of up to 2048 features; past 2048 (3072 x 8192) the short steps
    were faster, and stay.

    Elsewhere: n / 512 features a program (a power of 2, 1 to 8) in steps of 1024 along K
    came within 6% of the best of 48 launches at every shape `benchmarks/skinny_sweep.py`
    measured before the kernels took dependent launch, and within 13% of the best of
    `benchmarks/launch_rules.py`'s launches at the 4 shapes there that keep it.
    """
    if n >= 12288:
        launch = Launch(block_n=32, block_k=256, num_warps=4)
    elif n >= 6144:
        launch = Launch(block_n=16, block_k=512, num_warps=4)
    elif n >= 4096:
        launch = Launch(block_n=8, block_k=512, num_warps=8)
    elif k >= 2048 and gated and n <= 2048:
        launch = Launch(block_n=8, block_k=2048, num_warps=8)
    elif k >= 2048 and not gated:
        launch = Launch(block_n=4, block_k=2048, num_warps=4)
    else:
        return short_steps_launch(n, k)
    return no_step_past(launch, k)


def short_steps_launch(n: int, k: int) -> Launch:
    """n / 512 features a program (a power of 2, 1 to 8) in steps of 1024 inputs."""
    block_n = 1
    while block_n < 8 and block_n * 2 * 512 <= n:
        block_n *= 2
    return no_step_past(Launch(block_n=block_n, block_k=1024), k)


def no_step_past(launch: Launch, k: int) -> Launch:
    """`launch` with its steps along K no longer than K's next power of 2."""
    return dataclasses.replace(launch, block_k=min(launch.block_k, next_power_of_2(k)))


def kernel_problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why `skinny_linear` runs `F.linear` for these operands (None: it runs the kernel)."""
    rows = math.prod(x.shape[:-1])
    if x.device.type != "cuda":
        return f"the input is on {x.device.type}, the kernel runs on CUDA"
    if x.dtype not in HALF_DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"dtypes {x.dtype}/{weight.dtype}; the kernel takes bf16 or fp16, all operands alike"
    if rows != 1:
        return f"{rows} rows; the kernel takes one"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        return f"an input of {x.shape[-1]} features and a weight of shape {tuple(weight.shape)}"
    if weight.shape[0] > MAX_FEATURES:
        return f"a weight of shape {tuple(weight.shape)}; the kernel takes up to {MAX_FEATURES} output features"
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        return "the operands are on different devices"
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"a bias of shape {tuple(bias.shape)}; the kernel takes one of [{weight.shape[0]}]"
    if weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        return "the weight does not have unit stride along its input features"
    if not triton_available():
        return "triton cannot be imported"
    return None


def skinny_linear_kernel_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                              launch: Launch | None = None) -> torch.Tensor:
    """The kernel on operands that `kernel_problem` accepts; `launch` overrides the choice."""
    from .skinny_linear_kernel import skinny_linear_kernel

    n, k = weight.shape
    launch = launch or choose_launch(n, k)
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    skinny_linear_kernel[(cdiv(n, launch.block_n),)](
        one_row(x, k), weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, **launch_arguments(launch, k, x.device))
    return y.view(*x.shape[:-1], n)


def one_row(x: torch.Tensor, k: int) -> torch.Tensor:
    """x's one row as a [k] vector of unit stride, as the kernels read it."""
    row = x.reshape(k)
    return row if row.stride(0) == 1 else row.contiguous()


def launch_arguments(launch: Launch, k: int, device: torch.device) -> dict:
    """The kernels' block sizes, their other constexprs but HAS_BIAS, and the launch options."""
    pdl = dependent_launch(device)
    return dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN_K=k % launch.block_k == 0, PDL=pdl,
                num_warps=launch.num_warps, num_stages=launch.num_stages, **({"launch_pdl": True} if pdl else {}))


@torch.library.custom_op("cgcompile::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: by the kernel where `kernel_problem` allows, else by F.linear.
    Inserted into Inductor's post-grad graphs (after autograd), so it has no backward."""
    if kernel_problem(x, weight, bias) is None:
        return skinny_linear_kernel_call(x, weight, bias)
    return F.linear(x, weight, bias)


@skinny_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def dependent_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later): the kernel's launch overlaps the tail
    of the kernel before it. Without it an 8B step ran 1.2 us more per skinny kernel between
    kernels than with cuBLAS's, whose kernels took longer (benchmarks/RESULTS.md)."""
    return device.type == "cuda" and _capability(device.index)[0] >= 9


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
