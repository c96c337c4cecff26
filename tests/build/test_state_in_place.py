"""Graph inputs a graph writes in place (a KV cache not marked static) are read and written
at their own address, so the writes are captured with the pieces around them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgcompile
from cgcompile.testing import fake_graphs

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


class CacheStep(nn.Module):
    """One decode step over a cache the caller holds: project, write the row in, attend."""

    def __init__(self):
        super().__init__()
        self.key = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x, cache, position):  # x [1, 8], cache [1, 1, 16, 8], position [1]
        k = self.key(x).tanh()
        cache.index_copy_(2, position, k.view(1, 1, 1, 8))
        attended = F.scaled_dot_product_attention(x.view(1, 1, 1, 8), cache, cache)
        return self.out(attended.view(1, 8)) + k


def _reference(model, x, cache, position):
    with torch.no_grad():
        return model(x, cache, position)


def _run(device, monkeypatch, moves: bool):
    if device == "cpu":
        fake_graphs.fake_cuda_graphs(monkeypatch)
    torch.manual_seed(0)
    model = CacheStep().to(device)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    compiled = torch.compile(model, backend=backend)
    cache, eager_cache = torch.zeros(1, 1, 16, 8, device=device), torch.zeros(1, 1, 16, 8, device=device)
    with torch.no_grad():
        for step in range(6):
            if moves and step == 3:  # the caller starts a new cache: at a new address
                cache, eager_cache = cache.clone(), eager_cache.clone()
            x = torch.randn(1, 8, device=device)
            position = torch.tensor([step], device=device)
            torch.testing.assert_close(compiled(x, cache, position), _reference(model, x, eager_cache, position))
            torch.testing.assert_close(cache, eager_cache)
    return backend


@pytest.mark.parametrize("device", DEVICES)
def test_the_cache_write_is_captured_and_the_cache_equals_eager(device, monkeypatch):
    backend = _run(device, monkeypatch, moves=False)
    writers = [p for p in backend.pieces if "index_copy_" in p.graph.code]
    assert writers and all(p.capturable for p in writers)
    eager = [p for p in backend.pieces if not p.capturable]
    assert eager and all("input_mutation" not in (p.reason or "") for p in eager)
    assert backend.stats.calls_with_moved_parameters == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_cache_runs_without_graphs_once_then_is_captured_again(device, monkeypatch):
    backend = _run(device, monkeypatch, moves=True)
    assert backend.stats.calls_with_moved_parameters == 1 and backend.stats.parameter_recaptures == 1


def test_without_cuda_graphs_the_write_stays_eager():
    torch.manual_seed(0)
    model = CacheStep()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    compiled = torch.compile(model, backend=backend)
    cache = torch.zeros(1, 1, 16, 8)
    with torch.no_grad():
        compiled(torch.randn(1, 8), cache, torch.tensor([0]))
    writers = [p for p in backend.pieces if "index_copy_" in p.graph.code]
    assert writers and not any(p.capturable for p in writers)
    assert any("input_mutation" in (p.reason or "") for p in writers)


def test_an_input_autograd_tracks_keeps_its_write_eager(monkeypatch):
    """A written input that requires grad is not read at its own address: autograd records
    the write, so it stays where the graph copies its inputs (and runs eagerly)."""
    fake_graphs.fake_cuda_graphs(monkeypatch)

    def step(x, state):
        state.mul_(2)
        return F.scaled_dot_product_attention(x, state, state).sum(-2) + state.sum(-2)

    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    compiled = torch.compile(step, backend=backend)
    x = torch.randn(1, 1, 2, 4)
    w = torch.randn(1, 1, 3, 4, requires_grad=True)
    out = compiled(x, w * 1.0)
    want = step(x, w * 1.0)
    torch.testing.assert_close(out, want)
    writers = [p for p in backend.pieces if "mul_" in p.graph.code]
    assert writers and not any(p.capturable for p in writers)
