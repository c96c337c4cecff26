"""The graph-memory plan without CUDA: graph counts, budget choice, padding to kept sizes, the plan on disk."""

import json
import subprocess
import sys

import pytest
import torch

import cgcompile
from cgcompile import ArgumentError, Config, MemoryPlan, SizePlan
from cgcompile.memory_plan import fitting_sizes, format_plan, read_plans, write_plan
from cgcompile.buffers import PaddingTable
from cgcompile.testing.models import SILLY_OP, ToyLlama

SIZES = (2, 4, 8)


def _compiled(**cfg):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyLlama(2)
    backend = cgcompile.Backend(Config(compiler="eager", splitting_ops=(SILLY_OP,), capture_sizes=SIZES, **cfg))
    return model, backend, torch.compile(model, backend=backend)


def _ids(n, dynamic=True):
    ids = torch.randint(0, 64, (n,))
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
    return ids


def test_counts_graphs_per_size_without_cuda():
    model, backend, compiled = _compiled()
    compiled(_ids(3))
    plan = backend.plan_memory()
    # 2 layers: 5 pieces, 3 capturable; every size captures all 3.
    assert [(r.size, r.graphs, r.pool_bytes) for r in plan.sizes] == [(8, 3, None), (4, 3, None), (2, 3, None)]
    assert plan.captured == (8, 4, 2) and plan.graphs == 9 and plan.estimate_bytes is None


def test_a_static_graph_is_counted_once():
    model, backend, compiled = _compiled()
    compiled(_ids(3, dynamic=False))  # a first call Dynamo traces with static shapes
    assert backend.runtimes[0].sizing is None
    plan = backend.plan_memory(sizes=(4, 2))
    assert [(r.size, r.graphs) for r in plan.sizes] == [(4, 3), (2, 0)]


def test_count_before_any_call_names_the_fix():
    _, backend, _ = _compiled()
    with pytest.raises(cgcompile.StateError, match="Backend.plan_memory: expected .* got no Dynamo graph yet; call the"):
        backend.plan_memory()


def test_budget_without_a_model_names_the_fix():
    _, backend, compiled = _compiled()
    compiled(_ids(3))
    with pytest.raises(ArgumentError, match="plan_memory: memory_budget: expected None without model"):
        backend.plan_memory(memory_budget=1 << 20)


def test_fitting_sizes_keeps_the_largest_first_run_within_budget():
    rows = (SizePlan(8, 3, 100), SizePlan(4, 3, 120), SizePlan(2, 3, 130))
    assert fitting_sizes(rows, None) == (8, 4, 2)
    assert fitting_sizes(rows, 130) == (8, 4, 2)
    assert fitting_sizes(rows, 125) == (8, 4)
    assert fitting_sizes(rows, 100) == (8,)
    assert fitting_sizes(rows, 99) == ()


