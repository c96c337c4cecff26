"""Hugging Face `generate()` through cgcompile: tiny random models, the default DynamicCache. The
CPU tests first; the CUDA tests (marked `cuda`) replay the capturable pieces from CUDA graphs.

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
graph 2 serves every later step. (On CUDA it is two graphs: see the CUDA tests below.)
"""

import importlib
import json
import math
import pathlib
import re

import pytest
import torch
from transformers import DynamicCache

import cgcompile
from cgcompile.testing.fake_graphs import fake_cuda_graphs
from cgcompile.testing.hf_models import (
    ARCHS,
    PROMPT_LEN,
    VOCAB,
    compile_and_match_eager,
    compile_forward,
    generate,
    prompt,
    tiny_llama,
    tiny_model,
)

DECODE_GRAPH = 2  # graph index of the steady-state decode graph (see the module docstring)


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
    # padding=True: the pieces compute on the padded inputs a graph would replay with. 8 new
    # tokens: past the first decode steps' graphs (and Mistral's window of 5), the decode graph
    # that serves every later step has run 6 times a call.
    sequence_matches_eager(tiny_model(arch), new_tokens=8, padding=True)


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
    for new_tokens in (8, 32):  # graph 2 serves every decode step from the second on: both counts reach it
        torch._dynamo.reset()
        model = tiny_model("llama")
        backend = compile_forward(model)
        generate(model, batch, new_tokens)
        stats[new_tokens] = backend.stats
        # A second call with the same prompt shape reuses all three graphs.
        generate(model, batch, new_tokens)
        assert backend.stats == stats[new_tokens]
    assert stats[8] == stats[32]
    assert stats[32].graphs_seen == 3
    assert stats[32].compilations == 0 and stats[32].graphs_captured == 0  # compiler="eager", CPU


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


