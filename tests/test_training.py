"""Training through a compiled model: a graph that needs gradients runs without CUDA graphs.

A backward reads what autograd saved in the forward (the labels of a cross-entropy, the
ids of an embedding, activations); under CUDA graphs those are static buffers and pool
memory that the next copy or replay overwrites. So a graph compiled with gradients
enabled runs its pieces compiled but uncaptured (`phases.without_graphs_for_autograd`),
and inference (no_grad, inference_mode, frozen parameters) still captures.

On the CPU through fake graphs (`fake_graphs.fake_cuda_graphs`): the capture path runs as on
the GPU, and a fake capture of a piece whose inputs need gradients fails.
"""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgcompile
from cgcompile.build.phases import NEEDS_GRADIENTS
from cgcompile.testing import fake_graphs
from cgcompile.testing.models import SILLY_OP, ToyLlama

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 32
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


class TinyLM(nn.Module):
    """Embedding, attention (split: an eager piece), a head and the cross-entropy of labels."""

    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, VOCAB)
        self.heads = heads

    def forward(self, ids, labels):  # ids, labels: [B, T]
        x = self.embed(ids)  # [B, T, H]
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, H / heads]
        x = x + self.out(a.transpose(1, 2).reshape(b, t, h))
        logits = self.head(x)  # [B, T, V]
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def _models():
    """(eager, compiled model, its backend): two TinyLMs with equal weights."""
    torch.manual_seed(0)
    model, eager = TinyLM(), TinyLM()
    eager.load_state_dict(model.state_dict())
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    return eager, torch.compile(model, backend=backend), backend


def _batch(seed, length=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, length), generator=g), torch.randint(0, VOCAB, (2, length), generator=g)


def _assert_same_step(eager, compiled, batch):
    """One forward and backward of each; the loss and every parameter's gradient agree."""
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
    loss = compiled(*batch)
    loss.backward()
    expected = eager(*batch)
    expected.backward()
    torch.testing.assert_close(loss, expected, **TIGHT)
    for (name, p), (_, q) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, **TIGHT, msg=lambda m: f"{name}: {m}")