def test_plan_says_where_each_call_runs():
    plan = MemoryPlan("m", (SizePlan(8, 3, 100), SizePlan(4, 3, 120), SizePlan(2, 3, 130)), (8, 4), budget=125)
    assert plan.skipped == (2,)
    assert plan.graphs == 6 and plan.estimate_bytes == 120
    assert [plan.runs_at(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [4, 4, 4, 4, 8, 8, None]
    assert MemoryPlan("m", plan.sizes, ()).estimate_bytes == 0
    assert MemoryPlan("m", plan.sizes, ()).runs_at(1) is None


def test_padding_table_narrows_to_kept_sizes():
    table = PaddingTable((1, 2, 4, 8))
    table.use((8, 4))
    assert [table.padded(n) for n in (1, 3, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, None]
    table.use(())
    assert table.padded(1) is None
    table.use(table.configured)
    assert table.padded(1) == 1


def test_calls_pad_to_the_kept_sizes_only():
    """What a budgeted capture leaves: sizes between kept ones pad up, sizes above run exact."""
    model, backend, compiled = _compiled(padding=True)
    backend.session.padding.use((4,))
    for n, expected in [(3, 4), (2, 4), (4, 4), (6, None), (8, None)]:
        ids = _ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)  # padded matmuls round apart
        step = backend.runtimes[0].step
        assert (step.n, step.size) == (n, expected)


@pytest.mark.parametrize("budget", [0, -1, 1.5e9, True, "2GiB"])
def test_bad_budgets_are_refused_before_anything_runs(budget):
    _, backend, compiled = _compiled()
    calls = []
    with pytest.raises(ArgumentError, match=r"Backend.capture: memory_budget: expected a positive int of bytes, got"):
        backend.capture(compiled, lambda size, warmup: calls.append(size), memory_budget=budget)
    assert calls == [] and backend.stats.graphs_seen == 0


def test_a_budget_on_cpu_says_cuda_is_needed():
    _, backend, compiled = _compiled()
    with pytest.raises(cgcompile.CaptureError, match="Backend.capture: expected a CUDA device"):
        backend.capture(compiled, lambda size, warmup: (_ids(size),), memory_budget=1 << 30)


def test_inspect_prints_the_plan(tmp_path):
    plan = MemoryPlan("vision", (SizePlan(32, 5, 48 << 20), SizePlan(8, 5, 50 << 20), SizePlan(1, None, None)),
                      (32, 8), budget=64 << 20, actual_bytes=50 << 20)
    write_plan(str(tmp_path), plan)
    assert read_plans(str(tmp_path)) == [json.loads(json.dumps(plan.to_dict()))]
    result = subprocess.run([sys.executable, "-m", "cgcompile.inspect", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "graph memory plan"
    assert lines[1] == ("model vision: 2 of 3 sizes captured, 10 graphs, estimate 50.0 MiB, "
                        "actual 50.0 MiB, budget 64.0 MiB")
    assert lines[3].split() == ["32", "5", "48.0", "MiB", "yes"]
    assert lines[5].split() == ["1", "?", "unknown", "no"]
    assert "above 32 it runs without graphs" in lines[6]
    assert format_plan(plan.to_dict()) == "\n".join(lines[1:])


def test_a_broken_plan_file_is_named(tmp_path):
    (tmp_path / "memory_plan.x.json").write_text("{}")
    with pytest.raises(ArgumentError, match="memory_plan.x.json: expected a memory plan written by cgcompile"):
        read_plans(str(tmp_path))


def test_profile_drops_sizes_that_do_not_fit_alone_and_stops_past_the_budget(monkeypatch):
    """The choice profile_plan makes from measured pools, with the measuring faked (it needs CUDA)."""
    from cgcompile import aot_capture, memory_plan

    calls = []

    def fake_profile(backend, model, make_inputs, sizes, stop_above):
        calls.append(tuple(sizes))
        rows, pool = [], 0
        for i, size in enumerate(sizes):
            pool = size * 10 if i == 0 else pool + 1  # the top size sets the pool; smaller ones add a byte
            rows.append(SizePlan(size, 3, pool))
            if stop_above is not None and pool > stop_above:
                break
        return tuple(rows)

    monkeypatch.setattr(aot_capture, "cuda_present", lambda: True)
    monkeypatch.setattr(memory_plan, "_profile", fake_profile)
    _, backend, compiled = _compiled()
    make = lambda size, warmup: (_ids(size),)  # noqa: E731
    plan = backend.plan_memory(compiled, make, memory_budget=41)
    assert calls == [(8, 4, 2), (4, 2)]  # 8 alone is 80 bytes: measured again without it
    assert [(r.size, r.graphs, r.pool_bytes) for r in plan.sizes] == [(8, None, None), (4, 3, 40), (2, 3, 41)]
    assert plan.captured == (4, 2) and plan.estimate_bytes == 41 and plan.runs_at(5) is None
    calls.clear()
    plan = backend.plan_memory(compiled, make, memory_budget=80)
    assert calls == [(8, 4, 2)] and plan.captured == (8,)
    assert [(r.size, r.pool_bytes) for r in plan.sizes] == [(8, 80), (4, 81), (2, None)]
    calls.clear()
    assert backend.plan_memory(compiled, make, memory_budget=5).captured == ()
    assert calls == [(8, 4, 2), (4, 2), (2,)]


def test_a_plan_lands_in_the_dump_folder(tmp_path):
    model, backend, compiled = _compiled(dump_dir=str(tmp_path))
    compiled(_ids(3))
    plan = backend.plan_memory(name="decoder")
    assert read_plans(str(tmp_path)) == [json.loads(json.dumps(plan.to_dict()))]
    result = subprocess.run([sys.executable, "-m", "cgcompile.inspect", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "model decoder: 3 of 3 sizes planned, 9 graphs (none captured yet), estimate unknown" in result.stdout


def test_a_plan_made_before_any_capture_says_would_capture():
    model, backend, compiled = _compiled()
    compiled(_ids(3))
    lines = backend.plan_memory().format().splitlines()
    assert lines[0] == "model model: 3 of 3 sizes planned, 9 graphs (none captured yet), estimate unknown"
    assert lines[1].split()[-2:] == ["would", "capture"]
    assert lines[2].split() == ["8", "3", "unknown", "yes"]
    assert lines[-1].startswith("  once captured (Backend.capture, CUDA only)")
    assert backend.stats.graphs_captured == 0


def test_a_planned_size_that_is_not_a_capture_size_gets_no_graphs_of_its_own():
    model, backend, compiled = _compiled()
    compiled(_ids(3))
    lines = backend.plan_memory(sizes=(3,)).format().splitlines()
    assert lines[0].startswith("model model: 0 of 1 sizes planned, 0 graphs")
    assert lines[2].split(maxsplit=3) == ["3", "3", "unknown", "no: not a capture size (runs at 4)"]
    assert lines[-1] == "  nothing captured: every call runs without graphs"
