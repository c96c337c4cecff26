"""A zoo of transformers architectures, each compiled with cgcompile and compared with eager.

Every model is built from a tiny config with random, seeded weights (hidden 64, 2 layers,
4 heads, vocab 256, intermediate 128, MoE with 4 experts top-2), compiled the way a user
would (`model.forward = torch.compile(model.forward, backend=cgcompile.Backend(config))`,
with the README's `dynamic_sources` line for the KV cache) and run against the same model
uncompiled:

    decoder, moe   greedy generate(), default DynamicCache, 32 new tokens, batch 1 and 3
                   (batch 3 left-padded: row i has i pad tokens); tokens must equal eager's
    seq2seq        the same through generate(); the encoder's forward is compiled too
    encoder        one forward at 1, 3 and 8 items (token ids, right-padded mask)
    vision         one forward at 1, 3 and 8 images

With capture sizes (1, 2, 4, 8, 16), 3 is a non-capture size (on CUDA it runs padded to 4).

    max err   max |compiled - eager| / max |eager| over every output tensor (language
              models: over the logits of every generate() step up to the first token
              that differs). Fails above 1e-4 in float32, 5e-2 in bfloat16.
    tokens    new tokens equal to eager's; in float32 all must be (in bfloat16 near ties
              may part ways: reported, not judged).
    graphs, pieces, capt, cuda   backend.stats after that row (cumulative per model):
              Dynamo graphs seen, pieces, capturable pieces, CUDA graphs captured.
    --speed   at batch 1: ms per decode step ((t(32 new tokens) - t(1)) / 31, as in
              benchmarks/hf_bench.py) or per forward (mean of 10), eager and cgcompile
              timed round-robin, median over --rounds rounds, after the correctness run's warm-up.

A model that fails is a row with its error (class and first line); the run goes on and exits
non-zero at the end. Architectures missing from the installed transformers are skipped.
--json writes the rows (and the wall time of each) after every row. The piece compiler is
Inductor on CUDA and "eager" (pieces run as FX code, the same split) on CPU unless --compiler says.

    python benchmarks/model_zoo.py --list
    python benchmarks/model_zoo.py --device cpu --models llama,bert      # names, or kinds: --models moe,vision
    python benchmarks/model_zoo.py --device cuda --json zoo_fp32.json                       # correctness
    python benchmarks/model_zoo.py --device cuda --dtype bfloat16 --speed --json zoo_bf16.json
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

KINDS = ("decoder", "moe", "encoder", "vision", "seq2seq")
_AUTO = {"decoder": "AutoModelForCausalLM", "moe": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM"}
_INPUTS = {"decoder": "prompt", "moe": "prompt", "seq2seq": "text", "encoder": "text", "vision": "pixels"}


@dataclasses.dataclass(frozen=True)
class Arch:
    """One zoo entry: a transformers config class, its tiny fields, and how to run it.

    kind: "decoder" or "moe" (generate()), "seq2seq" (generate() with an encoder),
        "encoder" or "vision" (one forward).
    auto: the transformers Auto class that builds the model from the config (default by kind).
    inputs: a key of INPUTS (default by kind): "prompt" (left-padded token ids), "text"
        (right-padded token ids), "pixels" or "audio" (Whisper's mel features).
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
        return self.kind in ("decoder", "moe", "seq2seq")


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
    # Text encoders: forward on token ids with a right-padded attention mask.
    Arch("bert", "encoder", "BertConfig", _BERT),
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
    # Encoder-decoders through generate().
    Arch("t5", "seq2seq", "T5Config", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                            num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)),
    Arch("bart", "seq2seq", "BartConfig", _SEQ2SEQ | dict(max_position_embeddings=64, forced_eos_token_id=None)),
    Arch("whisper", "seq2seq", "WhisperConfig", _SEQ2SEQ | dict(
        num_mel_bins=16, max_source_positions=16, max_target_positions=64, suppress_tokens=[],
        begin_suppress_tokens=[]), auto="AutoModelForSpeechSeq2Seq", inputs="audio"),
]
BY_NAME = {arch.name: arch for arch in ARCHS}


