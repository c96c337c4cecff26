"""A zoo of transformers architectures, each compiled with cgcompile and compared with eager.

Every model is built from a tiny config with random, seeded weights (hidden 64, 2 layers,
4 heads, vocab 256, intermediate 128, MoE with 4 experts top-2), compiled the way a user
would (`model.forward = torch.compile(model.forward, backend=cgcompile.Backend(config))`,
with the README's `dynamic_sources` line for the KV cache) and run against the same model
uncompiled. Each architecture is compiled once and runs a sequence of sizes on that one
compiled model, as a server would: language models batch 1, 3, 4, then 1 again; the
others 1, 3, 8, then 1 items. Every call has its own inputs (seeded by its place in the
sequence: the second batch 1 is another prompt), and is one row:

    decoder, moe   greedy generate(), default DynamicCache, 32 new tokens; prompts are
                   left-padded (row i has i pad tokens, so the mask has zeros from batch 2);
                   sliding-window, chunked, sink and linear attention among them
    ssm            the same for state-space decoders (Mamba, Mamba2) and hybrids of
                   state-space or recurrent layers with attention (Jamba, Zamba, Bamba, ...)
    seq2seq        the same through generate(); the encoder's forward is compiled too
    encoder        one forward on token ids, right-padded mask
    vision         one forward on images [N, 3, 32, 32] (transformers and convolutional)
    audio          one forward on raw waveforms [N, 1600] (Wav2Vec2, HuBERT) or mel features

With capture sizes (1, 2, 4, 8, 16), 3 is a non-capture size (on CUDA it runs padded to 4)
and 4 and 8 are capture sizes. --sequence 1,3,4,1 sets the sizes of every model;
--fresh-per-size runs each size on a fresh Dynamo and Backend instead (the zoo's rows before
the sequence: each size compiled from nothing).

    max err   max |compiled - eager| / max |eager| over every output tensor (language
              models: over the logits of every generate() step up to the first token
              that differs). Fails above 1e-4 in float32, 5e-2 in bfloat16.
    tokens    new tokens equal to eager's; in float32 all must be (in bfloat16 near ties
              may part ways: reported, not judged).
    call      the row's place in its model's sequence.
    graphs, pieces, capt, cuda   backend.stats after that row (cumulative over the sequence;
              per row with --fresh-per-size): Dynamo graphs seen, pieces, capturable pieces,
              CUDA graphs captured; pad: graphs whose calls pad to the capture sizes (the
              others run at exact sizes: no capture dimension, unsafe to pad, or padding off).
    --speed   at the first batch 1: ms per decode step ((t(32 new tokens) - t(1)) / 31, as in
              benchmarks/hf_bench.py) or per forward (mean of 10), eager and cgcompile
              timed round-robin, median over --rounds rounds, after the correctness run's warm-up.

A model that fails is a row with its error (class and first line); the run goes on and exits
non-zero at the end. Architectures missing from the installed transformers are skipped.
--json writes the rows (and the wall time of each) after every row. The piece compiler is
Inductor on CUDA and "eager" (pieces run as FX code, the same split) on CPU unless --compiler says;
--padding compiles with Config(padding=True), which pads non-capture sizes on CPU too.

    python benchmarks/model_zoo.py --list
    python benchmarks/model_zoo.py --device cpu --models llama,bert      # names, or kinds: --models ssm,audio
    python benchmarks/model_zoo.py --device cuda --json zoo_fp32.json                       # correctness
    python benchmarks/model_zoo.py --device cuda --dtype bfloat16 --speed --json zoo_bf16.json
    python benchmarks/model_zoo.py --device cuda --models mamba,gpt_oss --sequence 1,3,8,1 --fresh-per-size
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import transformers

import cgcompile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, also when loaded by a test
import harness  # noqa: E402  (the method every benchmark here shares)

KV_CACHE_SOURCES = r".*past_key_values.*"  # the README's recommended dynamic_sources line
CAPTURE_SIZES = (1, 2, 4, 8, 16)
PROMPT_LEN = 8  # language-model prompts
TEXT_LEN = 16  # text-encoder and seq2seq encoder inputs
PADDED = "padded to the capture sizes"  # cgcompile.Piece.sizes of a graph whose calls pad
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # max err, relative to the largest eager value

# -- the architectures ------------------------------------------------------------------

VOCAB = 256
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
_MOE = dict(num_experts=4, num_experts_per_tok=2)
_BERT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64)
_VISION = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)

_MAMBA = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
_HYBRID = _LLAMA | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # attention and state-space layers
_AUDIO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
              conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
              vocab_size=32)

KINDS = ("decoder", "moe", "ssm", "encoder", "vision", "audio", "seq2seq")
_CAUSAL = "AutoModelForCausalLM"
_AUTO = {"decoder": _CAUSAL, "moe": _CAUSAL, "ssm": _CAUSAL, "seq2seq": "AutoModelForSeq2SeqLM"}
_INPUTS = {"decoder": "prompt", "moe": "prompt", "ssm": "prompt", "seq2seq": "text", "encoder": "text",
           "vision": "pixels", "audio": "waveform"}


@dataclasses.dataclass(frozen=True)
class Arch:
    """One zoo entry: a transformers config class, its tiny fields, and how to run it.

    kind: "decoder", "moe" or "ssm" (state-space and hybrid decoders) through generate(),
        "seq2seq" (generate() with an encoder), "encoder", "vision" or "audio" (one forward).
    auto: the transformers class that builds the model from the config (default by kind).
    inputs: a key of INPUTS (default by kind): "prompt" (left-padded token ids), "text"
        (right-padded token ids), "pixels", "waveform" (raw audio) or "mel" (Whisper's features).
    """

    name: str
    kind: str
    config: str
    kwargs: dict
    auto: str = ""
    inputs: str = ""

    @property
    def auto_class(self) -> str:
        return self.auto or _AUTO.get(self.kind, "AutoModel")

    @property
    def input_kind(self) -> str:
        return self.inputs or _INPUTS[self.kind]

    @property
    def is_lm(self) -> bool:
        """Runs through generate() (else one forward)."""
        return self.kind in ("decoder", "moe", "ssm", "seq2seq")


ARCHS = [
    # Dense decoders. A sliding window (16) shorter than prompt + new tokens where the
    # architecture has one, so the windowed cache and mask paths run.
    Arch("llama", "decoder", "LlamaConfig", _LLAMA),
    Arch("mistral", "decoder", "MistralConfig", _LLAMA | dict(sliding_window=16)),
    Arch("qwen2", "decoder", "Qwen2Config", _LLAMA),
    Arch("qwen3", "decoder", "Qwen3Config", _LLAMA | dict(head_dim=16)),
    Arch("gemma", "decoder", "GemmaConfig", _LLAMA | dict(head_dim=16)),
    Arch("gemma2", "decoder", "Gemma2Config", _LLAMA | dict(head_dim=16, sliding_window=16)),
    Arch("gemma3", "decoder", "Gemma3TextConfig", _LLAMA | dict(
        head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    Arch("phi", "decoder", "PhiConfig", _LLAMA),
    Arch("phi3", "decoder", "Phi3Config", _LLAMA | dict(pad_token_id=0, eos_token_id=2)),
    Arch("stablelm", "decoder", "StableLmConfig", _LLAMA),
    Arch("olmo2", "decoder", "Olmo2Config", _LLAMA | dict(pad_token_id=0, eos_token_id=2)),
    Arch("cohere", "decoder", "CohereConfig", _LLAMA | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Arch("granite", "decoder", "GraniteConfig", _LLAMA),
    Arch("starcoder2", "decoder", "Starcoder2Config", _LLAMA | dict(sliding_window=16, bos_token_id=1, eos_token_id=2)),
    Arch("gpt2", "decoder", "GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                bos_token_id=1, eos_token_id=2)),
    Arch("gptj", "decoder", "GPTJConfig", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                rotary_dim=8, bos_token_id=1, eos_token_id=2)),
    Arch("gpt_neox", "decoder", "GPTNeoXConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                      num_attention_heads=4, intermediate_size=128,
                                                      max_position_embeddings=256)),
    Arch("opt", "decoder", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                              num_attention_heads=4, max_position_embeddings=256,
                                              word_embed_proj_dim=64)),
    Arch("falcon", "decoder", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, bos_token_id=1, eos_token_id=2)),
    Arch("bloom", "decoder", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
    # Sliding and global layers mixed (Cohere2); a short convolution beside attention (LFM2).
    Arch("cohere2", "decoder", "Cohere2Config", _HYBRID | dict(
        sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    Arch("lfm2", "decoder", "Lfm2Config", _HYBRID | dict(layer_types=["conv", "full_attention"])),
    # Mixture-of-experts decoders: 4 experts, top 2.
    Arch("mixtral", "moe", "MixtralConfig", _LLAMA | dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("qwen2_moe", "moe", "Qwen2MoeConfig", _LLAMA | _MOE | dict(
        moe_intermediate_size=64, shared_expert_intermediate_size=128)),
    Arch("qwen3_moe", "moe", "Qwen3MoeConfig", _LLAMA | _MOE | dict(head_dim=16, moe_intermediate_size=64)),
    Arch("olmoe", "moe", "OlmoeConfig", _LLAMA | _MOE | dict(pad_token_id=0)),
    Arch("granitemoe", "moe", "GraniteMoeConfig", _LLAMA | dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("phimoe", "moe", "PhimoeConfig", _LLAMA | dict(num_local_experts=4, num_experts_per_tok=2)),
    Arch("deepseek_v3", "moe", "DeepseekV3Config", _LLAMA | dict(
        num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # Llama 4's chunked attention (chunks of 8) beside a global layer without RoPE; GPT-OSS's
    # attention sinks with sliding and full layers; Qwen3-Next's linear attention (gated delta
    # rule) beside full attention.
    Arch("llama4", "moe", "Llama4TextConfig", _HYBRID | dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
        interleave_moe_layer_step=1, attention_chunk_size=8, no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"])),
    Arch("gpt_oss", "moe", "GptOssConfig", _HYBRID | dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])),
    Arch("qwen3_next", "moe", "Qwen3NextConfig", _HYBRID | _MOE | dict(
        head_dim=16, moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"])),
    # State-space decoders, and hybrids of state-space and attention layers (the mamba
    # kernels are off: CPU, and no custom kernels under Dynamo).
    Arch("mamba", "ssm", "MambaConfig", _MAMBA),
    Arch("mamba2", "ssm", "Mamba2Config", _MAMBA | dict(num_heads=8, head_dim=16, n_groups=1, chunk_size=16)),
    Arch("falcon_mamba", "ssm", "FalconMambaConfig", _MAMBA),
    Arch("jamba", "ssm", "JambaConfig", _HYBRID | dict(
        num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
        attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=16, mamba_dt_rank=8)),
    Arch("zamba", "ssm", "ZambaConfig", _HYBRID | dict(
        num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],  # 2 hybrids share their weights
        attention_hidden_size=128, attention_head_dim=32, n_mamba_heads=2, use_mamba_kernels=False,
        mamba_d_state=16, mamba_dt_rank=8)),
    Arch("zamba2", "ssm", "Zamba2Config", _HYBRID | dict(
        layers_block_type=["mamba", "hybrid"], n_mamba_heads=8, mamba_d_state=16, mamba_ngroups=1, chunk_size=16,
        use_mamba_kernels=False, num_mem_blocks=1)),
    Arch("bamba", "ssm", "BambaConfig", _HYBRID | dict(
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_chunk_size=16)),
    Arch("falcon_h1", "ssm", "FalconH1Config", _HYBRID | dict(
        head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_chunk_size=16)),
    Arch("recurrent_gemma", "ssm", "RecurrentGemmaConfig", _HYBRID | dict(
        lru_width=64, attention_window_size=16, block_types=["recurrent", "attention"], num_key_value_heads=1)),
    Arch("granitemoehybrid", "ssm", "GraniteMoeHybridConfig", _HYBRID | dict(
        num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16)),
    # Text encoders: forward on token ids with a right-padded attention mask.
    Arch("bert", "encoder", "BertConfig", _BERT),
    # Relative positions built on the host side of the graph (a lost size symbol once split it wrongly).
    Arch("deberta_v2", "encoder", "DebertaV2Config", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        relative_attention=True, position_buckets=16, max_relative_positions=64, pos_att_type=["p2c", "c2p"])),
    Arch("roberta", "encoder", "RobertaConfig", _BERT | dict(pad_token_id=1)),
    Arch("xlm_roberta", "encoder", "XLMRobertaConfig", _BERT | dict(pad_token_id=1)),
    Arch("distilbert", "encoder", "DistilBertConfig", dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                                                            hidden_dim=128, max_position_embeddings=64)),
    Arch("albert", "encoder", "AlbertConfig", _BERT | dict(embedding_size=32)),
    Arch("electra", "encoder", "ElectraConfig", _BERT | dict(embedding_size=32)),
    Arch("modernbert", "encoder", "ModernBertConfig", _BERT | dict(
        local_attention=8, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2)),
    # Vision encoders: forward on pixel values [N, 3, 32, 32], 8x8 patches.
    Arch("vit", "vision", "ViTConfig", _VISION | dict(intermediate_size=128)),
    Arch("deit", "vision", "DeiTConfig", _VISION | dict(intermediate_size=128)),
    Arch("beit", "vision", "BeitConfig", _VISION | dict(intermediate_size=128, vocab_size=VOCAB)),
    Arch("clip_vision", "vision", "CLIPVisionConfig", _VISION | dict(intermediate_size=128)),
    Arch("siglip_vision", "vision", "SiglipVisionConfig", _VISION | dict(intermediate_size=128)),
    Arch("dinov2", "vision", "Dinov2Config", _VISION | dict(mlp_ratio=2)),
    # Convolutional vision encoders (no attention: one piece).
    Arch("resnet", "vision", "ResNetConfig", dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                  layer_type="basic", image_size=32)),
    Arch("convnext", "vision", "ConvNextConfig", dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                      image_size=32)),
    # Audio encoders: a convolutional feature extractor on raw waveforms, then attention;
    # Whisper's encoder alone on mel features.
    Arch("wav2vec2", "audio", "Wav2Vec2Config", _AUDIO),
    Arch("hubert", "audio", "HubertConfig", _AUDIO),
    Arch("whisper_encoder", "audio", "WhisperConfig", dict(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16, vocab_size=VOCAB),
        auto="AutoModelForAudioClassification", inputs="mel"),
    # Encoder-decoders through generate().
    Arch("t5", "seq2seq", "T5Config", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                            num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)),
    Arch("bart", "seq2seq", "BartConfig", _SEQ2SEQ | dict(max_position_embeddings=64, forced_eos_token_id=None)),
    Arch("whisper", "seq2seq", "WhisperConfig", _SEQ2SEQ | dict(
        num_mel_bins=16, max_source_positions=16, max_target_positions=64, suppress_tokens=[],
        begin_suppress_tokens=[]), auto="AutoModelForSpeechSeq2Seq", inputs="mel"),
    Arch("mbart", "seq2seq", "MBartConfig", _SEQ2SEQ | dict(max_position_embeddings=64, forced_eos_token_id=None)),
    Arch("pegasus", "seq2seq", "PegasusConfig", _SEQ2SEQ | dict(max_position_embeddings=64, forced_eos_token_id=None)),
    Arch("marian", "seq2seq", "MarianConfig", _SEQ2SEQ | dict(max_position_embeddings=64, decoder_vocab_size=VOCAB,
                                                              forced_eos_token_id=None)),
    # Its generate() once compiled a graph that returns nothing (its only effect an in-place write).
    Arch("led", "seq2seq", "LEDConfig", _SEQ2SEQ | dict(max_encoder_position_embeddings=64,
                                                         max_decoder_position_embeddings=64, attention_window=[8, 8])),
    Arch("mt5", "seq2seq", "MT5Config", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                              num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)),
]
BY_NAME = {arch.name: arch for arch in ARCHS}


# -- options, rows ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    compiler: str = "eager"  # cgcompile.Config.compiler
    new_tokens: int = 32
    # The sizes one compiled model runs, call after call: batch 1, a non-capture batch, a
    # capture batch, batch 1 again (every call with another prompt or other items).
    lm_sequence: tuple[int, ...] = (1, 3, 4, 1)
    encoder_sequence: tuple[int, ...] = (1, 3, 8, 1)
    fresh_per_size: bool = False  # a fresh Dynamo and Backend for every call instead
    speed: bool = False
    rounds: int = 5
    fuse_sibling_linears: bool | None = None  # cgcompile.Config.fuse_sibling_linears (None: its default)
    matvec_as_reduction: bool = False  # cgcompile.Config.matvec_as_reduction (bf16/fp16, Inductor)
    padding: bool | None = None  # cgcompile.Config.padding (True: pads on CPU too)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    @property
    def exact_tokens(self) -> bool:
        return self.dtype == torch.float32


@dataclasses.dataclass
class Row:
    """One call of one model: a generate() at one batch size (language models), or a forward
    on one item count (encoders); `call` is its position in the model's size sequence."""

    model: str
    kind: str
    size: int
    call: int = 0
    status: str = "ok"  # ok, FAIL or skip
    graphs: int | None = None  # backend.stats after this row, cumulative per model (per row with fresh_per_size)
    pieces: int | None = None
    capturable: int | None = None
    graphs_captured: int | None = None
    compilations: int | None = None
    padded_graphs: int | None = None  # Dynamo graphs whose calls pad to the capture sizes
    max_err: float | None = None
    tokens_equal: int | None = None
    tokens_total: int | None = None
    eager_ms: float | None = None  # per decode step (language models) or per forward
    cgcompile_ms: float | None = None
    wall_s: float | None = None  # this row's eager and compiled runs (and timing), compiling included
    error: str | None = None  # the exception's class and first line
    note: str | None = None  # why the row failed, or was skipped


def describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


# -- build and inputs -------------------------------------------------------------------


def build(arch: Arch, options: Options) -> torch.nn.Module:
    """The model with random weights (seed 0), in eval mode, on the device, in the dtype."""
    config = getattr(transformers, arch.config)(**arch.kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, arch.auto_class).from_config(config)
    model = model.to(device=options.device, dtype=options.dtype).eval()
    if arch.is_lm:
        model.generation_config.eos_token_id = None  # random weights: never stop early
        model.generation_config.pad_token_id = 0
        model.generation_config.forced_eos_token_id = None
    return model


def padding_mask(size: int, length: int, left: bool) -> torch.Tensor:
    """[size, length]: row i has i % length pad positions (0), on the left or on the right."""
    positions, pads = torch.arange(length), torch.arange(size)[:, None] % length
    return (positions >= pads if left else positions < length - pads).long()


def token_inputs(config, size: int, length: int, left: bool, generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, config.vocab_size, (size, length), generator=generator)
    mask = padding_mask(size, length, left)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


INPUTS = {
    # A language model's prompt, left-padded as generate() expects.
    "prompt": lambda config, size, g: token_inputs(config, size, PROMPT_LEN, True, g),
    # An encoder's token ids, right-padded.
    "text": lambda config, size, g: token_inputs(config, size, TEXT_LEN, False, g),
    "pixels": lambda config, size, g: {"pixel_values": torch.randn(
        (size, config.num_channels, config.image_size, config.image_size), generator=g)},
    # Raw audio, 1600 samples (10 feature frames after the convolutions).
    "waveform": lambda config, size, g: {"input_values": torch.randn((size, 1600), generator=g)},
    # Whisper's encoder takes exactly 2 * max_source_positions frames.
    "mel": lambda config, size, g: {"input_features": torch.randn(
        (size, config.num_mel_bins, 2 * config.max_source_positions), generator=g)},
}


def make_inputs(arch: Arch, config, row: Row, options: Options) -> dict[str, torch.Tensor]:
    """`row.size` items on the device, floating-point ones in the dtype; seeded by the call's
    position, so that two calls at one size get different prompts."""
    inputs = INPUTS[arch.input_kind](config, row.size, torch.Generator().manual_seed(row.call))
    return {k: v.to(options.device, dtype=options.dtype if v.is_floating_point() else None) for k, v in inputs.items()}


# -- run eager and compiled ---------------------------------------------------------------


def compile_targets(arch: Arch, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward gets compiled: the model, and an encoder-decoder's encoder
    (generate() calls it directly, not through model.forward)."""
    return [model, model.get_encoder()] if arch.kind == "seq2seq" else [model]


@contextlib.contextmanager
def compiled(modules: list[torch.nn.Module], forwards: list[Callable]):
    """Run `modules` with their compiled forwards inside the scope, their own forwards after."""
    for module, forward in zip(modules, forwards):
        module.forward = forward
    try:
        yield
    finally:
        for module in modules:
            del module.forward  # the instance attribute: the class's forward again


def run(arch: Arch, model: torch.nn.Module, inputs: dict, new_tokens: int):
    """One forward (encoders) or one greedy generate() with its logits (language models)."""
    with torch.inference_mode():
        if not arch.is_lm:
            return model(**inputs)
        return model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)


@dataclasses.dataclass(frozen=True)
class Comparison:
    max_err: float
    tokens_equal: int | None = None
    tokens_total: int | None = None


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|, in float64."""
    got, expected = got.double(), expected.double()
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def output_tensors(output) -> list[torch.Tensor]:
    """Every tensor of a model output, nested tuples, lists and dicts flattened, in order."""
    values = output.to_tuple() if hasattr(output, "to_tuple") else output
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):  # torchvision's detection and segmentation outputs (benchmarks/model_zoo_beyond.py)
        values = values.values()
    return [t for v in values if v is not None for t in output_tensors(v)]


def compare(arch: Arch, got, expected) -> Comparison:
    if not arch.is_lm:
        pairs = list(zip(output_tensors(got), output_tensors(expected), strict=True))
        return Comparison(max(relative_error(g, e) for g, e in pairs))
    new = len(expected.logits)
    got_new, expected_new = got.sequences[:, -new:], expected.sequences[:, -new:]
    same_steps = (got_new == expected_new).all(dim=0).tolist() + [False]
    checked = same_steps.index(False) + 1  # logits up to the first step whose tokens differ
    err = max(relative_error(g, e) for g, e in zip(got.logits[:checked], expected.logits[:checked]))
    return Comparison(err, int((got_new == expected_new).sum()), got_new.numel())


# -- timing -------------------------------------------------------------------------------


def seconds(fn: Callable[[], Any], device: str) -> float:
    return harness.wall_s(fn, device)[0]


def one_measure(arch: Arch, model, inputs: dict, options: Options) -> float:
    """Seconds per decode step (language models) or per forward (encoders)."""
    if arch.is_lm:
        def gen(n):
            return lambda: model.generate(**inputs, max_new_tokens=n, do_sample=False)
        with torch.inference_mode():
            one = seconds(gen(1), options.device)
            full = seconds(gen(options.new_tokens), options.device)
        return (full - one) / (options.new_tokens - 1)
    reps = 10
    with torch.inference_mode():
        return seconds(lambda: [model(**inputs) for _ in range(reps)], options.device) / reps


def time_eager_and_compiled(arch: Arch, model, inputs: dict, session: Compiled, options: Options):
    """Median ms of eager and of cgcompile, timed in interleaved rounds (the host's speed drifts)."""
    def with_graphs():
        with compiled(session.targets, session.forwards):
            return one_measure(arch, model, inputs, options)

    windows = {("eager", 1): lambda: one_measure(arch, model, inputs, options), ("cgcompile", 1): with_graphs}
    samples, errors = harness.run_interleaved(windows, options.rounds)
    if errors:
        raise RuntimeError("; ".join(f"{variant}: {error}" for variant, error in errors.items()))
    return tuple(1e3 * statistics.median(samples[key]) for key in windows)


# -- one model ----------------------------------------------------------------------------


def sequence(arch: Arch, options: Options) -> tuple[int, ...]:
    return options.lm_sequence if arch.is_lm else options.encoder_sequence


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One Backend and the compiled forwards of the modules it serves."""

    backend: cgcompile.Backend
    targets: list[torch.nn.Module]
    forwards: list[Callable]


def compile_model(arch: Arch, model: torch.nn.Module, options: Options) -> Compiled:
    backend = cgcompile.Backend(cgcompile.Config(compiler=options.compiler, capture_sizes=CAPTURE_SIZES,
                                                 fuse_sibling_linears=options.fuse_sibling_linears,
                                                 matvec_as_reduction=options.matvec_as_reduction,
                                                 padding=options.padding))
    targets = compile_targets(arch, model)
    return Compiled(backend, targets, [torch.compile(m.forward, backend=backend) for m in targets])


def run_model(arch: Arch, options: Options) -> list[Row]:
    """One architecture's size sequence, every call on one compiled model (or, with
    fresh_per_size, each on a fresh Dynamo and Backend); errors become rows."""
    rows = [Row(arch.name, arch.kind, size, call) for call, size in enumerate(sequence(arch, options))]
    if not hasattr(transformers, arch.config):
        for row in rows:
            row.status, row.note = "skip", f"no {arch.config} in transformers {transformers.__version__}"
        return rows
    torch._dynamo.reset()
    try:
        model = build(arch, options)
    except Exception as e:
        for row in rows:
            row.error = f"build: {describe(e)}"
            judge(row, options)
        return rows
    session = None
    for row in rows:
        if session is None or options.fresh_per_size:
            session = None  # its graphs and pool go with the compiled frames
            release()
            session = compile_model(arch, model, options)
        run_row(arch, model, row, session, options)
    release()
    return rows


def run_row(arch: Arch, model, row: Row, session: Compiled, options: Options) -> None:
    """One call: eager and compiled compared (and timed at the first batch 1 with --speed)."""
    start = time.perf_counter()
    try:
        inputs = make_inputs(arch, model.config, row, options)
        check(arch, model, inputs, row, session, options)
        if options.speed and row.size == 1 and row.call == sequence(arch, options).index(1):
            time_row(arch, model, inputs, row, session, options)
    except Exception as e:
        traceback.print_exc()
        row.error = describe(e)
    row.wall_s = time.perf_counter() - start
    record_stats(row, session.backend)
    judge(row, options)


def check(arch: Arch, model, inputs: dict, row: Row, session: Compiled, options: Options) -> None:
    """Eager, then compiled, on the same inputs; their difference goes into the row."""
    expected = run(arch, model, inputs, options.new_tokens)
    with compiled(session.targets, session.forwards):
        got = run(arch, model, inputs, options.new_tokens)
    result = compare(arch, got, expected)
    row.max_err, row.tokens_equal, row.tokens_total = result.max_err, result.tokens_equal, result.tokens_total


def time_row(arch: Arch, model, inputs: dict, row: Row, session: Compiled, options: Options) -> None:
    graphs_before = session.backend.stats.graphs_seen
    row.eager_ms, row.cgcompile_ms = time_eager_and_compiled(arch, model, inputs, session, options)
    graphs = session.backend.stats.graphs_seen - graphs_before
    if graphs:  # the timing would include compiling
        row.note = f"Dynamo compiled {graphs} graph(s) while timing"


def release() -> None:
    """Drop the compiled frames (and with them the model's graphs and pool) before the next model."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record_stats(row: Row, backend: cgcompile.Backend) -> None:
    stats = backend.stats
    row.graphs, row.pieces, row.capturable = stats.graphs_seen, stats.pieces, stats.capturable_pieces
    row.graphs_captured, row.compilations = stats.graphs_captured, stats.compilations
    row.padded_graphs = len({p.graph_index for p in backend.pieces if p.sizes == PADDED})


def judge(row: Row, options: Options) -> None:
    """FAIL on an error, an error above tolerance, or (float32) any token unlike eager's."""
    if row.error:
        row.status, row.note = "FAIL", row.error
    elif row.max_err is not None and not row.max_err <= options.tolerance:
        row.status, row.note = "FAIL", f"max err {row.max_err:.2e} > {options.tolerance:g}"
    elif options.exact_tokens and row.tokens_equal != row.tokens_total:
        row.status, row.note = "FAIL", f"tokens {row.tokens_equal}/{row.tokens_total} equal eager's"
    elif row.note:  # recompiled while timing
        row.status = "FAIL"


def dynamo_settings():
    """Room for every graph of a model (prefill and decode at each size of its sequence, an
    encoder's sizes), and the cache length symbolic from the first decode step."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(recompile_limit=64))
    stack.enter_context(torch.compiler.config.patch(dynamic_sources=KV_CACHE_SOURCES))
    return stack


@contextlib.contextmanager
def exact_float32(options: Options):
    """No TF32 in float32 runs (on by default for cuDNN convolutions): eager and compiled
    code would round differently."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if options.dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run_zoo(names: list[str], options: Options, on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """Every named architecture, one after another; `on_row` sees each row as it is done."""
    rows = []
    with dynamo_settings(), exact_float32(options):
        for name in names:
            for row in run_model(BY_NAME[name], options):
                on_row(row)
                rows.append(row)
    return rows


# -- report -------------------------------------------------------------------------------

TABLE_WIDTH = 140
HEADER = (f"{'model':<16} {'kind':<7} {'call':>4} {'size':>4} {'status':<6} {'graphs':>6} {'pieces':>6} {'capt':>4} "
          f"{'cuda':>4} {'pad':>3} {'max err':>8} {'tokens':>7} {'eager ms':>8} {'cg ms':>7} {'x':>5}  note")


def fmt(value, spec: str) -> str:
    """`value` formatted by `spec`, or "-" in the same width."""
    width = "".join(c for c in spec.split(".")[0] if c.isdigit())
    return format("-", f">{width}") if value is None else format(value, spec)


def format_row(row: Row) -> str:
    tokens = None if row.tokens_total is None else f"{row.tokens_equal}/{row.tokens_total}"
    speedup = row.eager_ms / row.cgcompile_ms if row.eager_ms and row.cgcompile_ms else None
    line = (f"{row.model:<16} {row.kind:<7} {row.call:>4} {row.size:>4} {row.status:<6} {fmt(row.graphs, '6d')} "
            f"{fmt(row.pieces, '6d')} {fmt(row.capturable, '4d')} {fmt(row.graphs_captured, '4d')} "
            f"{fmt(row.padded_graphs, '3d')} {fmt(row.max_err, '8.1e')} {fmt(tokens, '>7')} "
            f"{fmt(row.eager_ms, '8.2f')} {fmt(row.cgcompile_ms, '7.2f')} {fmt(speedup, '5.2f')}  {row.note or ''}")
    return line[:TABLE_WIDTH]


def print_report(rows: list[Row]) -> None:
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    failed = [row for row in rows if row.status == "FAIL"]
    models = {row.model for row in rows}
    print(f"\n{len(models)} models, {len(rows)} rows: {len(rows) - len(failed)} passed or skipped, {len(failed)} failed")
    for row in failed:
        print(f"FAIL {row.model} call {row.call} size {row.size}: {row.note}")
    slower = [row.model for row in rows if row.eager_ms and row.cgcompile_ms and row.cgcompile_ms > row.eager_ms]
    if slower:
        print(f"slower than eager at batch 1 (not a failure): {', '.join(slower)}")


def environment(options: Options) -> dict:
    device = torch.cuda.get_device_name() if options.device == "cuda" else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "dtype": str(options.dtype).removeprefix("torch."),
            "compiler": options.compiler, "capture_sizes": CAPTURE_SIZES, "new_tokens": options.new_tokens,
            "lm_sequence": options.lm_sequence, "encoder_sequence": options.encoder_sequence,
            "fresh_per_size": options.fresh_per_size, "padding": options.padding,
            "tolerance": options.tolerance, "speed": options.speed, "rounds": options.rounds}


def write_json(path: str, rows: list[Row], options: Options) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(options), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


# -- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--compiler", choices=("eager", "inductor"), default=None,
                        help="cgcompile's piece compiler; default inductor on CUDA, eager on CPU")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated names (see --list) or kinds {KINDS}; default: all")
    parser.add_argument("--speed", action="store_true", help="time batch 1 against eager (use --dtype bfloat16)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds with --speed")
    parser.add_argument("--sequence", default=None,
                        help="comma-separated batch sizes / item counts every model runs in turn "
                             "(default: 1,3,4,1 for language models, 1,3,8,1 for encoders); "
                             "--speed --sequence 1 times batch 1 without compiling the other sizes")
    parser.add_argument("--fresh-per-size", action="store_true",
                        help="a fresh Dynamo and Backend for every call (default: one compiled model per architecture)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--fuse-sibling-linears", action="store_true",
                        help="compile with Config(fuse_sibling_linears=True)")
    parser.add_argument("--matvec-as-reduction", action="store_true",
                        help="compile with Config(matvec_as_reduction=True): one-row linears as Inductor reductions "
                             "(bf16/fp16 and compiler inductor)")
    parser.add_argument("--padding", action="store_true", help="compile with Config(padding=True): pads on CPU too")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--list", action="store_true", help="print the architectures and exit")
    args = parser.parse_args(argv)
    try:
        args.names = select(args.models.split(",") if args.models else list(KINDS))
    except KeyError as e:
        parser.error(f"--models: unknown {e.args[0]!r}; expected names from --list or kinds {KINDS}")
    return args


def select(words: list[str]) -> list[str]:
    """Architecture names for a list of names and kinds, in the zoo's order, each once."""
    for word in words:
        if word not in BY_NAME and word not in KINDS:
            raise KeyError(word)
    return [arch.name for arch in ARCHS if arch.name in words or arch.kind in words]


def options_from(args: argparse.Namespace) -> Options:
    chosen = {}
    if args.sequence:
        sizes = tuple(int(s) for s in args.sequence.split(","))
        chosen = {"lm_sequence": sizes, "encoder_sequence": sizes}
    return Options(**chosen, device=args.device, dtype=getattr(torch, args.dtype),
                   compiler=args.compiler or ("inductor" if args.device == "cuda" else "eager"),
                   new_tokens=args.new_tokens, speed=args.speed, rounds=args.rounds,
                   fuse_sibling_linears=args.fuse_sibling_linears or None, fresh_per_size=args.fresh_per_size,
                   matvec_as_reduction=args.matvec_as_reduction,
                   padding=True if args.padding else None)


def print_list() -> None:
    for arch in ARCHS:
        available = "" if hasattr(transformers, arch.config) else f"  (not in transformers {transformers.__version__})"
        print(f"{arch.name:<17} {arch.kind:<8} {arch.config:<23} {arch.auto_class}{available}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print_list()
        return 0
    options = options_from(args)
    transformers.logging.set_verbosity_error()  # config and generate() notes about random tiny models
    print(environment(options), HEADER, sep="\n", flush=True)
    done = []

    def on_row(row: Row) -> None:
        print(format_row(row), flush=True)
        done.append(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            write_json(args.json, done, options)

    rows = run_zoo(args.names, options, on_row)
    print_report(rows)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if any(row.status == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
