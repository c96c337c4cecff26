"""`cgcompile::grouped_skinny_linear`: up to four one-row linears of the same input in one launch.

A decoder projects one hidden state with separate q, k and v linears, and separate gate and
up linears. At one row each is a small launch (k and v of 256 to 1024 features took 2 to 5
us, most of it the kernel's ramp), and a tensor-parallel model's weights are shards that
cannot be concatenated. This op runs the linears side by side in one grid without copying
the weights: `grouped_skinny_linear_kernel` gives each member its own blocks of output
features and runs `skinny_linear`'s loop on that member's weight.

The op returns the members' outputs side by side, [*, N_0 + ... + N_n], so the graph takes
each member's columns with a slice (of one row: contiguous). As `skinny_linear`, it takes
any operands: it runs the kernel where `group_problem` finds nothing against it and
`F.linear` per member otherwise, so a graph that calls it is valid at every size.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..errors import expect
from .skinny_linear import (Launch, cdiv, choose_launch, kernel_problem, launch_arguments, one_row,
                           short_steps_launch)

MAX_MEMBERS = 4  # the kernel's weight arguments: q/k/v take 3, gate/up 2


def group_problem(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> str | None:
    """Why `grouped_skinny_linear` runs `F.linear` per member (None: it runs the kernel)."""
    if not 1 <= len(weights) <= MAX_MEMBERS:
        return f"{len(weights)} weights; the kernel takes 1 to {MAX_MEMBERS}"
    for i, (weight, bias) in enumerate(zip(weights, biases or [None] * len(weights))):
        why = kernel_problem(x, weight, bias)
        if why is not None:
            return f"member {i}: {why}"
    return None


def grouped_launch(features: Sequence[int], k: int) -> Launch:
    """One launch for the whole group, its blocks sized as for the largest member alone. Sized
    for all the members' features as one weight, two 3584 x 4096 siblings (gate/up of a TP=4
    8B rank) got blocks twice as tall and ran 22.0 us against 19.3 us for two separate
    launches (H200, `benchmarks/skinny_sweep.py --groups`); q/k/v groups get the same blocks either way.
    Under 4096 features the short steps stay: the long steps a lone product takes there were
    slower at 3 of 4 q/k/v groups measured (`benchmarks/launch_rules.py --part groups`)."""
    widest = max(features)
    return short_steps_launch(widest, k) if widest < 4096 else choose_launch(widest, k)


def grouped_kernel_call(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] = (),
                        launch: Launch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on operands that `group_problem` accepts; `launch` overrides the choice, and
    `out` ([N_0 + ... + N_n], contiguous) is where it writes (a new tensor when None)."""
    from .skinny_linear_kernel import grouped_skinny_linear_kernel

    k = x.shape[-1]
    features = [w.shape[0] for w in weights]
    launch = launch or grouped_launch(features, k)
    y = torch.empty(sum(features), dtype=x.dtype, device=x.device) if out is None else out  # [N_0 + ... + N_n]
    unused = MAX_MEMBERS - len(weights)  # members of no features, never picked
    w = [*weights, *[weights[0]] * unused]
    b = [*biases, *[biases[0]] * unused] if biases else w
    grid = (sum(cdiv(n, launch.block_n) for n in features),)
    grouped_skinny_linear_kernel[grid](
        one_row(x, k), *w, *b, y, *features, *[0] * unused, *[t.stride(0) for t in w], k,
        HAS_BIAS=bool(biases), **launch_arguments(launch, k, x.device))
    return y.view(*x.shape[:-1], len(y))


@torch.library.custom_op("cgcompile::grouped_skinny_linear", mutates_args=())
def grouped_skinny_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`, biases empty or
    one per weight: by the kernel where `group_problem` allows, else by F.linear per member.
    Inserted into Inductor's post-grad graphs (after autograd), so it has no backward."""
    _check_members(weights, biases)
    if group_problem(x, weights, biases) is None:
        return grouped_kernel_call(x, weights, biases)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases or [None] * len(weights))], dim=-1)


@grouped_skinny_linear.register_fake
def _(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    _check_members(weights, biases)
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _check_members(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> None:
    expect(len(weights) > 0, "grouped_skinny_linear: weights", "at least one weight", list(weights))
    expect(not biases or len(biases) == len(weights), "grouped_skinny_linear: biases",
           f"none or one per weight ({len(weights)})", f"{len(biases)} biases", raw=True)
