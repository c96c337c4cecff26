"""Hugging Face generate() through cgcompile on CUDA, with CUDA graphs. GPU machine only.

The models, prompts and the one-line change come from test_hf_generate.py (CPU tier);
here the capturable pieces are replayed from CUDA graphs. Every graph Dynamo compiles
during generate() is static (input_ids is [B, 1] in decode; the cache length lives only
in eager pieces), so each capturable piece is captured exactly once and replayed for
every later token.
"""

import pytest
import torch

from test_hf_generate import (
    ARCHS,
    KV_CACHE_SOURCES,
    PROMPT_LEN,
    compile_and_match_eager,
    compile_forward,
    generate,
    prompt,
    sequence_matches_eager,
    tiny_model,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("exact_fp32_matmuls"),
]




# Dynamo graphs per generate() (test_hf_generate.py's docstring says which three), Mistral
# included: its sliding-window cache keeps `cat([keys, new])[:, :, -(window - 1):]`, a view
# whose strides follow the concatenation's length, so decode step 2 fails graph 1's stride
# guard. On CUDA that view shares a captured piece's output memory, and the runtime returns
# it as a copy with the view's own strides (cgcompile/runtime.py, `copy_with_strides`): the
# same layout as eager's, hence the same graphs.
GRAPHS_SEEN = {"llama": 3, "qwen2": 3, "mistral": 3, "gpt2": 3}


def cuda_model(arch: str, dtype=torch.float32):
    return tiny_model(arch).to("cuda", dtype)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_equal_eager_with_graphs(arch, batch):
    stats = compile_and_match_eager(cuda_model(arch), batch).stats
    assert stats.graphs_seen == GRAPHS_SEEN[arch]
    assert stats.graphs_captured == stats.capturable_pieces > 0  # one graph per capturable piece


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("arch", ["mistral", "llama"])
def test_one_compiled_model_at_changing_batches_equals_eager(arch, compiler):
    # Mistral's sliding-window cache keeps a view of each step's keys; at batch 1, 3, 1
    # it once kept graph memory that later graphs overwrote (tests/test_output_aliases.py).
    sequence_matches_eager(cuda_model(arch), compiler=compiler)


def test_captures_do_not_grow_with_tokens():
    model = cuda_model("llama")
    expected = generate(model, 1, 64)
    backend = compile_forward(model)
    generate(model, 1, 16)
    after_16 = backend.stats
    assert torch.equal(generate(model, 1, 64), expected)
    assert backend.stats == after_16


def test_fp32_sampling_with_a_seed_equals_eager():
    model = cuda_model("llama")
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


@pytest.mark.parametrize("compiler, batch", [("eager", 3), ("inductor", 1)])
def test_bf16_logits_close_to_eager(compiler, batch):
    # bf16 greedy tokens may part ways at a near tie, so compare the logits of every
    # step, prefill and both decode graphs, against eager on the same tokens.
    model = cuda_model("llama", torch.bfloat16)
    compile_forward(model, compiler=compiler)
    out = generate(model, batch, 8, output_logits=True, return_dict_in_generate=True)
    got = torch.stack(out.logits, dim=1).float()  # [B, 8, V]
    del model.forward  # the class's forward again: eager
    want = teacher_forced_logits(model, out.sequences, prompt(batch)[1].cuda()).float()
    scale = want.abs().amax()
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * scale.item())


@pytest.mark.parametrize("batch", [1, 3])
def test_inductor_pieces_with_dynamic_cache_sources_make_two_graphs(batch):
    # The README's recipe. Inductor lays the prefill's cache concatenation out
    # [B, T, H, D]-major, eager contiguous. The runtime copies graph outputs out in eager's
    # layout; returned in Inductor's, the first decode step would guard on that layout and
    # the second (eager cat, contiguous) would make Dynamo compile a third graph.
    with torch.compiler.config.patch(dynamic_sources=KV_CACHE_SOURCES):
        model = cuda_model("llama")
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
