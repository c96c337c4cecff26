"""Hugging Face `generate()` through cgcompile on CPU: tiny random models, the default DynamicCache.

What Dynamo does during one `generate()` call (transformers 5.x, torch >= 2.11, default
`dynamic=None`), and so what `backend.stats.graphs_seen` counts:

  graph 0  prefill: input_ids [B, T] and every other size static.
  graph 1  first decode step: input_ids [B, 1] fails graph 0's guard on size T. Size 1
           is specialised, and the cache tensors are new inputs of static length T.
  graph 2  second decode step: the cache length changed (T -> T + 1), so automatic
           dynamic shapes make it a symbol. This graph serves every later step.

So three graphs whatever the number of new tokens, and the same pieces. In graph 2 the
cache concatenation and the attention over it depend on the cache-length symbol and run
eagerly; projections, norms, MLP and lm_head are capturable.

Mistral here (sliding_window=5, prompt 7) has three graphs for another reason. Its cache
layer (transformers' DynamicSlidingWindowLayer.update, the same in 5.17 and 5.23) keeps
`cat([keys, new])[:, :, -(window - 1):]`: 4 positions at every decode step, so no length
changes, but the kept keys are a view into the concatenation, whose strides follow its
length: stride(0) 2 * 7 * 16 = 224 after the prefill, 2 * 5 * 16 = 160 after every decode
step. Decode step 2 fails graph 1's stride guard on `past_key_values.layers[0].keys`, and
graph 2 serves every later step. (On CUDA it is two graphs: see test_cuda_hf.py.)
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import cgcompile

VOCAB = 128
PROMPT_LEN = 7
DECODE_GRAPH = 2  # graph index of the steady-state decode graph (see the module docstring)
_LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)
ARCHS = {
    "llama": lambda layers: LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **_LLAMA_LIKE)),
    "qwen2": lambda layers: Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **_LLAMA_LIKE)),
    # A window shorter than prompt + new tokens, so the sliding-window cache path runs.
    "mistral": lambda layers: MistralForCausalLM(MistralConfig(num_hidden_layers=layers, sliding_window=5, **_LLAMA_LIKE)),
    "gpt2": lambda layers: GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
    ),
}


def tiny_model(arch: str, layers: int = 2):
    torch.manual_seed(0)
    model = ARCHS[arch](layers).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


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


BATCH_SEQUENCE = (1, 3, 1, 4, 1)  # a non-capture batch, a capture batch, and back to 1


def sequence_matches_eager(model, sizes=BATCH_SEQUENCE, new_tokens: int = 16, **config) -> cgcompile.Backend:
    """One compiled model, generate() at each batch in turn with a new prompt each time:
    greedy tokens equal eager's at every call."""
    expected = [generate(model, batch, new_tokens, seed=call) for call, batch in enumerate(sizes)]
    backend = compile_forward(model, **config)
    for call, batch in enumerate(sizes):
        got = generate(model, batch, new_tokens, seed=call)
        assert torch.equal(got, expected[call]), f"call {call} (batch {batch}) differs from eager"
    return backend


def graph_pieces(backend, graph_index):
    return [p for p in backend.pieces if p.graph_index == graph_index]


def targets(piece) -> set[str]:
    return {
        getattr(n.target, "__name__", str(n.target))
        for n in piece.graph.graph.nodes
        if n.op in ("call_function", "call_method")
    }


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_eager(arch, batch):
    backend = compile_and_match_eager(tiny_model(arch), batch)
    assert backend.stats.graphs_seen == 3  # Mistral too, for another reason: see the module docstring
    assert all(p.capturable for p in graph_pieces(backend, DECODE_GRAPH) if "linear" in targets(p))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_one_compiled_model_at_changing_batches_equals_eager(arch):
    # padding=True: the pieces compute on the padded inputs a graph would replay with.
    sequence_matches_eager(tiny_model(arch), padding=True)


