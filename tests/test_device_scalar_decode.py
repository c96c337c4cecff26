"""Host ints read from a device buffer (`passes.device_scalars`, `run.device_scalars`):
transformers' sliding-window StaticCache keeps its length as a Python int that grows
every step, and its mask reads `max(length - window + 1, 0)` only as a value. With the
int read from the buffer, every decode step after the first of its graph takes the full
path (on CUDA: replays one captured graph), and its results equal eager's."""

import pytest
import torch

import cgcompile
from cgcompile.testing.hf_models import tiny_model

WINDOW = 8
STEPS = 10


def tiny_mistral(device="cpu"):
    return tiny_model("mistral", sliding_window=WINDOW, max_position_embeddings=64, device=device)


def decode(model, prompt_len: int, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and last-position logits of a prefill and `steps` decode steps, with a
    StaticCache (its sliding layers roll once prompt + steps exceed the window)."""
    from transformers import StaticCache

    device = model.device
    cache = StaticCache(config=model.config, max_cache_len=32)
    ids = ((torch.arange(prompt_len, device=device) * 7 + 1) % 128).view(1, prompt_len)
    tokens, logits = [], []
    with torch.no_grad():
        for step in range(steps + 1):
            start = 0 if step == 0 else prompt_len + step - 1
            positions = torch.arange(start, start + ids.shape[1], device=device)
            last = model(ids, past_key_values=cache, cache_position=positions, use_cache=True).logits[:, -1]
            ids = last.argmax(-1, keepdim=True)
            tokens.append(ids)
            logits.append(last)
    return torch.cat(tokens, 1), torch.stack(logits)


def compiled_mistral(device="cpu", **fields):
    model = tiny_mistral(device)
    backend = cgcompile.Backend(cgcompile.Config(**fields))
    model.forward = torch.compile(model.forward, backend=backend)
    return model, backend


def decode_graphs(backend):
    """The runtimes of the decode graphs: those whose full graph reads host ints from the device."""
    return [rt for rt in backend.runtimes if rt.full is not None and rt.full.plan.device_scalars]


@pytest.mark.parametrize("prompt_len", [16, 5])  # full from the first step; filling during the decode
def test_sliding_window_decode_takes_the_full_path_and_matches_eager(prompt_len):
    want_tokens, want_logits = decode(tiny_mistral(), prompt_len)
    model, backend = compiled_mistral(compiler="eager", capturable_split_ops=("attention",))
    tokens, logits = decode(model, prompt_len)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    graphs = decode_graphs(backend)
    # The cache's "is full" is a Python bool Dynamo guards: one decode graph before the
    # window fills, one after. Each runs piecewise at its first call only.
    assert len(graphs) == (1 if prompt_len >= WINDOW else 2)
    for runtime in graphs:
        plan = runtime.full.plan
        assert plan.host_values == () and len(plan.device_scalars) == model.config.num_hidden_layers
        assert dict(runtime.full.reasons) == {"first call of its size": 1}
    stats = backend.stats
    assert stats.full_graph_calls == STEPS - len(graphs) and stats.piecewise_calls == len(graphs)


def offset_positions(x, n):
    return (torch.arange(8) + max(n - 8 + 1, 0)) * x, n + 1


@pytest.mark.usefixtures("one_thread")
def test_an_inductor_piece_reads_the_buffer_at_every_call():
    # Inductor inlines 0-d constants of a graph (`.item()` at compile time): the buffer
    # is a graph input for that reason, and a compiled piece must see each call's value.
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", capturable_split_ops=("attention",)))
    compiled = torch.compile(offset_positions, backend=backend)
    x = torch.randn(8)
    for n in (3, 12, 20, 9, 40):
        got, want = compiled(x, n), offset_positions(x, n)
        torch.testing.assert_close(got[0], want[0])
        assert got[1] == want[1]
    assert any(rt.full is not None and rt.full.plan.device_scalars for rt in backend.runtimes)


# ---- CUDA ----

@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("prompt_len", [16, 5])
@pytest.mark.parametrize("compiler, whole", [("inductor", False), ("eager", True)])
def test_sliding_window_decode_replays_one_full_graph_on_cuda(prompt_len, compiler, whole):
    """Automatic full graphs (the default with CUDA graphs): after each decode graph's
    first call (piecewise) and its capture (the second), every step replays it, and the
    cache length the graph returns to transformers is the call's, not the capture's."""
    want_tokens, want_logits = decode(tiny_mistral("cuda"), prompt_len)
    whole_graph = {"full_graph_compile": True, "capturable_split_ops": ("attention",)} if whole else {}
    model, backend = compiled_mistral("cuda", compiler=compiler, **whole_graph)
    tokens, logits = decode(model, prompt_len)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    graphs = decode_graphs(backend)
    assert len(graphs) == (1 if prompt_len >= WINDOW else 2), backend.stats
    for runtime in graphs:
        assert runtime.full.graphs, "no full graph was captured"
        assert dict(runtime.full.reasons) == {"first call of its size": 1}
    stats = backend.stats
    assert stats.graphs_captured > 0
    assert stats.full_graph_calls == STEPS - len(graphs) and stats.piecewise_calls == len(graphs)
