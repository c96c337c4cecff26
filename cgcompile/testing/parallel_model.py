"""The decode model of `decode_model`, sharded for tensor parallelism and sliced into
pipeline stages; the parallel examples, the tests and `benchmarks/distributed_bench.py` share it.

Every rank builds the whole `Llama` from one seed, then keeps its part, so the shards
of all ranks are the weights of the single-process model that the results are compared with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .decode_model import MODEL_CONFIGS, HostLengthDecoder, Llama, static_attention


# torch 2.13 names funcol's all-gather of one tensor `all_gather_single` and keeps
# `all_gather_tensor` as an alias that warns at every call; torch 2.11 has only the latter.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _rows(weight: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    return weight.chunk(parts, dim=0)[part].clone()


def _cols(weight: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    return weight.chunk(parts, dim=1)[part].clone()


class TensorParallelLayer(nn.Module):
    """One decoder layer, Megatron style: q/k/v and gate/up column-parallel by head and by
    unit, o_proj and down row-parallel, one all-reduce after each row-parallel linear."""

    def __init__(self, layer, part: int, parts: int, group_name: str):
        super().__init__()
        c = layer.cfg
        heads, kv_heads = c.heads // parts, c.kv_heads // parts
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, c.head_dim
        self.group_name = group_name
        q, k, v = layer.qkv.weight.split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim])
        self.qkv = nn.Parameter(torch.cat([_rows(q, part, parts), _rows(k, part, parts), _rows(v, part, parts)]))
        gate, up = layer.gate_up.weight.chunk(2)
        self.gate_up = nn.Parameter(torch.cat([_rows(gate, part, parts), _rows(up, part, parts)]))
        self.o_proj = nn.Parameter(_cols(layer.o_proj.weight, part, parts))
        self.down = nn.Parameter(_cols(layer.down.weight, part, parts))
        self.attn_norm, self.mlp_norm = layer.attn_norm, layer.mlp_norm
        cache = layer.k_cache[:, kv_heads * part: kv_heads * (part + 1)]
        self.register_buffer("k_cache", cache.clone(), persistent=False)
        cache = layer.v_cache[:, kv_heads * part: kv_heads * (part + 1)]
        self.register_buffer("v_cache", cache.clone(), persistent=False)

    def forward(self, x, start, row0: int = 0):
        """x: [T, hidden]; start: host int, or a [1] device position; the T sequences own
        cache rows row0..row0+T (a pipeline stage's micro-batch; host start only)."""
        t, d = x.shape[0], self.head_dim
        q, k, v = F.linear(self.attn_norm(x), self.qkv).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(t, self.heads, d), k.view(t, self.kv_heads, d), v.view(t, self.kv_heads, d)
        if isinstance(start, torch.Tensor):  # every shape static: a full CUDA graph may hold it
            attn = static_attention(q, k, v, self.k_cache, self.v_cache, start)
        else:
            k_cache, v_cache = (self.k_cache, self.v_cache) if row0 == 0 else (self.k_cache[row0:], self.v_cache[row0:])
            attn = torch.ops.cgbench.decode_attention(q, k, v, k_cache, v_cache, start)
        x = x + funcol.all_reduce(F.linear(attn.reshape(t, -1), self.o_proj), "sum", self.group_name)
        gate, up = F.linear(self.mlp_norm(x), self.gate_up).chunk(2, dim=-1)
        return x + funcol.all_reduce(F.linear(F.silu(gate) * up, self.down), "sum", self.group_name)


class VocabParallelHead(nn.Module):
    """The LM head split by vocabulary (Megatron's and vLLM's vocab-parallel head): this rank
    keeps its contiguous 1/parts of the head's rows, computes those logits and all-gathers the
    rest, so a step reads 1/parts of the head instead of all of it on every rank.

    x: [B, hidden] (normed) -> logits [B, vocab], contiguous, the same on every rank.
    The gather's [parts * B, vocab / parts] result mixes the batch into its first dimension,
    which cgcompile's padding-safety pass cannot follow: a graph with a dynamic batch that
    holds this head is captured at exact sizes, not padded."""

    def __init__(self, lm_head: nn.Linear, part: int, parts: int, group_name: str):
        super().__init__()
        vocab = lm_head.weight.shape[0]
        if vocab % parts:
            raise ValueError(f'TensorParallelDecoder: head="vocab": expected a vocabulary divisible by the world '
                             f'size {parts}, got {vocab}; head="replicated" takes any vocabulary')
        self.weight = nn.Parameter(_rows(lm_head.weight, part, parts))  # [vocab / parts, hidden]
        self.group_name = group_name

    def forward(self, x):
        local = F.linear(x, self.weight)  # [B, vocab / parts]
        # Gathered along dim 0 ([parts * B, vocab / parts]), then the ranks' blocks side by side:
        # a copy, or at B = 1 a view, which eager hands back as an AsyncCollectiveTensor not yet
        # waited for; a compiled graph holds the wait itself and returns a plain tensor.
        logits = _all_gather(local, gather_dim=1, group=self.group_name)  # [B, vocab]
        return logits.wait() if isinstance(logits, funcol.AsyncCollectiveTensor) else logits


HEADS = ("vocab", "replicated")


class TensorParallelDecoder(nn.Module):
    """ids: [B], start -> logits [B, vocab]. start is the cache length as a host int (attention
    the custom op, as HostLengthDecoder) or as a [1] device tensor (static attention, as
    StaticMaskDecoder).

    The embedding is replicated: a step reads only its batch's rows of it. head="vocab" splits
    the LM head by vocabulary (`VocabParallelHead`, one all-gather of the logits per step), so
    no rank reads the whole vocab x hidden matrix every step; the vocabulary must divide by
    the world size. head="replicated" keeps the whole head on every rank (any vocabulary)."""

    def __init__(self, llama: Llama, group=None, head: str = "vocab"):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"TensorParallelDecoder: head: expected one of {HEADS}, got {head!r}")
        group = group or dist.group.WORLD
        part, parts = dist.get_rank(group), dist.get_world_size(group)
        self.embed, self.norm = llama.embed, llama.norm
        self.lm_head = llama.lm_head if head == "replicated" else \
            VocabParallelHead(llama.lm_head, part, parts, group.group_name)
        self.layers = nn.ModuleList(TensorParallelLayer(l, part, parts, group.group_name) for l in llama.layers)

    def forward(self, ids, start):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, start)
        return self.lm_head(self.norm(x))


