"""Small models the breakable tests share, on the CPU (segments="op_replay") and on CUDA."""

import torch
from torch import nn

import cgcompile


class Flip:
    """Host state an eager break reads: whether it returns a tuple or one tensor."""

    tuple_result = False


@cgcompile.eager_break
def scale_or_pair(x, flip):
    return (x * 2, x) if flip.tuple_result else x * 2


class FlipModel(nn.Module):
    """An eager break whose result structure can change after capture."""

    def __init__(self, flip: Flip, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.flip = flip

    def forward(self, x):
        out = scale_or_pair(self.a(x), self.flip)
        return out[0] if isinstance(out, tuple) else out


class RunningStat(nn.Module):
    """A buffer updated in place inside what becomes a captured segment."""

    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.register_buffer("stat", torch.zeros(width))

    def forward(self, x):
        h = self.a(x)
        self.stat.mul_(0.9).add_(h.mean(0), alpha=0.1)
        h = torch.ops.cgcompile_testing.silly_attention(h, h, h)
        return h * self.stat
