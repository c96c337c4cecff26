"""The graph-memory plan without CUDA: graph counts, budget choice, padding to kept sizes, the plan on disk.
On the GPU (marked `cuda`): budgets, estimates against the real pool, an encoder against eager,
two models in one process, and one pool per torch.compile call with the string backend."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile import ArgumentError, Config, MemoryPlan, SizePlan
from cgcompile.tools.memory_plan import fitting_sizes, format_plan, read_plans, write_plan
from cgcompile.run.buffers import PaddingTable
from cgcompile.testing.models import SILLY_OP, ToyLlama
from cgcompile.testing.gpu import private_pools
from cgcompile.testing.hf_models import tiny_model

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_profiling_on_cpu_names_the_plan_without_profiling():
    _, backend, compiled = _compiled()
    compiled(_ids(3))
    with pytest.raises(cgcompile.CaptureError, match=r"plan_memory: expected a CUDA device for profiling the "
                       r"graphs' memory, got none.*on CPU call plan_memory\(\) with no arguments"):
        backend.plan_memory(compiled, lambda size, warmup: (_ids(size),))
    assert backend.plan_memory().graphs > 0  # what the message offers works here


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
    from cgcompile.tools import aot_capture, memory_plan

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


CUDA_SIZES = (2, 4, 8, 16, 32, 64)
IMAGES = (1, 2, 4, 8, 16, 32)


@pytest.fixture
def exact_fp32():
    """No TF32 in matmuls or convolutions (the encoder's patch embedding is one)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _cuda_ids(n, dynamic=False):
    ids = torch.randint(0, 4096, (n,), device="cuda")
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
    return ids


def _make_ids(size, warmup):
    return (_cuda_ids(size),)


def _decoder(compiler="inductor", n_layers=4, **cfg):
    torch.manual_seed(0)
    model = ToyLlama(n_layers, hidden=1024, vocab=4096).cuda()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler=compiler, capture_sizes=CUDA_SIZES,
                                                 **cfg))
    compiled = torch.compile(model, backend=backend)
    compiled(_cuda_ids(5, dynamic=True))  # traced with a dynamic capture dimension
    backend.clear()  # that call captured size 8 lazily; plans start from an empty pool
    return model, backend, compiled


def _vit(compiler, **cfg):
    model = tiny_model("vit", 4, device="cuda")
    backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, capture_sizes=IMAGES, **cfg))
    compiled = torch.compile(model, backend=backend)
    compiled(_pixels(3, dynamic=True))
    backend.clear()
    return model, backend, compiled


def _pixels(n, dynamic=False):
    pixels = torch.randn(n, 3, 64, 64, device="cuda")  # pixel_values: [N, 3, H, W]
    if dynamic:
        torch._dynamo.mark_dynamic(pixels, 0)
    return pixels


def _make_pixels(size, warmup):
    return (_pixels(size),)


def _check_budgeted(backend, plan, budget):
    assert backend.memory_plan is plan
    assert backend.graph_memory() <= budget
    assert plan.actual_bytes == backend.graph_memory()
    largest_first = tuple(sorted(plan.captured, reverse=True))
    assert plan.captured == largest_first
    if plan.captured:
        assert abs(plan.actual_bytes - plan.estimate_bytes) <= 0.1 * plan.estimate_bytes, plan.format()


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_plan_then_capture_within_budget_estimate_within_ten_percent():
    model, backend, compiled = _decoder()
    full = backend.plan_memory(compiled, _make_ids, name="decoder")
    print(full.format())
    assert backend.graphs_held() == 0 and backend.graph_memory() == 0  # the profile released everything
    pools = [row.pool_bytes for row in full.sizes]
    assert [row.size for row in full.sizes] == sorted(CUDA_SIZES, reverse=True)
    assert all(p > 0 for p in pools) and pools == sorted(pools)  # cumulative
    assert full.graphs == 5 * len(CUDA_SIZES)  # 4 layers: 5 capturable pieces per size
    budget = (pools[0] + pools[-1]) // 2 if pools[-1] > pools[0] else pools[-1]
    graphs = backend.capture(compiled, _make_ids, memory_budget=budget, name="decoder")
    plan = backend.memory_plan
    print(plan.format())
    _check_budgeted(backend, plan, budget)
    assert len(plan.captured) >= 1 and graphs == plan.graphs == backend.graphs_held()
    held = backend.graphs_held()
    for n in (3, 5, 64, 2, 70, 17):
        ids = _cuda_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
        assert backend.runtimes[0].step.size == plan.runs_at(n)
    assert backend.graphs_held() == held  # nothing captured lazily after a budgeted capture
    assert backend.graph_memory() <= budget


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_budget_below_the_largest_size_drops_it_and_calls_of_it_run_without_graphs():
    model, backend, compiled = _decoder()
    alone = backend.plan_memory(compiled, _make_ids, sizes=(64,)).estimate_bytes
    budget = alone - 1
    backend.capture(compiled, _make_ids, memory_budget=budget)
    plan = backend.memory_plan
    print(plan.format())
    _check_budgeted(backend, plan, budget)
    assert 64 not in plan.captured and plan.runs_at(64) is None
    held = backend.graphs_held()
    ids = _cuda_ids(64)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert backend.graphs_held() == held


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_a_budget_nothing_fits_captures_nothing_and_calls_still_match():
    model, backend, compiled = _decoder("eager")
    assert backend.capture(compiled, _make_ids, memory_budget=1) == 0
    assert backend.memory_plan.captured == () and backend.graph_memory() == 0
    for n in (3, 8):
        ids = _cuda_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.graphs_held() == 0


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_clear_lifts_the_budget():
    model, backend, compiled = _decoder("eager")
    backend.capture(compiled, _make_ids, memory_budget=1)
    backend.clear()
    compiled(_cuda_ids(3))
    assert backend.graphs_held() == 5  # captured lazily at size 4 again


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.parametrize("compiler, tol", [("eager", 1e-4), ("inductor", 2e-3)])
@torch.inference_mode()
def test_vit_encoder_matches_eager_at_capture_and_other_sizes(compiler, tol):
    model, backend, compiled = _vit(compiler)
    backend.capture(compiled, _make_pixels, memory_budget=1 << 30, name="vision")
    plan = backend.memory_plan
    print(plan.format())
    assert plan.captured == tuple(sorted(IMAGES, reverse=True))
    _check_budgeted(backend, plan, 1 << 30)
    for n in (1, 2, 3, 8, 13, 32, 40, 3):
        pixels = _pixels(n)
        got, want = compiled(pixels).last_hidden_state, model(pixels).last_hidden_state
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_vit_eager_pieces_are_exact_at_capture_sizes():
    """At a capture size nothing is padded: the graphs replay eager's own kernels on eager's shapes."""
    model, backend, compiled = _vit("eager")
    backend.capture(compiled, _make_pixels, memory_budget=1 << 30, name="vision")
    for n in (2, 8, 32):
        pixels = _pixels(n)
        assert torch.equal(compiled(pixels).last_hidden_state, model(pixels).last_hidden_state)