# -- options, rows ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    compiler: str = "eager"  # cgcompile.Config.compiler
    new_tokens: int = 32
    lm_batches: tuple[int, ...] = (1, 3)
    encoder_sizes: tuple[int, ...] = (1, 3, 8)
    speed: bool = False
    rounds: int = 5
    fuse_sibling_linears: bool = False  # cgcompile.Config.fuse_sibling_linears

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    @property
    def exact_tokens(self) -> bool:
        return self.dtype == torch.float32


@dataclasses.dataclass
class Row:
    """One model at one batch size (language models) or item count (encoders)."""

    model: str
    kind: str
    size: int
    status: str = "ok"  # ok, FAIL or skip
    graphs: int | None = None  # backend.stats after this row, cumulative per model
    pieces: int | None = None
    capturable: int | None = None
    graphs_captured: int | None = None
    compilations: int | None = None
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
    """[size, length]: row i has i pad positions (0), on the left or on the right."""
    positions, pads = torch.arange(length), torch.arange(size)[:, None]
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
    # Whisper's encoder takes exactly 2 * max_source_positions frames.
    "audio": lambda config, size, g: {"input_features": torch.randn(
        (size, config.num_mel_bins, 2 * config.max_source_positions), generator=g)},
}


def make_inputs(arch: Arch, config, size: int, options: Options) -> dict[str, torch.Tensor]:
    """Seeded inputs for `size` items on the device; floating-point ones in the dtype."""
    inputs = INPUTS[arch.input_kind](config, size, torch.Generator().manual_seed(size))
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
    """Every tensor of a model output, nested tuples flattened, in order."""
    values = output.to_tuple() if hasattr(output, "to_tuple") else output
    if isinstance(values, torch.Tensor):
        return [values]
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
    harness.synchronize(device)
    start = time.perf_counter()
    fn()
    harness.synchronize(device)
    return time.perf_counter() - start


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


def time_eager_and_compiled(arch: Arch, model, inputs: dict, targets, forwards, options: Options):
    """Median ms of eager and of cgcompile, timed in interleaved rounds (the host's speed drifts)."""
    def with_graphs():
        with compiled(targets, forwards):
            return one_measure(arch, model, inputs, options)

    windows = {("eager", 1): lambda: one_measure(arch, model, inputs, options), ("cgcompile", 1): with_graphs}
    samples, errors = harness.run_interleaved(windows, options.rounds)
    if errors:
        raise RuntimeError("; ".join(f"{variant}: {error}" for variant, error in errors.items()))
    return tuple(1e3 * statistics.median(samples[key]) for key in windows)


# -- one model ----------------------------------------------------------------------------


def sizes(arch: Arch, options: Options) -> tuple[int, ...]:
    return options.lm_batches if arch.is_lm else options.encoder_sizes


def run_model(arch: Arch, options: Options) -> list[Row]:
    """Every size of one architecture: a fresh Dynamo, its own Backend; errors become rows."""
    rows = [Row(arch.name, arch.kind, size) for size in sizes(arch, options)]
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
    backend = cgcompile.Backend(cgcompile.Config(compiler=options.compiler, capture_sizes=CAPTURE_SIZES,
                                                 fuse_sibling_linears=options.fuse_sibling_linears))
    targets = compile_targets(arch, model)
    forwards = [torch.compile(m.forward, backend=backend) for m in targets]
    for row in rows:
        start = time.perf_counter()
        try:
            inputs = make_inputs(arch, model.config, row.size, options)
            check(arch, model, inputs, row, targets, forwards, options)
            if options.speed and row.size == 1:
                time_row(arch, model, inputs, row, backend, targets, forwards, options)
        except Exception as e:
            traceback.print_exc()
            row.error = describe(e)
        row.wall_s = time.perf_counter() - start
        record_stats(row, backend.stats)
        judge(row, options)
    release()
    return rows


def check(arch: Arch, model, inputs: dict, row: Row, targets, forwards, options: Options) -> None:
    """Eager, then compiled, on the same inputs; their difference goes into the row."""
    expected = run(arch, model, inputs, options.new_tokens)
    with compiled(targets, forwards):
        got = run(arch, model, inputs, options.new_tokens)
    result = compare(arch, got, expected)
    row.max_err, row.tokens_equal, row.tokens_total = result.max_err, result.tokens_equal, result.tokens_total


