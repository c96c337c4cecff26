"""The shared compile cache (`compiler.CompileCache`, as `PieceCompiler` uses it): pieces with the same code and input
descriptions share a compile only with a graph that assumes at least as much about the
sizes, and a compile served from a cache brings back the guards it added."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import cgcompile
from cgcompile.compat import fresh_inductor_cache
from cgcompile.build.compiler import CompileCache, CompileKey, SizeAssumptions

KEY = CompileKey("piece", "def forward(self, x): ...", ("f32[s0, 8]",))


def _backend() -> cgcompile.Backend:
    return cgcompile.Backend(cgcompile.Config(compiler="inductor", capture_sizes=(1, 2, 4, 8)))


def _rows(n: int) -> torch.Tensor:  # [n, 8], n dynamic unless the code specialises it
    x = torch.randn(n, 8)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


def first_eight(x):  # x: [n, 8]; Dynamo guards n < 8 or n >= 8
    return x[:8] * 2.0


def test_a_graph_that_assumes_other_sizes_gets_its_own_compile():
    # Both graphs have one piece with the same code over f32[s77, 8]; one assumes s77 <= 7
    # (the slice keeps s77 rows), the other s77 >= 8 (it keeps 8). Shared, the second
    # would return 10 rows at n=10.
    backend = _backend()
    compiled = torch.compile(first_eight, backend=backend)
    for n in (3, 10):
        x = _rows(n)
        torch.testing.assert_close(compiled(x), first_eight(x))
    first, second = backend.pieces
    assert (first.graph.code, first.input_shapes) == (second.graph.code, second.input_shapes)
    assert backend.stats.graphs_seen == 2 and backend.stats.compilations == 2


def double(x):  # x: [n, 8]
    return x * 2.0


def double_either_way(x):  # x: [n, 8]; the same piece as `double`, with n >= 8 or n < 8 guarded
    if x.shape[0] >= 8:
        return x * 2.0
    return x * 2.0


def test_graphs_that_assume_the_same_sizes_share_a_compile():
    backend = _backend()
    for _ in range(2):  # two compiled functions: two Dynamo graphs, two ShapeEnvs
        compiled = torch.compile(double, backend=backend)
        x = _rows(5)
        torch.testing.assert_close(compiled(x), double(x))
        torch._dynamo.reset()
    assert backend.stats.graphs_seen == 2 and backend.stats.compilations == 1


def test_a_compile_serves_graphs_that_assume_more_about_the_sizes_not_less():
    backend = _backend()
    general, branching = torch.compile(double, backend=backend), torch.compile(double_either_way, backend=backend)
    # n >= 8, then no assumption (a compile of its own), then 2 <= n < 8 (shares the last).
    for fn, n in ((branching, 10), (general, 5), (branching, 3)):
        x = _rows(n)
        torch.testing.assert_close(fn(x), double(x))
    assert len({p.graph.code for p in backend.pieces}) == 1
    assert backend.stats.graphs_seen == 3 and backend.stats.compilations == 2


EDGE = torch.randn(1, 8)


def shift(x):  # x: [n, 8]; at n=2 one row is left of x[1:], and Inductor specialises n
    return torch.cat([x[1:], EDGE], dim=0) * 2.0


def test_a_piece_specialised_by_its_compile_is_not_shared_with_a_graph_without_the_guard():
    # The compile at n=2 adds n == 2 to the first graph's ShapeEnv; the graph for n=3 must
    # not run that code (it would fail Inductor's size assertion).
    with fresh_inductor_cache():
        backend = _backend()
        compiled = torch.compile(shift, backend=backend)
        for n in (2, 3, 2):
            x = _rows(n)
            torch.testing.assert_close(compiled(x), shift(x))
    assert backend.stats.graphs_seen == 2 and backend.stats.compilations == 2


def test_a_piece_served_from_inductors_cache_brings_back_its_guards():
    # A second process, as it were: a new Backend and Dynamo state, Inductor's caches warm.
    with fresh_inductor_cache():
        for source in ("compiled", "from Inductor's cache"):
            torch._dynamo.reset()
            counters.clear()
            backend = _backend()
            compiled = torch.compile(shift, backend=backend)
            for n in (2, 3):
                x = _rows(n)
                torch.testing.assert_close(compiled(x), shift(x))
            assert backend.stats.graphs_seen == 2, source
        assert counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] >= 2



# -- CompileCache itself: the one cache of pieces, compile sizes and whole graphs ----------

def _assuming(*facts: str) -> SizeAssumptions:
    return SizeAssumptions((), frozenset(facts))


def test_a_compile_serves_only_assumptions_that_imply_the_ones_it_was_made_under():
    cache, made = CompileCache(), []

    def get(*facts):
        return cache.get(KEY, lambda: made.append(facts) or facts, what="a piece", assumed=lambda: _assuming(*facts))

    assert get("s0 >= 8") == ("s0 >= 8",)
    assert get("s0 >= 8", "Eq(Mod(s0, 2), 0)") == ("s0 >= 8",)  # assumes more: shared
    assert get() == ()  # assumes less: a compile of its own
    assert get("s0 >= 8") == ("s0 >= 8",)
    at_4 = dataclasses.replace(KEY, kind="piece at size", size=4)
    assert cache.get(at_4, lambda: "at 4", what="a piece at 4") == "at 4"
    assert made == [("s0 >= 8",), ()] and cache.made == {"piece": 2, "piece at size": 1}


def test_a_bounded_cache_falls_back_once_per_key_and_an_unbounded_one_raises():
    def fail():
        raise RuntimeError("no lowering")

    bounded = CompileCache(limit=1, fall_back=True)
    assert bounded.get(KEY, fail, what="a graph") is None and bounded.compilations == 0
    assert bounded.get(KEY, lambda: "never tried again", what="a graph") is None
    other = dataclasses.replace(KEY, inputs=("f32[4, 8]",))
    assert bounded.get(other, lambda: "compiled", what="a graph") == "compiled"
    assert bounded.get(dataclasses.replace(KEY, size=2), lambda: "over the limit", what="a graph") is None
    assert bounded.compilations == 1
    with pytest.raises(RuntimeError, match="no lowering"):
        CompileCache().get(KEY, fail, what="a piece")


def test_a_compile_at_real_shapes_is_found_in_inductors_fx_graph_cache():
    """Whole-graph and per-size compiles get real inputs. Inductor's FX graph cache skips
    inputs without a shape environment, so before `compat.static_fakes` the next process
    (here: the next compile of the same graph) compiled them again."""
    from cgcompile.compat import inductor_compile

    gm = torch.fx.symbolic_trace(lambda x, w: torch.relu(x @ w) + 1.0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    counters.clear()
    with fresh_inductor_cache():
        first = inductor_compile(gm, [x, w])
        second = inductor_compile(gm, [x, w])
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
        assert (counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]) == (1, 1)
    for compiled in (first, second):
        out = compiled(x, w)
        torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, torch.relu(x @ w) + 1.0)


def test_graphs_calling_the_rewrites_functions_are_kept_by_aotautograds_cache():
    """A graph holding `additive_attention_mask` (the mask pass's function) was skipped by
    AOTAutograd's cache ("Unsupported call_function target"): every process traced it again."""
    from cgcompile.compat import inductor_compile
    from cgcompile.passes.attention_mask import additive_attention_mask

    graph = torch.fx.Graph()
    mask, x = graph.placeholder("mask"), graph.placeholder("x")
    converted = graph.call_function(additive_attention_mask, (mask, torch.float32))
    graph.output((graph.call_function(torch.add, (x, converted)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    args = [torch.rand(2, 5) > 0.5, torch.randn(2, 5)]
    expected = args[1] + torch.zeros(2, 5).masked_fill(~args[0], float("-inf"))
    counters.clear()
    with fresh_inductor_cache():
        for _ in range(2):
            out = inductor_compile(gm, args)(*args)
            torch.testing.assert_close(out[0], expected)
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
