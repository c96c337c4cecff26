"""Tiny random Hugging Face models for tests, and generate() around them.

`tiny_model` is the one builder (an architecture of `MODELS`, weights from seed 0);
`generate` runs greedy decoding from a fixed left-padded `prompt`; `compile_forward` is
the one-line change a user makes. Imports transformers: tests of passes alone build their
graphs with `cgcompile.testing.fx` and `cgcompile.testing.models` instead.
"""

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    ViTConfig,
    ViTModel,
)

import cgcompile

VOCAB = 128
PROMPT_LEN = 7
_LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)
MODELS = {  # arch -> (layers, **config changes) -> a model with random weights
    "llama": lambda layers, **changes: LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **_LLAMA_LIKE | changes)),
    "qwen2": lambda layers, **changes: Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **_LLAMA_LIKE | changes)),
    # A window shorter than prompt + new tokens, so the sliding-window cache path runs.
    "mistral": lambda layers, **changes: MistralForCausalLM(
        MistralConfig(num_hidden_layers=layers, **_LLAMA_LIKE | dict(sliding_window=5) | changes)
    ),
    "gpt2": lambda layers, **changes: GPT2LMHeadModel(GPT2Config(
        **dict(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
        | changes
    )),
    # q, k, v and fc_in read one input: a parallel block.
    "gptj": lambda layers, **changes: GPTJForCausalLM(GPTJConfig(
        **dict(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, rotary_dim=8, n_positions=64, bos_token_id=1,
               eos_token_id=2) | changes
    )),
    # An encoder of 64x64 images in 8x8 patches.
    "vit": lambda layers, **changes: ViTModel(ViTConfig(
        **dict(image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
               intermediate_size=1024, attn_implementation="sdpa") | changes
    ), add_pooling_layer=False),
}
ARCHS = ("llama", "qwen2", "mistral", "gpt2")  # the decoders the generate() tests run over


def tiny_model(arch: str, layers: int = 2, *, device="cpu", dtype=torch.float32, never_stop: bool = True, **changes):
    """A tiny random model of MODELS[arch] (weights from seed 0), in eval mode, on `device` in `dtype`.

    `changes` override its config's fields. never_stop: generate() runs to max_new_tokens
    (random weights would stop at any eos token) and pads with id 0.
    """
    torch.manual_seed(0)
    model = MODELS[arch](layers, **changes).eval()
    if never_stop and model.can_generate():
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return model.to(device, dtype)


def tiny_llama(**kwargs) -> LlamaForCausalLM:
    """The Llama of the cache tests: SDPA attention, 64 positions, its own generation config."""
    return tiny_model("llama", never_stop=False, max_position_embeddings=64, attn_implementation="sdpa", **kwargs)


def prompt(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, T] and their attention mask, left-padded: row i has i pad tokens."""
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :row] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, batch: int, new_tokens: int, seed: int = 1, **kwargs) -> torch.Tensor:
    """generate() from prompt(batch, seed) on the model's device; greedy unless kwargs say otherwise."""
    ids, mask = (t.to(model.device) for t in prompt(batch, seed))
    kwargs.setdefault("do_sample", False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **kwargs)
    sequences = getattr(out, "sequences", out)  # a GenerateOutput with return_dict_in_generate=True
    assert sequences.shape == (batch, PROMPT_LEN + new_tokens)
    return out


def compile_forward(model, **config) -> cgcompile.Backend:
    """The one-line change: compile `model.forward`, the function `generate()` calls."""
    config.setdefault("compiler", "eager")
    backend = cgcompile.Backend(cgcompile.Config(**config))
    model.forward = torch.compile(model.forward, backend=backend)
    return backend


def compile_and_match_eager(model, batch: int, new_tokens: int = 16, **config) -> cgcompile.Backend:
    """Greedy tokens after compile_forward(model, **config) equal the eager model's; returns the backend."""
    expected = generate(model, batch, new_tokens)
    backend = compile_forward(model, **config)
    assert torch.equal(generate(model, batch, new_tokens), expected)
    return backend


FIXED_NEW_TOKENS = 8


def fixed_length_generate(model, batch: int, **kwargs) -> torch.Tensor:
    """Greedy tokens, exactly FIXED_NEW_TOKENS of them, from a fixed prompt. disable_compile: on
    CUDA, generate() would otherwise compile a static cache's decode step itself
    (mode="reduce-overhead"), around the compiled forward."""
    prompt = (torch.arange(batch * 5, device=model.device).view(batch, 5) * 7 + 1) % 128
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=FIXED_NEW_TOKENS,
                          min_new_tokens=FIXED_NEW_TOKENS, do_sample=False, disable_compile=True, **kwargs)