def test_training_matches_eager_without_capturing(monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    eager, compiled, backend = _models()
    for seed in (1, 2):  # the second step replays nothing the first one left
        _assert_same_step(eager, compiled, _batch(seed))
    assert fake_graphs.FakeGraph.captures == 0
    assert backend.stats.uncaptured_graphs == {NEEDS_GRADIENTS: backend.stats.graphs_seen}
    graph_pieces = [p for p in backend.pieces if p.capturable]
    assert graph_pieces and all(p.uncaptured == NEEDS_GRADIENTS for p in graph_pieces)


def test_the_dump_says_why_a_training_graph_is_not_captured(monkeypatch):
    from cgcompile.tools import dump

    fake_graphs.fake_cuda_graphs(monkeypatch)
    eager, compiled, backend = _models()
    _assert_same_step(eager, compiled, _batch(1))
    summary = dump.summarize(0, backend.pieces)
    capturable = [p for p in summary["pieces"] if p["capturable"]]
    assert capturable and all(p["uncaptured"] == NEEDS_GRADIENTS for p in capturable)
    assert NEEDS_GRADIENTS in dump.format_summary(summary)


def test_training_after_inference_runs_its_own_graph(monkeypatch):
    """Dynamo guards the grad mode: the no_grad graph captures, the training one does not."""
    fake_graphs.fake_cuda_graphs(monkeypatch)
    eager, compiled, backend = _models()
    with torch.no_grad():
        for seed in (3, 4):
            torch.testing.assert_close(compiled(*_batch(seed)), eager(*_batch(seed)), **TIGHT)
    captured = fake_graphs.FakeGraph.captures
    assert captured > 0
    _assert_same_step(eager, compiled, _batch(5))
    assert fake_graphs.FakeGraph.captures == captured
    assert backend.stats.graphs_seen == 2 and sum(backend.stats.uncaptured_graphs.values()) == 1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen parameters"])
def test_inference_still_captures(mode, monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    eager, compiled, backend = _models()
    if mode == "frozen parameters":
        compiled.requires_grad_(False)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context():
        for seed in (6, 7, 8):
            torch.testing.assert_close(compiled(*_batch(seed)), eager(*_batch(seed)), **TIGHT)
    assert fake_graphs.FakeGraph.captures > 0 and fake_graphs.FakeGraph.replays > 0
    assert backend.stats.uncaptured_graphs == {}
    assert all(p.uncaptured is None for p in backend.pieces)


def test_tiny_llama_string_backend_trains_like_eager(monkeypatch):
    """transformers' test_torch_compile_for_training, on CPU with fake graphs."""
    fake_graphs.fake_cuda_graphs(monkeypatch)
    eager, model = _tiny_llama("cpu")
    compiled = torch.compile(model, backend="cgcompile", options={"compiler": "eager"})
    _train_two_steps(eager, model, compiled, "cpu", TIGHT)
    assert fake_graphs.FakeGraph.captures == 0
    stats = cgcompile.backend_of(compiled).stats
    assert stats.uncaptured_graphs == {NEEDS_GRADIENTS: stats.graphs_seen}


@pytest.mark.cuda
def test_tiny_llama_trains_like_eager_on_cuda(exact_fp32_matmuls):
    """transformers' LlamaModelTest::test_torch_compile_for_training with backend="cgcompile"
    (Inductor pieces): two steps with an optimizer step between."""
    eager, model = _tiny_llama("cuda")
    compiled = torch.compile(model, backend="cgcompile")
    _train_two_steps(eager, model, compiled, "cuda", {"rtol": 1e-4, "atol": 1e-5})
    backend = cgcompile.backend_of(compiled)
    assert backend.stats.graphs_captured == 0 and backend.stats.uncaptured_graphs
    with torch.no_grad():  # inference of the same compiled model still captures
        for _ in range(2):
            ids = torch.randint(0, 99, (2, 10), device="cuda")
            torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-5)
    assert backend.stats.graphs_captured > 0


def _tiny_llama(device):
    """(eager, model): two tiny Llamas with equal weights, in train mode (transformers' test config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device).train()
    eager = LlamaForCausalLM(config).to(device).train()
    eager.load_state_dict(model.state_dict())
    return eager, model


def _train_two_steps(eager, model, compiled, device, tolerance):
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids, labels = (torch.randint(0, 99, (2, 10), generator=g).to(device) for _ in range(2))
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=labels).loss
        loss.backward()
        expected = eager(input_ids=ids, labels=labels).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, **tolerance)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m: f"{name}: {m}")
        for opt in optimizers:
            opt.step()


# -- breakable graphs: a call that needs gradients runs eagerly --------------------------


def _breakable(model):
    config = cgcompile.Config(splitting_ops=(SILLY_OP,), capture_sizes=(1, 2, 4, 8), use_breakable=True,
                              padding=True)
    return cgcompile.GraphManager(model, config, segments="op_replay")


def test_breakable_call_that_needs_gradients_runs_eagerly_and_trains_like_eager(caplog):
    torch.manual_seed(0)  # no split op: the toy's has no autograd formula
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 64))
    reference = copy.deepcopy(model)
    manager = _breakable(model)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for step in range(3):
            ids = torch.randint(0, 64, (3,))
            out = manager.run_pw_graph(model, (ids,))
            expected = reference(ids)
            torch.testing.assert_close(out, expected)
            out.square().mean().backward()
            expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    (runner,) = manager.breakable.runners
    assert runner.graph_count() == 0
    assert sum("needs gradients runs eagerly" in r.message for r in caplog.records) == 1


def test_breakable_replay_under_no_grad_is_unchanged():
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=32, vocab=64)
    manager = _breakable(model)
    ids = torch.randint(0, 64, (3,))
    with torch.no_grad():
        for _ in range(3):
            out = manager.run_pw_graph(model, (ids,))
        torch.testing.assert_close(out, model(ids))
    assert manager.breakable.runners[0].graph_count() == 1 and not out.requires_grad
