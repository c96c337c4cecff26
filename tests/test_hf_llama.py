"""A tiny random Hugging Face Llama decodes with a DynamicCache through backend="cgcompile"."""

import re

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import cgcompile

PROMPT = [[1, 5, 9, 17]]
STEPS = 5


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


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
