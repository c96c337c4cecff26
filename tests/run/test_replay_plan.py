"""Replay plans (`cgcompile.run.replay_plan`): a straight-line replay per call size.

On the CPU through fake graphs (`fake_graphs.fake_cuda_graphs`): a fake replay recomputes
the piece from its static input buffers into its static outputs, so a plan that left a
buffer unfilled returns stale results, as a real graph would. The GPU runs them in the
cuda tests, the zoo and the fuzzer (benchmarks/gpu_verify.sh)."""

import enum
import logging
import math
import operator
import re

import pytest
import torch

import cgcompile
from cgcompile.run import replay_plan
from cgcompile.run.replay_plan import ReplayPlans, build_plan
from cgcompile.testing import fake_graphs, fuzz, gpu
from cgcompile.testing.models import SILLY_OP, ToyLlama

# Padding changes the row count of each matmul, and a CPU BLAS may round a row differently at
# another row count (one ulp on an AMD EPYC host). A buffer a replay left stale differs by
# whole values, far beyond this.
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _toy(n_layers=3, **fields):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyLlama(n_layers, hidden=32, vocab=64)
    config = cgcompile.Config(splitting_ops=(SILLY_OP,), compiler="eager", capture_sizes=(1, 2, 4, 8), **fields)
    backend = cgcompile.Backend(config)
    return model, backend, torch.compile(model, backend=backend)


def _planned(n: int, calls: int = 3, **fields):
    """(model, backend, compiled, the runtime with plans) after `calls` calls of n rows."""
    model, backend, compiled = _toy(**fields)
    with torch.no_grad():
        for seed in range(calls):
            compiled(_ids(n, seed))
    return model, backend, compiled, next(rt for rt in backend.runtimes if rt.plans is not None)


def _ids(n, seed):
    ids = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))
    torch._dynamo.mark_dynamic(ids, 0)
    return ids


def test_calls_after_capture_replay_through_plans_and_match_eager(monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    model, backend, compiled = _toy()
    sizes = (3, 5, 1, 8, 3, 5, 1, 8, 3, 7)
    with torch.no_grad():
        for seed, n in enumerate(sizes):
            torch.testing.assert_close(compiled(_ids(n, seed)), model(_ids(n, seed)), **CLOSE)
    plans = [rt.plans for rt in backend.runtimes if rt.plans is not None]
    assert plans and sum(p.made for p in plans) >= 4  # n=3, 5, 8, 7 at least (n=1: Dynamo's static graph)
    assert fake_graphs.FakeGraph.replays > fake_graphs.FakeGraph.captures > 0


def test_a_plan_launches_every_graph_and_passes_no_parameter(monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    model, backend, compiled, runtime = _planned(3, n_layers=3)
    plan = runtime.plans.get(3, 4)
    graph_pieces = sum(p.capturable for p in backend.pieces if p.graph_index == backend.runtimes.index(runtime))
    assert plan.source.count("replay") == graph_pieces + 1  # + the function's own name
    assert "weight" not in plan.source  # parameters are read by address, never passed
    # Graph to graph, values lie in place: only the ids and each eager result are copied.
    assert plan.source.count(".copy_") + plan.source.count("copy_in") == 1 + 3


def test_dropped_graphs_drop_the_plans_and_calls_capture_again(monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    model, backend, compiled, _ = _planned(5)
    captured = fake_graphs.FakeGraph.captures
    with torch.no_grad():
        for runtime in backend.runtimes:
            runtime.drop_graphs()
        for seed in range(3, 6):
            torch.testing.assert_close(compiled(_ids(5, seed)), model(_ids(5, seed)), **CLOSE)
    assert fake_graphs.FakeGraph.captures == 2 * captured > 0


def test_stale_input_buffers_show_as_a_mismatch(monkeypatch):
    """The fake graphs see an unfilled buffer: a plan that skips an eager piece's copy fails."""
    fake_graphs.fake_cuda_graphs(monkeypatch)
    model, backend, compiled, runtime = _planned(4, calls=2)
    with torch.no_grad():
        good = runtime.plans.get(4, 4)
        broken = re.sub(r": copy\w*\(.*\)$", ": pass", good.source, flags=re.M)  # buffers keep old rows
        assert broken.count(": pass") == 4
        namespace = dict(good.__globals__)
        exec(broken.replace("def replay", "def broken"), namespace)
        runtime.plans._plans[(4, 4)] = namespace["broken"]
        assert not torch.allclose(compiled(_ids(4, 9)), model(_ids(4, 9)), **CLOSE)


def test_fuzzed_walks_with_state_match_eager_through_plans(monkeypatch):
    """Random programs over a walk of sizes, walked twice: the second pass replays
    through plans where the program has graphs."""
    fake_graphs.fake_cuda_graphs(monkeypatch)
    served = []
    get = ReplayPlans.get

    def counted(self, n, size):
        plan = get(self, n, size)
        served[-1] += plan is not None
        return plan

    monkeypatch.setattr(ReplayPlans, "get", counted)
    setup = fuzz.Setup("eager", "cpu", padding=True, sequence=fuzz.SEQUENCE_LENGTH)
    for seed in range(12):
        served.append(0)
        program, sizes = setup.case(seed)
        outcome = fuzz.run_case(program, sizes + sizes, setup)
        assert outcome.status == "ok", (outcome, fuzz.reproducer(program, sizes + sizes, setup))
    assert sum(count > 0 for count in served) >= 6, served


@pytest.mark.cuda
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_on_the_gpu_plans_replay_and_match_eager_over_a_walk_of_sizes(compiler):
    model, backend, compiled = gpu.compiled_toy_llama(compiler, (1, 2, 4, 8))
    with torch.no_grad():
        for n in (3, 5, 1, 8, 3, 5, 1, 8, 3, 7, 3):
            ids = gpu.dynamic_ids(n)
            torch.testing.assert_close(compiled(ids), model(ids))
    plans = [rt.plans for rt in backend.runtimes if rt.plans is not None]
    assert plans and sum(p.made for p in plans) >= 4
    assert backend.stats.graphs_captured > 0


class OutStyleAttention(torch.nn.Module):
    """Split ops that write into a buffer made before them (`silly_accumulate`), the way
    serving engines' attention ops take their output: the buffer is a graph output."""

    def __init__(self, n_layers=3, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(64, width)
        self.ins = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_layers))
        self.outs = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_layers))

    def forward(self, ids):
        x = self.embed(ids)
        for a, b in zip(self.ins, self.outs):
            h = a(x)
            out = torch.zeros_like(h)
            torch.ops.cgcompile_testing.silly_accumulate(out, h)
            x = x + b(out)
        return x