def test_benchmark_smoke_on_cpu(tmp_path, bench_main, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench_main("hf_bench", ["--tiny", "--device", "cpu", "--batches", "1,2"]) is None  # raises on failure
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


def test_benchmark_greedy_loop_smoke_on_cpu(tmp_path, bench_main, monkeypatch):
    """--loop: the hand-written greedy loop (no generate()) gives eager's tokens on every path."""
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--tiny", "--device", "cpu", "--loop", "--batches", "2", "--variants", "eager,cgcompile,breakable",
            "--rounds", "1", "--long-tokens", "8"]
    assert bench_main("hf_bench", argv) is None  # raises on failure
    report = json.loads((tmp_path / "hf_bench.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert all(r["error"] is None for r in rows.values()), [r["error"] for r in rows.values()]
    assert rows["cgcompile"]["tokens_equal_eager"] == rows["breakable"]["tokens_equal_eager"] == "64/64"
    assert rows["cgcompile"]["cgcompile_stats"]["graphs_seen"] == 2  # prefill and decode, as with generate()
    # 8 new tokens: 7 decode steps, clocked after each: 6 intervals, one a window.
    assert len(rows["breakable"]["long_decode_tok_s_windows"]) == 6
    assert {t["target"] for t in report["targets"]} >= {"breakable / cgcompile"}


# benchmarks/hf_families.py's families beside Llama (the smoke tests above), each with what
# makes it differ from a Llama at the tiny shape: a rolling 8-token window under a 16-token
# prompt, soft-capping with eager attention, 2 of 16 experts per token.
BENCH_FAMILIES = {
    "qwen2": {},
    "mistral": {"sliding_window": 8, "sliding_layers": 2},
    "gemma2": {"sliding_window": 8, "sliding_layers": 1, "attention": "eager"},
    "qwen3_moe": {"experts": 16, "experts_per_token": 2},
}


@pytest.mark.parametrize("family", list(BENCH_FAMILIES))
def test_benchmark_family_smoke_on_cpu(family, tmp_path, monkeypatch):
    """--family: the static cache under the default Config gives eager's tokens. In this
    process, where torch and transformers are imported already (a subprocess per family
    would spend most of its time importing them)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    monkeypatch.setenv("OUT", str(tmp_path))
    hf_bench = importlib.import_module("hf_bench")
    argv = ["--tiny", "--device", "cpu", "--family", family, "--variants", "eager,cgcompile-static-default",
            "--batches", "1", "--rounds", "1", "--new-tokens", "4"]
    threads = torch.get_num_threads()  # --tiny on the CPU runs one thread
    try:
        hf_bench.main(argv)
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    report = json.loads((tmp_path / "hf_bench.json").read_text())
    assert report["environment"]["family"] == report["floor"]["model"]["family"] == family
    assert BENCH_FAMILIES[family].items() <= report["floor"]["model"].items()
    rows = {r["variant"]: r for r in report["rows"]}
    assert all(r["error"] is None for r in rows.values()), [r["error"] for r in rows.values()]
    assert rows["cgcompile-static-default"]["tokens_equal_eager"] == "20/20"  # prompt 16 + 4 new tokens


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


# A tiny Llama decoding token by token with a DynamicCache, through backend="cgcompile".

PROMPT = [[1, 5, 9, 17]]
STEPS = 5


@torch.no_grad()
def greedy_logits(model, config) -> list[torch.Tensor]:
    """Prefill the prompt, then decode STEPS tokens one at a time; the logits of every call."""
    out = model(input_ids=torch.tensor(PROMPT), past_key_values=DynamicCache(config=config), use_cache=True)
    logits = [out.logits]
    for _ in range(STEPS):
        token = out.logits[:, -1:].argmax(-1)  # [1, 1]
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    return logits


@pytest.fixture(scope="module")
def decoded():
    model = tiny_llama()
    expected = greedy_logits(model, model.config)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    got = greedy_logits(torch.compile(model, backend=backend), model.config)
    return expected, got, backend


def test_logits_equal_eager(decoded):
    expected, got, _ = decoded
    assert len(got) == STEPS + 1
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"step {step}: {m}")


def test_decode_graph_splits_at_attention_and_cache(decoded):
    _, _, backend = decoded
    # Prefill, the first decode step (cache length still static), then one graph for
    # every later step: Dynamo makes the cache length dynamic on the second decode step.
    assert backend.stats.graphs_seen == 3
    decode = [p for p in backend.pieces if p.graph_index == 2]

    def targets(piece):
        return {getattr(n.target, "__name__", str(n.target)) for n in piece.graph.graph.nodes
                if n.op in ("call_function", "call_method")}

    for piece in decode:
        if piece.capturable:
            # input_ids is [1, 1], so there is no capture dimension: capturable pieces
            # must see no symbolic size (the cache length) at all, not even as a scalar.
            assert not any(re.search(r"\b[su]\d+", s) for s in piece.input_shapes), piece.input_shapes
        else:
            rules = {r.rsplit("[", 1)[1].rstrip("]") for r in piece.reason.split("; ")}
            assert rules <= {"split_op", "dynamic_shape", "dynamic_scalar"}, piece.reason

    attention = [p for p in decode if "scaled_dot_product_attention" in targets(p)]
    assert len(attention) == 2  # one per layer
    for piece in attention:
        # The KV-cache concatenation and the attention over it share one eager piece.
        assert "cat" in targets(piece)
        assert "[dynamic_shape]" in piece.reason and "[split_op]" in piece.reason
    linears = [p for p in decode if "linear" in targets(p)]
    assert linears and all(p.capturable for p in linears)  # projections, MLP, lm_head
    assert any("silu" in targets(p) for p in linears)


def test_prefill_captures_over_the_prompt_length():
    # input_ids is [1, T]: the default rule looks at dimension 0 only, so name dimension 1.
    model = tiny_llama()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_input="input_ids", capture_input_dim=1))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for length in (4, 7, 9):  # the second length makes Dynamo compile a dynamic graph
            ids = torch.randint(0, 128, (1, length))
            got = compiled(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
            want = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
            torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert backend.stats.graphs_seen == 2
    dynamic = [p for p in backend.pieces if p.graph_index == 1]
    assert [p.capturable for p in dynamic] == [True, False, True, False, True]  # 2 layers: 2N+1 pieces
    assert all(p.reason.endswith("split by default (attention) [split_op]") for p in dynamic if not p.capturable)


# ---- CUDA: the capturable pieces replayed from CUDA graphs ----
# Every graph Dynamo compiles during generate() is static (input_ids is [B, 1] in decode;
# the cache length lives only in eager pieces), so each capturable piece is captured
# exactly once and replayed for every later token.

# Dynamo graphs per generate() (the module docstring says which three), Mistral
# included: its sliding-window cache keeps `cat([keys, new])[:, :, -(window - 1):]`, a view
# whose strides follow the concatenation's length, so decode step 2 fails graph 1's stride
# guard. On CUDA that view shares a captured piece's output memory, and the runtime returns
# it as a copy with the view's own strides (cgcompile/run/runtime.py, `copy_with_strides`): the
# same layout as eager's, hence the same graphs.
GRAPHS_SEEN = {"llama": 3, "qwen2": 3, "mistral": 3, "gpt2": 3}


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_equal_eager_with_graphs(arch, batch):
    stats = compile_and_match_eager(tiny_model(arch, device="cuda"), batch).stats
    assert stats.graphs_seen == GRAPHS_SEEN[arch]
    assert stats.graphs_captured == stats.capturable_pieces > 0  # one graph per capturable piece


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("arch", ["mistral", "llama"])
def test_one_compiled_model_at_changing_batches_equals_eager_on_cuda(arch, compiler):
    # Mistral's sliding-window cache keeps a view of each step's keys; at batch 1, 3, 1
    # it once kept graph memory that later graphs overwrote (tests/test_output_aliases.py).
    sequence_matches_eager(tiny_model(arch, device="cuda"), compiler=compiler)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_captures_do_not_grow_with_tokens():
    model = tiny_model("llama", device="cuda")
    expected = generate(model, 1, 64)
    backend = compile_forward(model)
    generate(model, 1, 16)
    after_16 = backend.stats
    assert torch.equal(generate(model, 1, 64), expected)
    assert backend.stats == after_16


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_fp32_sampling_with_a_seed_equals_eager():
    model = tiny_model("llama", device="cuda")
    sample = dict(do_sample=True, top_k=0, top_p=0.9, temperature=0.8)
    torch.manual_seed(123)
    expected = generate(model, 3, 16, **sample)
    compile_forward(model)
    torch.manual_seed(123)
    assert torch.equal(generate(model, 3, 16, **sample), expected)


def teacher_forced_logits(model, sequences: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eager logits [B, N, V] for every generated token of `sequences`, in one forward pass.

    Logits at position t predict token t + 1, so the N new tokens are predicted by
    positions PROMPT_LEN - 1 .. PROMPT_LEN + N - 2. Position ids as generate() makes them.
    """
    new_tokens = sequences.shape[1] - PROMPT_LEN
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new_tokens)], dim=1)
    position_ids = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask, position_ids=position_ids).logits
    return logits[:, PROMPT_LEN - 1 : -1]


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("compiler, batch", [("eager", 3), ("inductor", 1)])
def test_bf16_logits_close_to_eager(compiler, batch):
    # bf16 greedy tokens may part ways at a near tie, so compare the logits of every
    # step, prefill and both decode graphs, against eager on the same tokens.
    model = tiny_model("llama", device="cuda", dtype=torch.bfloat16)
    compile_forward(model, compiler=compiler)
    out = generate(model, batch, 8, output_logits=True, return_dict_in_generate=True)
    got = torch.stack(out.logits, dim=1).float()  # [B, 8, V]
    del model.forward  # the class's forward again: eager
    want = teacher_forced_logits(model, out.sequences, prompt(batch)[1].cuda()).float()
    scale = want.abs().amax()
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * scale.item())


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("batch", [1, 3])
def test_inductor_pieces_with_dynamic_cache_sources_make_two_graphs(batch):
    # The README's recipe. Inductor lays the prefill's cache concatenation out
    # [B, T, H, D]-major, eager contiguous. The runtime copies graph outputs out in eager's
    # layout; returned in Inductor's, the first decode step would guard on that layout and
    # the second (eager cat, contiguous) would make Dynamo compile a third graph.
    with torch.compiler.config.patch(dynamic_sources=KV_CACHE_SOURCES):
        model = tiny_model("llama", device="cuda")
        backend = compile_forward(model, compiler="inductor")
        out = generate(model, batch, 16, output_logits=True, return_dict_in_generate=True)
        after_16 = backend.stats
        generate(model, batch, 32)
    assert after_16.graphs_seen == 2
    assert after_16.graphs_captured == after_16.capturable_pieces > 0
    assert backend.stats == after_16
    got = torch.stack(out.logits, dim=1)
    del model.forward  # eager again
    want = teacher_forced_logits(model, out.sequences, prompt(batch)[1].cuda())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().amax().item())



def test_a_full_graph_captured_at_the_second_prefill_hands_out_eager_layouts(monkeypatch):
    """The default's full graph of the prefill is captured at the second generate() (same
    size, same host values). The capturing call's results come from the pieces' code, and
    Inductor lays the cache `cat` out [B, T, H, D]-major: handed out so, the decode graph's
    stride guard would fail and Dynamo compile a third graph. On CPU through fake graphs."""
    fake_cuda_graphs(monkeypatch)
    with torch.compiler.config.patch(dynamic_sources=KV_CACHE_SOURCES):
        model = tiny_model("llama")
        backend = compile_forward(model, compiler="inductor")
        generate(model, 1, 16)
        generate(model, 1, 32)
    assert backend.stats.full_graph_choices == {"automatic: CUDA graphs are on": 2}
    assert backend.stats.full_graph_calls >= 1  # the second prefill: captured
    assert backend.stats.graphs_seen == 2
