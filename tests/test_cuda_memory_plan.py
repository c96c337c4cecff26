"""Graph memory on the GPU: budgets, estimates against the real pool, an encoder against eager,
two models in one process, and one pool per torch.compile call with the string backend."""

import pytest
import torch
from torch import nn
from transformers import ViTConfig, ViTModel

import cgcompile
from cgcompile.testing.models import SILLY_OP, ToyLlama

from cuda_helpers import private_pools

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = (2, 4, 8, 16, 32, 64)
IMAGES = (1, 2, 4, 8, 16, 32)


@pytest.fixture(autouse=True)
def exact_fp32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _ids(n, dynamic=False):
    ids = torch.randint(0, 4096, (n,), device="cuda")
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
    return ids


def _make_ids(size, warmup):
    return (_ids(size),)


def _decoder(compiler="inductor", n_layers=4, **cfg):
    torch.manual_seed(0)
    model = ToyLlama(n_layers, hidden=1024, vocab=4096).cuda()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler=compiler, capture_sizes=SIZES,
                                                 **cfg))
    compiled = torch.compile(model, backend=backend)
    compiled(_ids(5, dynamic=True))  # traced with a dynamic capture dimension
    backend.clear()  # that call captured size 8 lazily; plans start from an empty pool
    return model, backend, compiled


def _vit(compiler, **cfg):
    torch.manual_seed(0)
    config = ViTConfig(image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       intermediate_size=1024, attn_implementation="sdpa")
    model = ViTModel(config, add_pooling_layer=False).cuda().eval()
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


@torch.inference_mode()
def test_plan_then_capture_within_budget_estimate_within_ten_percent():
    model, backend, compiled = _decoder()
    full = backend.plan_memory(compiled, _make_ids, name="decoder")
    print(full.format())
    assert backend.graphs_held() == 0 and backend.graph_memory() == 0  # the profile released everything
    pools = [row.pool_bytes for row in full.sizes]
    assert [row.size for row in full.sizes] == sorted(SIZES, reverse=True)
    assert all(p > 0 for p in pools) and pools == sorted(pools)  # cumulative
    assert full.graphs == 5 * len(SIZES)  # 4 layers: 5 capturable pieces per size
    budget = (pools[0] + pools[-1]) // 2 if pools[-1] > pools[0] else pools[-1]
    graphs = backend.capture(compiled, _make_ids, memory_budget=budget, name="decoder")
    plan = backend.memory_plan
    print(plan.format())
    _check_budgeted(backend, plan, budget)
    assert len(plan.captured) >= 1 and graphs == plan.graphs == backend.graphs_held()
    held = backend.graphs_held()
    for n in (3, 5, 64, 2, 70, 17):
        ids = _ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
        assert backend.runtimes[0].step.size == plan.runs_at(n)
    assert backend.graphs_held() == held  # nothing captured lazily after a budgeted capture
    assert backend.graph_memory() <= budget


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
    ids = _ids(64)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert backend.graphs_held() == held


@torch.inference_mode()
def test_a_budget_nothing_fits_captures_nothing_and_calls_still_match():
    model, backend, compiled = _decoder("eager")
    assert backend.capture(compiled, _make_ids, memory_budget=1) == 0
    assert backend.memory_plan.captured == () and backend.graph_memory() == 0
    for n in (3, 8):
        ids = _ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.graphs_held() == 0


@torch.inference_mode()
def test_clear_lifts_the_budget():
    model, backend, compiled = _decoder("eager")
    backend.capture(compiled, _make_ids, memory_budget=1)
    backend.clear()
    compiled(_ids(3))
    assert backend.graphs_held() == 5  # captured lazily at size 4 again


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
    pairs = [(vit, enc, _pixels, 2e-3), (dec_model, dec, _ids, 2e-3)]
    _interleave(pairs, [3, 32, 2, 17, 8, 5, 32, 3])
    assert (enc_backend.graphs_held(), dec_backend.graphs_held()) == held


@torch.inference_mode()
def test_draft_beside_target_with_the_string_backend():
    torch.manual_seed(0)
    draft, target = ToyLlama(1, hidden=256, vocab=4096).cuda(), ToyLlama(6, hidden=1024, vocab=4096).cuda()
    options = {"compiler": "eager", "capture_sizes": list(SIZES), "splitting_ops": [SILLY_OP], "check_addresses": True}
    draft_c = torch.compile(draft, backend="cgcompile", options=dict(options))
    target_c = torch.compile(target, backend="cgcompile", options=dict(options))
    draft_c(_ids(5, dynamic=True))
    target_c(_ids(5, dynamic=True))
    draft_b, target_b = cgcompile.backend_of(draft_c), cgcompile.backend_of(target_c)
    assert draft_b is not target_b
    draft_b.capture(draft_c, _make_ids, memory_budget=256 << 20, name="draft")
    target_b.capture(target_c, _make_ids, memory_budget=1 << 30, name="target")
    assert draft_b.session.pool.handle != target_b.session.pool.handle
    for n in (4, 4, 4, 16, 4, 4, 4, 16):  # draft steps, then the target verifies a longer run
        for model, compiled in ((draft, draft_c), (target, target_c)):
            ids = _ids(n)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)


class _TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        x = self.first(x).relu()
        torch._dynamo.graph_break()
        return self.second(x).relu()


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