def _interleave(pairs, rounds):
    """Call each (eager, compiled, inputs) in turn, `rounds` times, checking against eager."""
    for n in rounds:
        for eager, compiled, make, tol in pairs:
            x = make(n)
            got, want = compiled(x), eager(x)
            got = getattr(got, "last_hidden_state", got)
            want = getattr(want, "last_hidden_state", want)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_encoder_beside_decoder_own_pools_interleaved_with_address_checks():
    before = private_pools()
    vit, enc_backend, enc = _vit("inductor", check_addresses=True)
    dec_model, dec_backend, dec = _decoder(check_addresses=True)
    enc_backend.capture(enc, _make_pixels, memory_budget=1 << 30, name="vision")
    dec_backend.capture(dec, _make_ids, memory_budget=1 << 30, name="decoder")
    pools = tuple(enc_backend.session.pool.handle), tuple(dec_backend.session.pool.handle)
    assert pools[0] != pools[1] and set(pools) <= private_pools() - before  # two new pools, one per model
    held = enc_backend.graphs_held(), dec_backend.graphs_held()
    pairs = [(vit, enc, _pixels, 2e-3), (dec_model, dec, _cuda_ids, 2e-3)]
    _interleave(pairs, [3, 32, 2, 17, 8, 5, 32, 3])
    assert (enc_backend.graphs_held(), dec_backend.graphs_held()) == held


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_draft_beside_target_with_the_string_backend():
    torch.manual_seed(0)
    draft, target = ToyLlama(1, hidden=256, vocab=4096).cuda(), ToyLlama(6, hidden=1024, vocab=4096).cuda()
    options = {"compiler": "eager", "capture_sizes": list(CUDA_SIZES), "splitting_ops": [SILLY_OP], "check_addresses": True}
    draft_c = torch.compile(draft, backend="cgcompile", options=dict(options))
    target_c = torch.compile(target, backend="cgcompile", options=dict(options))
    draft_c(_cuda_ids(5, dynamic=True))
    target_c(_cuda_ids(5, dynamic=True))
    draft_b, target_b = cgcompile.backend_of(draft_c), cgcompile.backend_of(target_c)
    assert draft_b is not target_b
    draft_b.capture(draft_c, _make_ids, memory_budget=256 << 20, name="draft")
    target_b.capture(target_c, _make_ids, memory_budget=1 << 30, name="target")
    assert draft_b.session.pool.handle != target_b.session.pool.handle
    for n in (4, 4, 4, 16, 4, 4, 4, 16):  # draft steps, then the target verifies a longer run
        for model, compiled in ((draft, draft_c), (target, target_c)):
            ids = _cuda_ids(n)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)


class _TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        x = self.first(x).relu()
        torch._dynamo.graph_break()
        return self.second(x).relu()


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32")
@torch.inference_mode()
def test_string_backend_graphs_of_one_compile_share_one_pool():
    before = private_pools()
    model = _TwoGraphs().cuda()
    compiled = torch.compile(model, backend="cgcompile", options={"compiler": "eager", "capture_sizes": [4, 8]})
    for n in (3, 8, 5):
        x = torch.randn(n, 256, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    backend = cgcompile.backend_of(compiled)
    # The graph after the break is traced static first, then again dynamic: 3 Dynamo graphs.
    assert backend.stats.graphs_seen >= 2 and backend.stats.graphs_captured >= 3
    assert private_pools() - before == {tuple(backend.session.pool.handle)}