def test_a_split_op_that_writes_into_a_graph_output_needs_no_copy(monkeypatch):
    """Only an attention that returns a new tensor costs a copy a layer: one that writes into a
    buffer the graph before it made leaves the value where the next graph reads it."""
    from cgcompile.testing.models import ACCUMULATE_OP

    fake_graphs.fake_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = OutStyleAttention()
    config = cgcompile.Config(splitting_ops=(ACCUMULATE_OP,), compiler="eager", capture_sizes=(1, 2, 4, 8))
    backend = cgcompile.Backend(config)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for seed in range(5):
            torch.testing.assert_close(compiled(_ids(3, seed)), model(_ids(3, seed)), **CLOSE)
    runtime = next(rt for rt in backend.runtimes if rt.plans is not None)
    plan = runtime.plans.get(3, 4)
    assert plan is not None and plan.source.count("replay") == 3 + 1 + 1  # 4 graph pieces + the name
    assert plan.source.count(".copy_") + plan.source.count("copy_in") == 1  # the ids alone


# -- plans of any stitch: graphs that return nothing, every kind of argument, fallback -----


def _accumulate_into(x, acc):  # x, acc: [n, 8]; returns nothing: its one effect is the write into acc
    h = torch.sin(x) * 2.0  # a graph piece
    torch.ops.cgcompile_testing.silly_accumulate(acc, h)  # an eager piece writes into the input


def test_a_graph_that_returns_nothing_replays_from_a_plan_on_later_calls(monkeypatch):
    from cgcompile.testing.models import ACCUMULATE_OP

    fake_graphs.fake_cuda_graphs(monkeypatch)
    torch._dynamo.reset()
    config = cgcompile.Config(splitting_ops=(ACCUMULATE_OP,), compiler="eager", capture_sizes=(1, 2, 4, 8))
    backend = cgcompile.Backend(config)
    compiled = torch.compile(_accumulate_into, backend=backend)
    for seed in range(4):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
        acc, want = torch.ones(3, 8), torch.ones(3, 8)
        for t in (x, acc):
            torch._dynamo.mark_dynamic(t, 0)
        assert compiled(x, acc) is _accumulate_into(x, want) is None
        torch.testing.assert_close(acc, want, **CLOSE)
    runtime = next(rt for rt in backend.runtimes if rt.plans is not None)
    assert runtime.plans.made == 1 and runtime.plans.get(3, 4).source.rstrip().endswith("return ()")


class Colour(enum.IntEnum):
    RED = 1


def _echo(x, value):
    """What a call_function node received, to compare the plan's with the stitch's."""
    return x, value


