"""Transformers models of five families, random weights, for hf_bench.py and hf_probe.py.

Each builder takes a layer shape (`cgcompile.testing.decode_model.ModelConfig`: hidden,
layers, heads, kv_heads, intermediate, vocab) and returns the model on the device, in
eval mode, with eos_token_id None (random weights: generate() makes every token asked
for) and pad_token_id 0. No download. What each family adds to a Llama:

    llama       nothing (the scripts' model before families existed)
    qwen2       biases on q, k and v
    mistral     a sliding window on every layer (`window` tokens, 64 by default: shorter
                than a benchmark's prompt + new tokens, so the cache rolls)
    gemma2      soft-capped attention scores and final logits, sliding window on every
                other layer, GeGLU MLP, scaled embeddings; eager attention, since SDPA
                has no soft-capping and would drop it
    qwen3_moe   every MLP a mixture of MOE_EXPERTS experts of width intermediate // 8,
                MOE_TOP_K of them per token (about 1.9B parameters at the 1.1B shape,
                0.4B of them read per token)

Input and output embeddings are untied in every family (Gemma2 ties them by default), so
the weight bytes a step reads are the same parameters in every family.
"""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "qwen3_moe")
SLIDING_WINDOW = 64
TINY_SLIDING_WINDOW = 8  # the tiny smoke runs have 16-token prompts: the cache rolls there too
MOE_EXPERTS = 16
MOE_TOP_K = 2


def _shape_kwargs(shape, max_positions: int) -> dict:
    return dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                max_position_embeddings=max_positions, tie_word_embeddings=False)


def _instantiate(model_class, config, device, dtype: torch.dtype, **kwargs):
    torch.manual_seed(0)  # the same weights for every variant that builds the model
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype, **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_llama(shape, device, dtype: torch.dtype, max_positions: int = 4096, window: int = SLIDING_WINDOW):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _instantiate(LlamaForCausalLM, LlamaConfig(**_shape_kwargs(shape, max_positions)), device, dtype)


def build_qwen2(shape, device, dtype: torch.dtype, max_positions: int = 4096, window: int = SLIDING_WINDOW):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _instantiate(Qwen2ForCausalLM, Qwen2Config(**_shape_kwargs(shape, max_positions)), device, dtype)


def build_mistral(shape, device, dtype: torch.dtype, max_positions: int = 4096, window: int = SLIDING_WINDOW):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_shape_kwargs(shape, max_positions), head_dim=shape.hidden // shape.heads,
                           sliding_window=window)
    return _instantiate(MistralForCausalLM, config, device, dtype)


def build_gemma2(shape, device, dtype: torch.dtype, max_positions: int = 4096, window: int = SLIDING_WINDOW):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    head_dim = shape.hidden // shape.heads
    # Gemma2's own caps (attention 50, logits 30); its layer_types default alternates
    # sliding and full attention.
    config = Gemma2Config(**_shape_kwargs(shape, max_positions), head_dim=head_dim, query_pre_attn_scalar=head_dim,
                          sliding_window=window, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    return _instantiate(Gemma2ForCausalLM, config, device, dtype, attn_implementation="eager")


def build_qwen3_moe(shape, device, dtype: torch.dtype, max_positions: int = 4096, window: int = SLIDING_WINDOW):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # The experts_implementation is transformers' default (grouped_mm where it can
    # dispatch, else eager): what a user of the model gets.
    config = Qwen3MoeConfig(**_shape_kwargs(shape, max_positions), num_experts=MOE_EXPERTS,
                            num_experts_per_tok=MOE_TOP_K, moe_intermediate_size=max(shape.intermediate // 8, 1),
                            norm_topk_prob=True)
    return _instantiate(Qwen3MoeForCausalLM, config, device, dtype)


BUILDERS = {"llama": build_llama, "qwen2": build_qwen2, "mistral": build_mistral, "gemma2": build_gemma2,
            "qwen3_moe": build_qwen3_moe}
assert tuple(BUILDERS) == FAMILIES


def build(family: str, shape, device, dtype: torch.dtype, **kwargs):
    """The `family` model of `shape` (kwargs: max_positions, window), random weights."""
    if family not in BUILDERS:
        raise ValueError(f"expected a family from {FAMILIES}, got {family!r}")
    return BUILDERS[family](shape, device, dtype, **kwargs)


def _active_fraction(name: str, config) -> float:
    """The share of a parameter one token reads: top-k of the experts for an expert weight."""
    experts = getattr(config, "num_experts", None)
    if experts and ".experts." in f".{name}.":
        return config.num_experts_per_tok / experts
    return 1.0


def step_weight_bytes(model) -> int:
    """Weight bytes one token's decode step reads: every parameter but the input embedding
    table (only indexed), and of an MoE's experts only the top-k a token routes to. At a
    batch above 1 the tokens of a step route to different experts, so the step reads more:
    a floor from these bytes is a lower bound there."""
    embed = model.get_input_embeddings().weight
    return int(sum(p.numel() * p.element_size() * _active_fraction(name, model.config)
                   for name, p in model.named_parameters() if p is not embed))


def describe(model) -> dict:
    """What the benchmarks print and record about the model beside its shape."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    info = {"family": config.model_type, "parameters": total, "attention": config._attn_implementation,
            "step_weight_bytes": step_weight_bytes(model)}
    if getattr(config, "sliding_window", None):
        types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
        info.update(sliding_window=config.sliding_window, sliding_layers=types.count("sliding_attention"))
    if getattr(config, "num_experts", None):
        info.update(experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                    expert_width=config.moe_intermediate_size, experts_implementation=config._experts_implementation)
    return info
