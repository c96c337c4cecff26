"""The decode model of the benchmarks and the parallel examples: a Llama-like decoder with
random weights and three ways to run its attention, so every variant of
`benchmarks/decode_bench.py` times the same weights and cache (its sharded forms are in
`parallel_model`).

    HostLengthDecoder   forward(ids, start): attention is the custom op
                        `cgbench::decode_attention`, which takes the cache length as a host int
    StaticMaskDecoder   forward(ids, pos): the same step with a device position and a mask,
                        every shape static (the full-graph baseline)
    HostStateDecoder    forward(ids): the cache length is read at call time from a
                        DecodeState the caller sets before each step (vLLM's "forward
                        context"), so breakable CUDA graphs can replay attention eagerly
                        with the new length; the attention function is given by the caller
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Layer shapes of the decode model, and the cache it holds: [max_batch, kv_heads, max_len, head_dim]."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000
    max_batch: int = 64
    max_len: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODEL_CONFIGS = {
    "1b": ModelConfig(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=8192),
    # Llama-3-8B's layer shapes with a 32000-token vocabulary: 7.2B parameters, 14.5 GB in bf16.
    "8b": ModelConfig(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "small": ModelConfig(hidden=512, layers=16, heads=8, kv_heads=4, intermediate=1536),
    "tiny": ModelConfig(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # x: [T, hidden]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    """Projections, MLP and KV cache of one layer; attention is left to the caller.

    The layer stops before attention and resumes after it, so the decoders below run the
    same weights with different attention code.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        qkv_out = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, qkv_out, bias=False)  # fused q, k, v
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)  # fused gate, up
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)
        cache_shape = (cfg.max_batch, cfg.kv_heads, cfg.max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)

    def qkv_heads(self, x):  # x: [T, hidden] -> q: [T, H, D], k, v: [T, KV, D]
        c = self.cfg
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1
        )
        t = x.shape[0]
        return q.view(t, c.heads, c.head_dim), k.view(t, c.kv_heads, c.head_dim), v.view(t, c.kv_heads, c.head_dim)

    def finish(self, x, attn):  # x: [T, hidden], attn: [T, H, D] -> [T, hidden]
        x = x + self.o_proj(attn.reshape(x.shape[0], -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """Weights and KV caches; the decoders below share one instance.

    No rotary embedding: it would need the position inside the capturable pieces, which the
    host-length model only has as a host int. Leaving it out keeps all decoders identical.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def logits(self, x):  # x: [T, hidden] -> [T, vocab]
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def fill_caches(self, length: int, seed: int = 0) -> None:
        """Random keys and values at positions < length, zeros after (deterministic)."""
        gen = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for layer in self.layers:
            for cache in (layer.k_cache, layer.v_cache):
                cache.zero_()
                cache[:, :, :length].normal_(generator=gen)


def grouped_attention(q, k, v, mask=None):
    """One query token per sequence attending over S cached positions, with GQA.

    q: [B, H, D], k/v: [B, KV, S, D], mask: [1, 1, 1, S] bool or None -> [B, H, D].
    The H // KV query heads that share a kv head become that head's "query positions",
    so no kv head is repeated. Query head h uses kv head h // (H // KV).
    """
    b, h, d = q.shape
    kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, attn_mask=mask)
    return out.reshape(b, h, d)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
) -> torch.Tensor:
    """Write k, v at position `start`, attend over positions 0..start (host-side length).

    q: [B, H, D], k/v: [B, KV, D], caches: [B_max, KV, L, D] -> [B, H, D].
    """
    b = q.shape[0]
    k_cache[:b, :, start] = k
    v_cache[:b, :, start] = v
    return grouped_attention(q, k_cache[:b, :, : start + 1], v_cache[:b, :, : start + 1])


SPLIT_OP = "cgbench::decode_attention"


def _decode_attention_fake(q, k, v, k_cache, v_cache, start):
    return q.new_empty(q.shape)


# Registered the way serving engines register attention: a schema and a plain kernel per
# backend. torch.library.custom_op would add Python autograd, version-counter and aliasing
# checks around every call, about 50 us of host time per call on the GPU machine (measured
# with benchmarks/profile_step.py), which would then dominate every variant's decode step.
# `SymInt start`, not `int start`: Dynamo must pass the traced length through as a symbol;
# an `int` in the schema makes it specialise (and recompile) on every new length.
_LIB = torch.library.Library("cgbench", "FRAGMENT")
_LIB.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, SymInt start) -> Tensor"
)
for _backend in ("CPU", "CUDA"):
    _LIB.impl("decode_attention", decode_attention, _backend)
torch.library.register_fake(SPLIT_OP, _decode_attention_fake, lib=_LIB)


def use_length_independent_attention_kernels() -> None:
    """Turn off the cuDNN backend of scaled_dot_product_attention, for every variant.

    A decode step attends over a cache one position longer than the step before. On the
    GPU machine (H200, torch 2.11) SDPA picks cuDNN for this shape and builds a new cuDNN
    plan for every new length: 45 ms per eager step instead of 5.8 ms with flash attention
    (measured with benchmarks/profile_step.py). Serving engines call length-independent
    kernels (flash attention with variable lengths); so does this benchmark.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


def static_attention(q, k, v, k_cache, v_cache, pos):
    """The same step with every shape static: pos is a [1] device tensor.

    The write is an index_put_ at a device position and attention runs over the whole
    cache with a mask built on the device, so the step never reads the length on the host.
    The write indexes the whole cache rather than a slice `cache[:B]`: functionalization
    turns a write into a slice of a buffer into a copy of the whole slice, which Inductor
    keeps (a [B, KV, L, D] copy per layer); a write into the buffer itself is done in place.
    """
    b = q.shape[0]
    rows = torch.arange(b, device=pos.device)  # [B]
    k_cache[rows, :, pos] = k  # rows and pos broadcast to [B]: writes k [B, KV, D]
    v_cache[rows, :, pos] = v
    mask = (torch.arange(k_cache.shape[2], device=pos.device) <= pos).view(1, 1, 1, -1)  # [1, 1, 1, L]
    return grouped_attention(q, k_cache[:b], v_cache[:b], mask)


class HostLengthDecoder(nn.Module):
    """ids: [B], start: host int (cache length) -> logits [B, vocab]."""

    def __init__(self, llama: Llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids, start: int):
        x = self.llama.embed(ids)
        for layer in self.llama.layers:
            q, k, v = layer.qkv_heads(x)
            attn = torch.ops.cgbench.decode_attention(q, k, v, layer.k_cache, layer.v_cache, start)
            x = layer.finish(x, attn)
        return self.llama.logits(x)


class StaticMaskDecoder(nn.Module):
    """ids: [B], pos: [1] int64 device tensor (cache length) -> logits [B, vocab]."""

    def __init__(self, llama: Llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids, pos):
        x = self.llama.embed(ids)
        for layer in self.llama.layers:
            q, k, v = layer.qkv_heads(x)
            x = layer.finish(x, static_attention(q, k, v, layer.k_cache, layer.v_cache, pos))
        return self.llama.logits(x)


@dataclasses.dataclass
class DecodeState:
    """Host-side state of the step in progress; the caller sets it before every step.

    Breakable CUDA graphs replay an eager step with the arguments it was captured with,
    so a length passed as an int would be frozen at capture; an object read at call time
    is not.
    """

    start: int = 0  # cache length: the step writes at this position, attends over 0..start


# (q [B, H, D], k/v [B, KV, D], k_cache/v_cache [B_max, KV, L, D], state) -> [B, H, D]
StateAttention = Callable[..., torch.Tensor]


def state_attention(q, k, v, k_cache, v_cache, state: DecodeState):
    """decode_attention at the length the state holds now, not at capture."""
    return torch.ops.cgbench.decode_attention(q, k, v, k_cache, v_cache, state.start)


class HostStateDecoder(nn.Module):
    """ids: [B] -> logits [B, vocab], at the cache length `state.start`.

    `attention` is `state_attention` wrapped for the graph runner in use (an eager break);
    it must take (q, k, v, k_cache, v_cache, state) and return [B, H, D].
    """

    def __init__(self, llama: Llama, state: DecodeState, attention: StateAttention = state_attention):
        super().__init__()
        self.llama = llama
        self.state = state
        self.attention = attention

    def forward(self, ids):
        x = self.llama.embed(ids)
        for layer in self.llama.layers:
            q, k, v = layer.qkv_heads(x)
            x = layer.finish(x, self.attention(q, k, v, layer.k_cache, layer.v_cache, self.state))
        return self.llama.logits(x)
