"""Breakable CUDA graphs and the manager, against eager. Runs on the GPU machine only.

A signature is captured on the second call of a size that has it (the first is observed:
run eagerly under the recorder); tests/test_breakable_cpu.py checks the same bookkeeping
on the CPU with segments="op_replay"."""

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.breakable.record import EagerStep
from cgcompile.testing.models import SILLY_OP, ToyLlama

from breakable_models import Flip, FlipModel, RunningStat
from cuda_helpers import capture_error_in_own_process, private_pools

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = (2, 4, 8, 16)


def _config(**kw):
    # padding=True: these models' rows never mix (the user's word, which breakable graphs need to pad).
    fields = dict(splitting_ops=(SILLY_OP,), capture_sizes=SIZES, use_breakable=True, compiler="eager", padding=True)
    return cgcompile.Config(**(fields | kw))


def _toy():
    torch.manual_seed(0)
    return ToyLlama(3, hidden=64, vocab=128).cuda()


@pytest.mark.parametrize("n", [2, 3, 5, 16])
def test_toy_llama_equals_eager_at_padded_sizes(n, monkeypatch):
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _toy()
    manager = cgcompile.GraphManager(model, _config())
    for _ in range(3):
        ids = torch.randint(0, 128, (n,), device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids), rtol=1e-5, atol=1e-5)
    (runner,) = manager.breakable.runners
    ((entry,),) = runner.graphs.values()  # the first call observed, the second captured, the third replayed
    segments = [s for s in entry.steps if not isinstance(s, EagerStep)]
    assert len(segments) == 4 and len(entry.steps) == 7  # 3 silly attentions break 4 segments


def test_fresh_tensor_op_results_reach_later_segments():
    # silly_attention returns a fresh tensor every call: replay must copy it into place.
    model = _toy()
    manager = cgcompile.GraphManager(model, _config())
    manager.run_pw_graph(model, (torch.randint(0, 128, (4,), device="cuda"),))
    for _ in range(3):
        ids = torch.randint(0, 128, (4,), device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids), rtol=1e-5, atol=1e-5)


class HostState:
    def __init__(self):
        self.scale = 1.0


class PythonBreakModel(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.state = state

    def forward(self, x):
        return self.b(scale_by_host_state(self.a(x), self.state))


@cgcompile.eager_break
def scale_by_host_state(x, state):
    return x * state.scale  # reads host-side state at call time, like attention metadata


def test_user_marked_python_break_reads_live_host_state():
    state = HostState()
    model = PythonBreakModel(state).cuda()
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    x = torch.randn(3, 16, device="cuda")
    manager.run_pw_graph(model, (x,))
    for scale in (2.0, -0.5):
        state.scale = scale
        x = torch.randn(3, 16, device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x))


class LazyMeta:
    """Like FlashMLA's metadata: a buffer built on the first call that uses this object."""

    def __init__(self):
        self.buffer = None


@cgcompile.eager_break
def lazy_scale(x, meta):
    if meta.buffer is None:
        meta.buffer = torch.full((1,), 3.0, device=x.device)
    return x * meta.buffer


class LazyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x, meta):
        return self.b(lazy_scale(self.a(x), meta) + self.a(x))


def test_lazy_init_op_capture_state_is_separate_from_warmup():
    model = LazyModel().cuda()
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    metas = {}

    def make_inputs(size, warmup):
        metas[(size, warmup)] = LazyMeta()
        return (torch.randn(size, 16, device="cuda"), metas[(size, warmup)])

    manager.capture(make_inputs, progress=False)
    for size in SIZES:
        warm, capture = metas[(size, True)], metas[(size, False)]
        assert capture.buffer is not None and capture.buffer.data_ptr() != warm.buffer.data_ptr()
        warm.buffer = None  # the warm-up state is gone: replay must not depend on it
    capture_meta = metas[(4, False)]
    del metas
    torch.cuda.empty_cache()
    garbage = torch.full((1 << 20,), float("nan"), device="cuda")
    x = torch.randn(3, 16, device="cuda")
    torch.testing.assert_close(manager.run_pw_graph(model, (x, capture_meta)), model(x, LazyMeta()))
    del garbage


def test_changed_non_tensor_input_is_another_signature_run_eagerly():
    model = LazyModel().cuda()
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    for _ in range(3):  # a new object every call: a new signature every call, never captured, always right
        x = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (x, LazyMeta())), model(x, LazyMeta()))
    assert manager.breakable.graph_count() == 0


def test_hf_llama_forward_equals_eager_at_padded_batches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    manager = cgcompile.GraphManager(model, cgcompile.Config(capture_sizes=SIZES, use_breakable=True))
    assert [r.module for r in manager.breakable.runners] == list(model.model.layers)  # a graph per layer
    with torch.inference_mode():
        for batch in (3, 3, 4, 4, 5, 5, 3):  # a transformers model runs at exact batch sizes
            ids = torch.randint(0, 128, (batch, 8), device="cuda")
            out = manager.run_pw_graph(model, {"input_ids": ids, "use_cache": False})
            ref = model(input_ids=ids, use_cache=False)
            torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    for runner in manager.breakable.runners:
        assert sorted(runner.graphs) == [3, 4, 5]


