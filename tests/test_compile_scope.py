"""backend="cgcompile": every graph of one torch.compile call shares one Backend; two calls never do."""

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile import ArgumentError


class TwoGraphs(nn.Module):
    """Two identical layers with a graph break between them: two Dynamo graphs, one piece each."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.first(x).relu()
        torch._dynamo.graph_break()
        return self.second(x).relu()


def test_graphs_of_one_compile_share_one_backend():
    torch._dynamo.reset()
    model = TwoGraphs()
    compiled = torch.compile(model, backend="cgcompile", options={"compiler": "eager"})
    x = torch.randn(3, 8)
    assert torch.equal(compiled(x), model(x))
    backend = cgcompile.backend_of(compiled)
    assert backend.stats.graphs_seen == 2
    assert [p.graph_index for p in backend.pieces] == [0, 1]
    assert len(backend.runtimes) == 2


def test_one_compile_cache_compiles_identical_layers_once():
    torch._dynamo.reset()
    model = TwoGraphs()
    compiled = torch.compile(model, backend="cgcompile", options={"compiler": "inductor"})
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), model(x))
    stats = cgcompile.backend_of(compiled).stats
    assert (stats.graphs_seen, stats.capturable_pieces, stats.compilations) == (2, 2, 1)


def test_two_compiles_do_not_share():
    torch._dynamo.reset()
    model = TwoGraphs()
    first = torch.compile(model, backend="cgcompile", options={"compiler": "eager"})
    second = torch.compile(lambda x: model(x) * 2, backend="cgcompile", options={"compiler": "eager"})
    x = torch.randn(3, 8)
    first(x)
    second(x)
    a, b = cgcompile.backend_of(first), cgcompile.backend_of(second)
    assert a is not b and a.session is not b.session
    assert a.stats.graphs_seen == 2
    assert b.stats.graphs_seen >= 1  # its own graphs (Dynamo may reuse first's for the inlined model)


def test_module_compiled_in_place_has_its_backend():
    torch._dynamo.reset()
    model = TwoGraphs()
    model.compile(backend="cgcompile", options={"compiler": "eager"})
    x = torch.randn(2, 8)
    model(x)
    assert cgcompile.backend_of(model).stats.graphs_seen == 2


def test_backend_of_before_the_first_call_names_the_fix():
    torch._dynamo.reset()
    compiled = torch.compile(TwoGraphs(), backend="cgcompile")
    with pytest.raises(ArgumentError, match="backend_of: expected .* called at least once.*call it once first"):
        cgcompile.backend_of(compiled)


def test_backend_of_an_explicit_backend_compile_names_the_fix():
    compiled = torch.compile(TwoGraphs(), backend=cgcompile.Backend(cgcompile.Config(compiler="eager")))
    compiled(torch.randn(2, 8))
    with pytest.raises(ArgumentError, match="keep that object"):
        cgcompile.backend_of(compiled)


def test_release_all_graphs_leaves_sessions_without_graphs_alone():
    # On the CPU no session captures, so nothing is cleared (clear() would synchronise CUDA).
    from cgcompile.run.capture import CaptureSession, release_all_graphs

    session = CaptureSession((1, 2))
    assert release_all_graphs() == 0
    assert session.graphs_captured == 0
