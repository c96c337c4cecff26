"""Small models for tests, examples and benchmarks: exact, fast, and with known structure.

`silly_attention` is a custom op that stands in for attention: it is split like
attention (through `Config.splitting_ops` or `SILLY_OP`) and its result is exact.
Three more split ops give the fuzzer (`cgcompile.fuzz`) the other shapes a split op's
interface takes: a tuple (`silly_pair`, which also mixes rows as attention does), an
argument written in place (`silly_accumulate`) and a transposed, non-contiguous result
(`silly_transposed`). `FUZZ_SPLIT_OPS` lists all four.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SILLY_OP = "cgcompile_testing::silly_attention"


@torch.library.custom_op(SILLY_OP, mutates_args=())
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q + k * v


@silly_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


PAIR_OP = "cgcompile_testing::silly_pair"
ACCUMULATE_OP = "cgcompile_testing::silly_accumulate"
TRANSPOSED_OP = "cgcompile_testing::silly_transposed"
FUZZ_SPLIT_OPS = (SILLY_OP, PAIR_OP, ACCUMULATE_OP, TRANSPOSED_OP)


@torch.library.custom_op(PAIR_OP, mutates_args=())
def silly_pair(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * k, k minus its mean over rows): the second result mixes rows, as attention does."""
    return q * k, k - k.mean(0, keepdim=True)


@silly_pair.register_fake
def _(q, k):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op(ACCUMULATE_OP, mutates_args=("acc",))
def silly_accumulate(acc: torch.Tensor, x: torch.Tensor) -> None:
    """acc += sin(x), in place: a split op that writes into its argument."""
    acc.add_(x.sin())


@silly_accumulate.register_fake
def _(acc, x):
    return None


@torch.library.custom_op(TRANSPOSED_OP, mutates_args=())
def silly_transposed(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) for x: [n, d], returned with strides (1, n): a fresh tensor, not contiguous."""
    out = x.new_empty(x.shape[1], x.shape[0]).t()  # [n, d], column-major
    return out.copy_(x.tanh())


@silly_transposed.register_fake
def _(x):
    return x.new_empty(x.shape[1], x.shape[0]).t()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ToyLayer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):  # x: [T, H]
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.o_proj(torch.ops.cgcompile_testing.silly_attention(q, k, v))
        return x + self.down(torch.nn.functional.silu(self.up(self.mlp_norm(x))))


class ToyLlama(nn.Module):
    """Token ids [T] -> logits [T, vocab]; N layers give 2N+1 pieces, N+1 capturable."""

    def __init__(self, n_layers: int = 2, hidden: int = 32, vocab: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden) for _ in range(n_layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # ids: [T]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


HOST_SCALE_OP = "cgcompile_testing::host_scale"


@torch.library.custom_op(HOST_SCALE_OP, mutates_args=())
def host_scale(x: torch.Tensor, k: int) -> torch.Tensor:
    """x * k for a host int k: a split op whose result depends on a host value, as an
    attention kernel's sequence lengths do. Dynamo passes k as a symbol once it varies."""
    return x * k


@host_scale.register_fake
def _(x, k):
    return torch.empty_like(x)


class StaticCacheDecoder(nn.Module):
    """A decoder over a static KV cache, every host-side value on the device.

    forward(ids [T], pos [T] int64) -> logits [T, vocab]: token t is written into the
    cache at position pos[t] and attends to every position <= pos[t]. The cache is a
    buffer (a static address) and the positions a device tensor, so a call reads nothing
    on the host: the case a full CUDA graph of the whole step replays correctly (with
    `Config(capturable_split_ops=("attention",))`). Prefill is T > 1, decode T = 1.
    """

    def __init__(self, n_layers: int = 2, hidden: int = 32, heads: int = 4, vocab: int = 64, max_len: int = 96):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden) for _ in range(n_layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for i in range(n_layers):
            self.register_buffer(f"k_cache{i}", torch.zeros(heads, max_len, self.head_dim), persistent=False)
            self.register_buffer(f"v_cache{i}", torch.zeros(heads, max_len, self.head_dim), persistent=False)

    def attention(self, i: int, q, k, v, pos):  # q, k, v: [T, hidden], pos: [T]
        t, h, d = q.shape[0], self.heads, self.head_dim
        k_cache, v_cache = getattr(self, f"k_cache{i}"), getattr(self, f"v_cache{i}")  # [H, L, D]
        k_cache.index_copy_(1, pos, k.view(t, h, d).transpose(0, 1))
        v_cache.index_copy_(1, pos, v.view(t, h, d).transpose(0, 1))
        mask = torch.arange(k_cache.shape[1], device=pos.device) <= pos.view(t, 1)  # [T, L]
        out = F.scaled_dot_product_attention(q.view(t, h, d).transpose(0, 1), k_cache, v_cache, attn_mask=mask)
        return out.transpose(0, 1).reshape(t, h * d)  # [T, hidden]

    def forward(self, ids, pos):
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.norm(x)).chunk(3, dim=-1)
            x = x + layer.o_proj(self.attention(i, q, k, v, pos))
            x = x + layer.down(F.silu(layer.up(layer.mlp_norm(x))))
        return self.lm_head(self.norm(x))