@pytest.mark.parametrize("arch, batch", [("llama", 3), ("gpt2", 1)])
def test_sampling_with_a_seed_equals_eager(arch, batch):
    model = tiny_model(arch)
    sample = dict(do_sample=True, top_k=0, top_p=0.9, temperature=0.8)
    torch.manual_seed(123)
    expected = generate(model, batch, 16, **sample)
    compile_forward(model)
    torch.manual_seed(123)
    assert torch.equal(generate(model, batch, 16, **sample), expected)


def test_compiling_the_model_object_in_place():
    # nn.Module.compile() compiles the module's __call__ in place, so generate(),
    # which calls self(...), goes through it.
    model = tiny_model("llama")
    expected = generate(model, 3, 16)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    model.compile(backend=backend)
    assert torch.equal(generate(model, 3, 16), expected)
    assert backend.stats.graphs_seen == 3


def test_the_readme_first_line_compiles_what_generate_calls():
    # The README's first example, as written: the string backend, compiled in place.
    model = tiny_model("llama")
    expected = generate(model, 1, 8)
    model.compile(backend="cgcompile", options={"compiler": "eager"})
    assert torch.equal(generate(model, 1, 8), expected)
    assert cgcompile.backend_of(model).stats.graphs_seen == 3


def test_generate_of_a_torch_compile_wrapper_runs_eagerly():
    # torch.compile(model) returns an OptimizedModule; its .generate is the original
    # model's bound method, which calls the original, uncompiled model. Documented
    # in docs/transformers.md: compile model.forward or use model.compile(...).
    model = tiny_model("llama")
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    wrapper = torch.compile(model, backend=backend)
    wrapper.generate(*prompt(1)[:1], max_new_tokens=2)
    assert backend.stats.graphs_seen == 0


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_count_does_not_depend_on_token_count(batch):
    stats = {}
    for new_tokens in (32, 128):
        torch._dynamo.reset()
        model = tiny_model("llama")
        backend = compile_forward(model)
        generate(model, batch, new_tokens)
        stats[new_tokens] = backend.stats
        # A second call with the same prompt shape reuses all three graphs.
        generate(model, batch, new_tokens)
        assert backend.stats == stats[new_tokens]
    assert stats[32] == stats[128]
    assert stats[128].graphs_seen == 3
    assert stats[128].compilations == 0 and stats[128].graphs_captured == 0  # compiler="eager", CPU


@pytest.mark.parametrize("layers", [2, 3])
def test_decode_graph_pieces_batch_1(layers):
    model = tiny_model("llama", layers)
    backend = compile_forward(model)
    generate(model, 1, 4)
    decode = graph_pieces(backend, DECODE_GRAPH)
    # Per layer: [capturable: norm, q/k/v projections, rotary] [eager: cache cat, attention];
    # the last capturable piece also holds the final norm and lm_head.
    assert [p.capturable for p in decode] == [i % 2 == 0 for i in range(2 * layers + 1)]
    for piece in decode:
        if piece.capturable:
            assert "linear" in targets(piece)
        else:
            assert {"cat", "scaled_dot_product_attention"} <= targets(piece)
            assert "[dynamic_shape]" in piece.reason and "[split_op]" in piece.reason
    assert any("silu" in targets(p) for p in decode if p.capturable)


def test_inductor_compiles_a_fixed_number_of_pieces():
    # Each distinct capturable piece of the three graphs is compiled once: the first
    # piece (embedding, first layer's projections), the layer-to-layer piece and the
    # last piece (final norm, lm_head) of each graph, less those graph 1 and graph 2 share.
    model = tiny_model("llama")
    backend = compile_and_match_eager(model, 1, 32, compiler="inductor")
    after_32 = backend.stats
    assert (after_32.graphs_seen, after_32.capturable_pieces, after_32.compilations) == (3, 9, 8)
    generate(model, 1, 128)
    assert backend.stats == after_32