def time_row(arch: Arch, model, inputs: dict, row: Row, backend, targets, forwards, options: Options) -> None:
    graphs_before = backend.stats.graphs_seen
    row.eager_ms, row.cgcompile_ms = time_eager_and_compiled(arch, model, inputs, targets, forwards, options)
    if backend.stats.graphs_seen != graphs_before:  # the timing would include compiling
        row.note = f"Dynamo compiled {backend.stats.graphs_seen - graphs_before} graph(s) while timing"


def release() -> None:
    """Drop the compiled frames (and with them the model's graphs and pool) before the next model."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record_stats(row: Row, stats: cgcompile.BackendStats) -> None:
    row.graphs, row.pieces, row.capturable = stats.graphs_seen, stats.pieces, stats.capturable_pieces
    row.graphs_captured, row.compilations = stats.graphs_captured, stats.compilations


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
    """Room for every graph of a model (prefill and decode at two batch sizes, an encoder's
    sizes), and the cache length symbolic from the first decode step."""
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
HEADER = (f"{'model':<13} {'kind':<7} {'size':>4} {'status':<6} {'graphs':>6} {'pieces':>6} {'capt':>4} {'cuda':>4} "
          f"{'max err':>8} {'tokens':>7} {'eager ms':>8} {'cg ms':>7} {'x':>5}  note")


def fmt(value, spec: str) -> str:
    """`value` formatted by `spec`, or "-" in the same width."""
    width = "".join(c for c in spec.split(".")[0] if c.isdigit())
    return format("-", f">{width}") if value is None else format(value, spec)


def format_row(row: Row) -> str:
    tokens = None if row.tokens_total is None else f"{row.tokens_equal}/{row.tokens_total}"
    speedup = row.eager_ms / row.cgcompile_ms if row.eager_ms and row.cgcompile_ms else None
    line = (f"{row.model:<13} {row.kind:<7} {row.size:>4} {row.status:<6} {fmt(row.graphs, '6d')} "
            f"{fmt(row.pieces, '6d')} {fmt(row.capturable, '4d')} {fmt(row.graphs_captured, '4d')} "
            f"{fmt(row.max_err, '8.1e')} {fmt(tokens, '>7')} {fmt(row.eager_ms, '8.2f')} "
            f"{fmt(row.cgcompile_ms, '7.2f')} {fmt(speedup, '5.2f')}  {row.note or ''}")
    return line[:TABLE_WIDTH]


def print_report(rows: list[Row]) -> None:
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    failed = [row for row in rows if row.status == "FAIL"]
    models = {row.model for row in rows}
    print(f"\n{len(models)} models, {len(rows)} rows: {len(rows) - len(failed)} passed or skipped, {len(failed)} failed")
    for row in failed:
        print(f"FAIL {row.model} size {row.size}: {row.note}")
    slower = [row.model for row in rows if row.eager_ms and row.cgcompile_ms and row.cgcompile_ms > row.eager_ms]
    if slower:
        print(f"slower than eager at batch 1 (not a failure): {', '.join(slower)}")


def environment(options: Options) -> dict:
    device = torch.cuda.get_device_name() if options.device == "cuda" else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "dtype": str(options.dtype).removeprefix("torch."),
            "compiler": options.compiler, "capture_sizes": CAPTURE_SIZES, "new_tokens": options.new_tokens,
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
    parser.add_argument("--sizes", default=None,
                        help="comma-separated batch sizes / item counts for every model "
                             "(default: 1,3 for language models, 1,3,8 for encoders); "
                             "--speed --sizes 1 times batch 1 without compiling the other sizes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--fuse-sibling-linears", action="store_true",
                        help="compile with Config(fuse_sibling_linears=True)")
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
    if args.sizes:
        sizes = tuple(int(s) for s in args.sizes.split(","))
        chosen = {"lm_batches": sizes, "encoder_sizes": sizes}
    return Options(**chosen, device=args.device, dtype=getattr(torch, args.dtype),
                   compiler=args.compiler or ("inductor" if args.device == "cuda" else "eager"),
                   new_tokens=args.new_tokens, speed=args.speed, rounds=args.rounds,
                   fuse_sibling_linears=args.fuse_sibling_linears)


def print_list() -> None:
    for arch in ARCHS:
        available = "" if hasattr(transformers, arch.config) else f"  (not in transformers {transformers.__version__})"
        print(f"{arch.name:<14} {arch.kind:<8} {arch.config:<20} {arch.auto_class}{available}")


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