def test_pool_shared_between_compiled_and_breakable_paths():
    model = _toy()
    manager = cgcompile.GraphManager(model, _config(use_breakable=False))
    before = private_pools()
    ids = torch.randint(0, 128, (6,), device="cuda")
    torch._dynamo.mark_dynamic(ids, 0)
    compiled_out = manager.run_pw_graph(model, (ids,))
    breakable_out = manager.run_breakable(ids)
    torch.testing.assert_close(compiled_out, model(ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(breakable_out, model(ids), rtol=1e-5, atol=1e-5)
    for _ in range(2):  # alternate the paths: replays must not corrupt each other
        ids = torch.randint(0, 128, (6,), device="cuda")
        torch.testing.assert_close(manager.run_breakable(ids), model(ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids), rtol=1e-5, atol=1e-5)
    pool = tuple(manager.session.pool.handle)
    assert private_pools() - before == {pool}
    assert manager.backend.stats.graphs_captured > 0 and manager.breakable.graph_count() == 1


def test_clear_then_recapture():
    model = _toy()
    manager = cgcompile.GraphManager(model, _config())
    ids = torch.randint(0, 128, (5,), device="cuda")
    for _ in range(2):  # observe, capture
        manager.run_pw_graph(model, (ids,))
    assert manager.breakable.graph_count() == 1
    manager.clear()
    assert manager.breakable.graph_count() == 0 and manager.graph_memory() == 0
    for _ in range(2):
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids), rtol=1e-5, atol=1e-5)
    assert manager.breakable.graph_count() == 1


@pytest.mark.parametrize("how", ["parameter", "data"])
def test_replaced_weights_are_never_replayed_stale_and_are_captured_again(how):
    # One runner: dropping its graphs empties the pool, so the recapture needs a fresh one.
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _toy()
    manager = cgcompile.GraphManager(model, _config())
    (runner,) = manager.breakable.runners
    ids = torch.randint(0, 128, (4,), device="cuda")
    for _ in range(3):
        manager.run_pw_graph(model, (ids,))
    qkv = model.layers[0].qkv
    if how == "parameter":
        qkv.weight = nn.Parameter(torch.randn_like(qkv.weight))
    else:
        qkv.weight.data = torch.randn_like(qkv.weight)
    for _ in range(4):  # eager (moved), dropped and observed, captured, replayed
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids), rtol=1e-5, atol=1e-5)
    assert runner.addresses.calls_without_graphs == 1 and runner.addresses.recaptures == 1
    assert runner.graph_count() == 1


class BreakFirst(nn.Module):
    """Its first segment, before the split op, has no op: a graph that is never kept."""

    def __init__(self, tail: bool):
        super().__init__()
        self.tail = nn.Linear(8, 8) if tail else None

    def forward(self, x):  # x: [N, 8]
        h = torch.ops.cgcompile_testing.silly_attention(x, x, x)
        return h if self.tail is None else self.tail(h)


@pytest.mark.parametrize("tail", [True, False])
def test_a_module_that_starts_with_a_break_captures_into_a_live_pool(tail):
    # The empty first segment's graph is dropped; with no other graph in the pool, torch
    # released the pool and the next segment's capture failed (use_count > 0).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = BreakFirst(tail).cuda()
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    for n in (3, 3, 3, 5, 5, 5):
        x = torch.randn(n, 8, device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x), rtol=1e-5, atol=1e-5)


_FORKS_BEFORE_A_BREAK = """
from cgcompile.testing.models import SILLY_OP
class Forks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
    def forward(self, x):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = self.a(x)
        return torch.ops.cgcompile_testing.silly_attention(y, y, y)
model = Forks().cuda()
config = cgcompile.Config(splitting_ops=(SILLY_OP,), capture_sizes=(4,), use_breakable=True)
manager = cgcompile.GraphManager(model, config, boundary=None)
"""


def test_unjoined_side_stream_before_a_break_is_a_clear_error():
    # The first call is observed (eager, on the capture stream), the second captured.
    capture = '[manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),)) for _ in range(2)]'
    out = capture_error_in_own_process(_FORKS_BEFORE_A_BREAK, capture)
    assert "CaptureError: capturing Forks[size 4] (segment before" in out, out
    assert "side stream" in out


def test_eager_break_that_changes_its_result_structure_fails_loudly():
    flip = Flip()
    model = FlipModel(flip, 16).cuda()
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    for _ in range(2):  # observe, capture
        manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),))
    flip.tuple_result = True
    with pytest.raises(cgcompile.CaptureError,
                       match=r"eager step scale_or_pair: expected 1 tensor\(s\) in its result, as at capture .*got 2"):
        manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),))


def test_a_buffer_a_segment_updates_changes_once_per_call_also_when_capturing(monkeypatch):
    # Observed call, capturing call, replays: each must update the buffer exactly once.
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model, reference = RunningStat(16).cuda(), RunningStat(16).cuda()
    reference.load_state_dict(model.state_dict())
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 16, device="cuda")
            torch.testing.assert_close(manager.run_pw_graph(model, (x,)), reference(x))
            torch.testing.assert_close(model.stat, reference.stat)
