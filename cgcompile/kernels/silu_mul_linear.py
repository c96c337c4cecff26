"""`cgcompile::silu_mul_linear`: a gated MLP's down projection of one row, its gating included.

A Llama-style MLP computes `down(silu(gate) * up)`. At one row Inductor runs the gating as
its own small kernel (about 1.3 us on an H200, plus the gap before the next launch) that
writes a vector the down projection reads straight back. This op takes the gate and up
projections themselves: `silu_mul_linear_kernel` makes each step's input as it loads it,
so one launch a layer goes away (`passes.silu_mul_linear` puts the op in Inductor's
post-grad graph, after the skinny linear rewrite).

The kernel computes `silu(gate) * up` as eager does: each op in float32, its result rounded
to the input dtype (Inductor's decomposition of SiLU keeps the same rounding). The op takes any operands: it runs the kernel where
`gated_problem` finds nothing against it and eager's `F.linear(F.silu(gate) * up, ...)`
otherwise, so a graph that calls it is valid at every size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .skinny_linear import cdiv, choose_launch, kernel_problem, launch_arguments, one_row


def gated_problem(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why `silu_mul_linear` runs eager ops for these operands (None: it runs the kernel)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return (f"gate {tuple(gate.shape)} {gate.dtype} on {gate.device} and up {tuple(up.shape)} {up.dtype} on "
                f"{up.device}; the kernel takes two alike")
    return kernel_problem(gate, weight, bias)


def silu_mul_kernel_call(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on operands that `gated_problem` accepts."""
    from .skinny_linear_kernel import silu_mul_linear_kernel

    n, k = weight.shape
    launch = choose_launch(n, k, gated=True)
    y = torch.empty(n, dtype=gate.dtype, device=gate.device)
    silu_mul_linear_kernel[(cdiv(n, launch.block_n),)](
        one_row(gate, k), one_row(up, k), weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, **launch_arguments(launch, k, gate.device))
    return y.view(*gate.shape[:-1], n)


@torch.library.custom_op("cgcompile::silu_mul_linear", mutates_args=())
def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(F.silu(gate) * up, weight, bias)`: by the kernel where `gated_problem` allows,
    else by those eager ops. Inserted into Inductor's post-grad graphs (after autograd), so it
    has no backward."""
    if gated_problem(gate, up, weight, bias) is None:
        return silu_mul_kernel_call(gate, up, weight, bias)
    return F.linear(F.silu(gate) * up, weight, bias)


@silu_mul_linear.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))