def test_decode_graph_pieces_batch_3_with_padding():
    # With a padding mask, building the 4-d mask over the cache length adds eager
    # pieces (and small capturable ones between them) before the first layer.
    model = tiny_model("llama", 3)
    backend = compile_forward(model)
    generate(model, 3, 4)
    decode = graph_pieces(backend, DECODE_GRAPH)
    assert (len(decode), sum(p.capturable for p in decode)) == (13, 7)
    layers = [p for p in decode if "grouped_query_attention" in targets(p)]
    assert len(layers) == 3 and not any(p.capturable for p in layers)
    assert all(p.capturable for p in decode if "linear" in targets(p))
    # With a mask, transformers repeats the KV heads (repeat_kv: expand, reshape) for
    # SDPA; the grouped-query fold reads the cache itself, so no repeat runs eagerly.
    assert not any({"expand", "reshape"} & targets(p) for p in layers)
    assert not any("scaled_dot_product_attention" in targets(p) for p in decode)


def test_grouped_query_fold_off_keeps_repeat_kv_and_tokens_equal_eager():
    backend = compile_and_match_eager(tiny_model("llama"), 3, fold_grouped_query=False)
    layers = [p for p in graph_pieces(backend, DECODE_GRAPH) if "scaled_dot_product_attention" in targets(p)]
    assert layers and all({"expand", "reshape"} <= targets(p) for p in layers)


@pytest.mark.parametrize(
    "config, prefill_split",
    [
        ({}, (9, 4)),  # no capture dimension: every piece that depends on the length is eager
        ({"capture_input": "input_ids", "capture_input_dim": 1}, (5, 3)),  # only attention is eager
    ],
)
def test_new_prompt_length_adds_one_graph(config, prefill_split):
    # The second prompt length makes Dynamo compile the prefill with a symbolic length;
    # every later length reuses it, and the decode graph is shared by all of them.
    reference, model = tiny_model("llama"), tiny_model("llama")
    backend = compile_forward(model, **config)
    for length in (7, 9, 12):
        ids = torch.randint(3, VOCAB, (1, length))
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    assert backend.stats.graphs_seen == 4
    prefill = graph_pieces(backend, 3)
    assert (len(prefill), sum(p.capturable for p in prefill)) == prefill_split


def test_benchmark_smoke_on_cpu(tmp_path):
    bench = pathlib.Path(__file__).parent.parent / "benchmarks" / "hf_bench.py"
    command = [sys.executable, str(bench), "--tiny", "--device", "cpu", "--batches", "1,2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads((tmp_path / "hf_bench.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for b in (1, 2) for v in ("eager", "cgcompile", "static")]
    for row in rows:
        if row["variant"] == "static":
            assert row["error"].startswith("skipped: needs CUDA")
        else:
            # The decode rate is a difference of two generate() timings: on a busy CPU it can
            # come out negative, so the smoke test asks only for a number.
            assert row["error"] is None and math.isfinite(row["decode_tok_s"])
    cgcompile_rows = [r for r in rows if r["variant"] == "cgcompile"]
    # All tokens, prompt (16) and new (16), equal eager's: "32B/32B" for batch B.
    assert all(r["tokens_equal_eager"] == f"{32 * r['batch']}/{32 * r['batch']}" for r in cgcompile_rows)
    # The benchmark's cgcompile runs with KV_CACHE_SOURCES dynamic (the README's recipe): two graphs.
    assert all(r["cgcompile_stats"]["graphs_seen"] == 2 for r in cgcompile_rows)


# The README's optional line for transformers users: every dimension of the cache tensors
# (Dynamo sources under `past_key_values`) is a symbol from the first time Dynamo sees them.
KV_CACHE_SOURCES = r".*past_key_values.*"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_dynamic_cache_sources_make_two_graphs(arch, batch):
    # The first decode step already sees a symbolic cache length, so its graph is the one
    # every later step uses: prefill + decode. (The batch and head sizes, also marked,
    # are specialised again by the cache concatenation's shape checks.)
    with torch.compiler.config.patch(dynamic_sources=KV_CACHE_SOURCES):
        model = tiny_model(arch)
        backend = compile_and_match_eager(model, batch)
        after_16 = backend.stats
        generate(model, batch, 64)
    assert after_16.graphs_seen == 2 and backend.stats == after_16
    decode = graph_pieces(backend, 1)
    assert all(p.capturable for p in decode if "linear" in targets(p))
    assert all(not p.capturable for p in decode if "scaled_dot_product_attention" in targets(p))