class StageDecoder(nn.Module):
    """Layers `layers` of a Llama; the first stage embeds token ids, the last returns the
    greedy next tokens. forward(x, start, row0): x is ids [B] or hidden [B, hidden]; the
    micro-batch's sequences own cache rows row0..row0+B.

    tp_group: the stage's layers sharded over that group (TensorParallelLayer), for tensor
    parallel inside each pipeline stage; every rank of the group holds the whole embedding
    and head, so each computes the same tokens."""

    def __init__(self, llama: Llama, layers: range, tp_group=None):
        super().__init__()
        self.first, self.last = layers.start == 0, layers.stop == len(llama.layers)
        self.embed = llama.embed if self.first else None
        if tp_group is None:
            self.layers = nn.ModuleList(llama.layers[i] for i in layers)
        else:
            part, parts = dist.get_rank(tp_group), dist.get_world_size(tp_group)
            self.layers = nn.ModuleList(TensorParallelLayer(llama.layers[i], part, parts, tp_group.group_name)
                                        for i in layers)
        self.norm, self.lm_head = (llama.norm, llama.lm_head) if self.last else (None, None)

    def forward(self, x, start: int, row0: int):
        if self.first:
            x = self.embed(x)
        for layer in self.layers:
            if isinstance(layer, TensorParallelLayer):
                x = layer(x, start, row0)
                continue
            q, k, v = layer.qkv_heads(x)
            attn = torch.ops.cgbench.decode_attention(q, k, v, layer.k_cache[row0:], layer.v_cache[row0:], start)
            x = layer.finish(x, attn)
        if self.last:
            return self.lm_head(self.norm(x)).argmax(-1)  # [B] next tokens
        return x


def stage_groups(tp: int, device):
    """(pipeline group, tensor-parallel group or None) of this rank when every pipeline stage
    is `tp` ranks: a (stages, tp) device mesh, so a rank's pipeline group holds the same
    tensor-parallel part of every stage and its tensor-parallel group the ranks of its stage.
    A collective over every rank (each makes every group)."""
    if tp == 1:
        return dist.group.WORLD, None
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"stage_groups: expected a world size divisible by tp={tp}, got {world}")
    mesh = init_device_mesh(torch.device(device).type, (world // tp, tp), mesh_dim_names=("pp", "tp"))
    return mesh["pp"].get_group(), mesh["tp"].get_group()


@torch.no_grad()
def greedy_reference(llama: Llama, ids: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """Single-process eager greedy decoding: [steps, B] tokens."""
    model, out = HostLengthDecoder(llama), []
    for step in range(steps):
        ids = model(ids, start + step).argmax(-1)
        out.append(ids)
    return torch.stack(out)


def seeded_llama(model: str, device, fill: int) -> Llama:
    """The decode model every rank (and the single-process reference) builds alike:
    seeded weights, caches filled to `fill` positions (the "prompt")."""
    torch.manual_seed(0)
    llama = Llama(MODEL_CONFIGS[model]).to(device)
    llama.fill_caches(fill)
    return llama

