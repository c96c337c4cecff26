"""Builders the tests share; fixtures live in conftest.py, toy models in cgcompile.testing.models.

- Hugging Face: `tiny_model`, the one builder of tiny random models, and `generate()` helpers.
- GPU: which private memory pools exist, capture failures in a process of their own, a
  ToyLlama compiled on CUDA and dynamic ids for it.
- FX: the graph Dynamo captures for a function.

Test files import this module as `helpers` (pytest puts tests/, the folder of conftest.py,
on sys.path); no test file imports another test file.
"""

import dataclasses
import subprocess
import sys

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
from cgcompile.testing.models import SILLY_OP, ToyLlama

# ---- Hugging Face tiny models ----

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


# ---- FX ----


def traced(fn, *args):
    """The FX graph Dynamo captures for fn(*args), with fake-tensor metadata."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


# ---- GPU ----
def private_pools() -> set[tuple[int, int]]:
    """Ids of the private pools (CUDA graph pools) that hold memory segments now; (0, 0) is the default pool."""
    return {
        tuple(seg["segment_pool_id"])
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    }


def capture_error_in_own_process(setup: str, capture: str) -> str:
    """Run `setup`, then the one statement `capture`, in a fresh Python; return its stdout.

    A capture that fails on an unjoined side-stream fork leaves the forked stream in capture
    mode for the rest of the process, so such a scenario must not run in the test process.
    `setup` runs after `import torch, cgcompile` and `side = torch.cuda.Stream()`; a
    CaptureError from `capture` is printed as "CaptureError: <message>", and it must name
    the side stream.
    """
    script = (
        f"import torch, cgcompile\nside = torch.cuda.Stream()\n{setup}\n"
        f"try:\n    {capture}\nexcept cgcompile.CaptureError as e:\n    print('CaptureError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "CaptureError:" in result.stdout, result.stdout + result.stderr
    assert "side stream" in result.stdout, result.stdout
    return result.stdout


class FakeGraph:
    """On CPU, a stand-in for a captured CUDA graph: a replay runs the captured function
    again on the captured (static) inputs and writes the captured outputs, so a replay
    that left a buffer unfilled reads what it held before, as on the GPU.

    capturing: True while a fake capture runs (an op may refuse to run then, as a
    host-reading op does under a real capture); replays, captures: counts so far."""

    capturing = False
    replays = 0
    captures = 0

    def __init__(self, fn, args, outputs):
        self.fn, self.args, self.outputs = fn, args, outputs
        FakeGraph.captures += 1

    def replay(self):
        FakeGraph.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.args)):
            out.copy_(new)


def _fake_capture(session, name, fn, make_args):
    args = make_args()
    # A real capture records without running: what the run writes into its inputs is undone.
    saved = [(a, a.clone()) for a in args if isinstance(a, torch.Tensor)]
    FakeGraph.capturing = True
    try:
        outputs = tuple(fn(*args))
    except RuntimeError as e:
        raise cgcompile.CaptureError(f"capturing {name} failed: {e}") from e
    finally:
        FakeGraph.capturing = False
        for tensor, before in saved:
            tensor.copy_(before)
    return FakeGraph(fn, args, outputs), args, outputs


def _zeros_strided(t: torch.Tensor) -> torch.Tensor:
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.new_zeros(span if t.numel() else 0).as_strided(t.shape, t.stride())


def fake_cuda_graphs(monkeypatch) -> None:
    """Make graph pieces run on CPU as on the GPU: the analysis says CUDA graphs are on,
    and captures make `FakeGraph`s. Only the capture itself is faked."""
    from cgcompile import full_graph, graph_piece, phases
    from cgcompile.capture import CaptureSession

    analyse = phases.analyse
    monkeypatch.setattr(phases, "analyse", lambda *a: dataclasses.replace(analyse(*a), cudagraphs=True))
    monkeypatch.setattr(CaptureSession, "capture", _fake_capture)
    monkeypatch.setattr(CaptureSession, "warm_up", lambda session, fn, *args: fn(*args))
    monkeypatch.setattr(graph_piece, "weak_alias", lambda t: t)
    monkeypatch.setattr(full_graph, "weak_alias", lambda t: t)
    # Buffers made for a capture hold zeros, not garbage: the fake capture runs on them
    # (garbage ids would index out of range).
    monkeypatch.setattr(graph_piece, "empty_like_strided", _zeros_strided)
    monkeypatch.setattr(full_graph, "empty_like_strided", _zeros_strided)
    FakeGraph.replays = FakeGraph.captures = 0


def compiled_toy_llama(compiler: str, sizes: tuple[int, ...], n_layers: int = 3, **fields):
    """(model, backend, compiled): a seeded ToyLlama on CUDA, split at the silly op."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    # Frozen: an inference model. With gradients on, a graph whose parameters require grad
    # runs without CUDA graphs (tests/test_training.py).
    model = ToyLlama(n_layers, hidden=64, vocab=128).cuda().requires_grad_(False)
    config = cgcompile.Config(splitting_ops=(SILLY_OP,), compiler=compiler, capture_sizes=sizes, **fields)
    backend = cgcompile.Backend(config)
    return model, backend, torch.compile(model, backend=backend)


def dynamic_ids(n: int) -> torch.Tensor:
    """n token ids on CUDA, dim 0 marked dynamic (the capture dimension)."""
    ids = torch.randint(0, 128, (n,), device="cuda")
    torch._dynamo.mark_dynamic(ids, 0)
    return ids