def _stitch_passing(value) -> torch.fx.GraphModule:
    """A stitch that hands `value` (a node made from x where it is a callable) to a call."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    rows = graph.call_function(len, (x,))
    arg = value(rows) if callable(value) else value
    graph.output(graph.call_function(_echo, (x, arg)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return type(a) is type(b) and math.isnan(b)
    if isinstance(a, (tuple, list)):  # FX holds a list as its immutable_list
        return isinstance(b, list) == isinstance(a, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _numpy_scalar():
    numpy = pytest.importorskip("numpy")
    return numpy.float64(1.5)  # a float subclass whose repr is `np.float64(1.5)`


LITERALS = {
    "int_enum": lambda: Colour.RED,
    "empty_size": lambda: torch.Size([]),
    "inf": lambda: -math.inf,
    "nan": lambda: math.nan,
    "numpy_scalar": _numpy_scalar,
    "empty_tuple": lambda: (),
    "nested_containers": lambda: [(), [1, ("a", None)], {"k": (2.5,)}],
    "dtype_and_device_keys": lambda: {torch.float32: torch.device("cpu"), 3: "three"},
    "slice_of_a_node": lambda: lambda rows: slice(None, rows, 2),
}


@pytest.mark.parametrize("kind", LITERALS)
def test_every_kind_of_argument_round_trips_through_a_plan(kind):
    """The call receives what the graph holds. (Not compared with the stitch's own run:
    FX's generated code writes a numpy scalar as `np.float64(1.5)` and fails too.)"""
    stitch = _stitch_passing(LITERALS[kind]())
    held = next(node for node in stitch.graph.nodes if node.target is _echo).args[1]  # torch.Size: a tuple
    x = torch.randn(5, 4)
    got = build_plan(stitch, {}, 5, 8)((x,))
    assert got[0] is x and _same(got[1], torch.fx.node.map_arg(held, lambda rows: 5)), (got[1], held)


class _Scaled(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


def test_call_method_and_call_module_keywords_reach_the_call():
    root = torch.nn.Module()
    root.piece = _Scaled()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    added = graph.call_method("add", (x, 1.0), {"alpha": 2.0})
    scaled = graph.call_module("piece", (added,), {"scale": 3.0})
    graph.output((graph.call_function(operator.getitem, (scaled, slice(None, 2))),))
    stitch = torch.fx.GraphModule(root, graph)
    x = torch.randn(5, 4)
    plan = build_plan(stitch, {"piece": root.piece.forward}, 5, 8)
    torch.testing.assert_close(plan((x,)), stitch(x))
    torch.testing.assert_close(plan((x,))[0], ((x + 2.0) * 3.0)[:2])


def test_a_plan_that_cannot_be_made_warns_once_and_the_stitch_runs(monkeypatch, caplog):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    tries = []

    def broken(*args):
        tries.append(args[0].n)
        raise RuntimeError("cannot write this")

    monkeypatch.setattr(replay_plan, "_write_replay", broken)
    model, backend, compiled = _toy()
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="cgcompile.run.replay_plan"):
        for seed, n in enumerate((3, 3, 3, 5, 5, 3, 5)):
            torch.testing.assert_close(compiled(_ids(n, seed)), model(_ids(n, seed)), **CLOSE)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "graph0" in warnings[0].getMessage() and "cannot write this" in warnings[0].getMessage()
    assert sorted(tries) == [3, 5]  # once per (n, size): the failure is kept, not retried every call
    assert sum(rt.plans.made for rt in backend.runtimes if rt.plans is not None) == 0
    assert fake_graphs.FakeGraph.replays > 0  # the stitch replays the graphs itself


def test_fuzzed_programs_that_only_write_into_an_input_match_eager_through_plans(monkeypatch):
    """The grammar's programs that return nothing, or whose effect is a write into an
    input (the "sink" productions), walked twice: the second pass replays through plans."""
    fake_graphs.fake_cuda_graphs(monkeypatch)
    served = []
    get = ReplayPlans.get

    def counted(self, n, size):
        plan = get(self, n, size)
        served[-1] += plan is not None
        return plan

    monkeypatch.setattr(ReplayPlans, "get", counted)
    setup = fuzz.Setup("eager", "cpu", padding=True)
    seeds = [s for s in range(200) if fuzz.generate(s).returns != "outputs"][:8]
    for seed in seeds:
        served.append(0)
        program, sizes = setup.case(seed)
        outcome = fuzz.run_case(program, sizes + sizes, setup)
        assert outcome.status == "ok", (outcome, fuzz.reproducer(program, sizes + sizes, setup))
    assert len(seeds) == 8 and sum(count > 0 for count in served) >= 6, served


def test_the_fuzzer_reports_calls_that_ran_the_stitch_for_want_of_a_plan(monkeypatch):
    """The fallback keeps results right, so a differential fuzzer would not see a plan that
    failed to build: it reports one as an error."""
    fake_graphs.fake_cuda_graphs(monkeypatch)

    def broken(*args):
        raise RuntimeError("cannot write this")

    monkeypatch.setattr(replay_plan, "_write_replay", broken)
    setup = fuzz.Setup("eager", "cpu", padding=True)
    program, sizes = setup.case(0)
    outcome = fuzz.run_case(program, sizes + sizes, setup)
    assert outcome.status == "error" and "no replay plan" in outcome.detail and "cannot write this" in outcome.detail
