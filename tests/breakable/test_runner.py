"""Breakable graphs: on the CPU, the runner's bookkeeping with segments="op_replay".

op_replay records each segment's ops and re-runs them at replay on the tensors they were
recorded with, copying results into the recorded outputs: what a CUDA graph does (fixed
addresses, shapes and Python values frozen at capture), minus CUDA. So these tests check
on the CPU what decides the breaks and the signatures, what a replay reads live, and that
a stale replay is caught; the CUDA tests (marked `cuda`, at the end) check the same with CUDA
graphs, as does tests/breakable/test_transformers.py for Hugging Face models.
What only the GPU can check: capture itself (streams, the pool, memory reuse between
graphs), and kernels that behave differently inside a graph.
"""

import contextlib
import logging

import pytest
import torch
from torch import nn

import cgcompile
import cgcompile.inspect
from cgcompile.breakable.record import EagerStep, Recorder
from cgcompile.breakable.signature import flatten_call
from cgcompile.run.capture import Mode
from cgcompile.testing.models import ACCUMULATE_OP, SILLY_OP, ToyLlama
from cgcompile.testing.gpu import capture_error_in_own_process, private_pools
from cgcompile.testing.hf_models import tiny_llama

SIZES = (2, 4, 8, 16)


class Flip:
    """Host state an eager break reads: whether it returns a tuple or one tensor."""

    tuple_result = False


@cgcompile.eager_break
def scale_or_pair(x, flip):
    return (x * 2, x) if flip.tuple_result else x * 2


class FlipModel(nn.Module):
    """An eager break whose result structure can change after capture."""

    def __init__(self, flip: Flip, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.flip = flip

    def forward(self, x):
        out = scale_or_pair(self.a(x), self.flip)
        return out[0] if isinstance(out, tuple) else out


class RunningStat(nn.Module):
    """A buffer updated in place inside what becomes a captured segment."""

    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.register_buffer("stat", torch.zeros(width))

    def forward(self, x):
        h = self.a(x)
        self.stat.mul_(0.9).add_(h.mean(0), alpha=0.1)
        h = torch.ops.cgcompile_testing.silly_attention(h, h, h)
        return h * self.stat


pytestmark = pytest.mark.usefixtures("one_thread")


def manager_for(model, boundary=None, **config):
    # padding=True: these models' rows never mix (the user's word, which breakable graphs need to pad).
    fields = dict(splitting_ops=(SILLY_OP,), capture_sizes=SIZES, use_breakable=True, padding=True) | config
    return cgcompile.GraphManager(model, cgcompile.Config(**fields), boundary=boundary, segments="op_replay")


def runner_of(manager):
    (runner,) = manager.breakable.runners
    return runner


def test_toy_llama_equals_eager_and_is_captured_on_the_second_call_of_a_size():
    torch.manual_seed(0)
    model = ToyLlama(3, hidden=32, vocab=64)
    manager = manager_for(model)
    runner = runner_of(manager)
    counts = []
    for n in (3, 3, 3, 4, 5, 5, 5):
        ids = torch.randint(0, 64, (n,))
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))
        counts.append(runner.graph_count())
    assert counts == [0, 1, 1, 1, 1, 2, 2]  # sizes 4 (n = 3 and 4) and 8 (n = 5)
    entry = runner.graphs[4][0]
    eager = [s for s in entry.steps if isinstance(s, EagerStep)]
    assert len(eager) == 3 and len(entry.steps) == 7  # three attentions between four segments


class HostCache:
    """State an @eager_break function holds: read at call time, at capture and replay."""

    def __init__(self):
        self.keys = []


@cgcompile.eager_break
def attend(q, cache, mask):
    """Appends q to the cache and attends over it: its result is [B, D] whatever the length."""
    cache.keys.append(q.clone())
    keys = torch.stack(cache.keys, 1)  # [B, L, D]
    scores = (keys * q[:, None]).sum(-1) + mask  # [B, L]
    return (scores.softmax(-1)[..., None] * keys).sum(1)


class Decoder(nn.Module):
    def __init__(self, cache):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.cache = cache

    def forward(self, x, mask):  # x: [B, 8], mask: [B, L], read only by the eager break
        return self.b(attend(self.a(x), self.cache, mask))


def test_an_input_only_eager_breaks_read_is_live_its_length_free():
    torch.manual_seed(0)
    cache, reference_cache = HostCache(), HostCache()
    model, reference = Decoder(cache), Decoder(reference_cache)
    reference.load_state_dict(model.state_dict())
    manager = manager_for(model)
    for length in range(1, 8):
        x, mask = torch.randn(3, 8), torch.randn(3, length)
        torch.testing.assert_close(manager.run_pw_graph(model, (x, mask)), reference(x, mask))
    runner = runner_of(manager)
    assert runner.graph_count() == 1  # one graph, whatever the mask's length
    assert len(cache.keys) == len(reference_cache.keys) == 7  # the eager break ran once per call


def test_eager_steps_run_once_per_call_even_the_capturing_one():
    calls = []

    @cgcompile.eager_break
    def count(x):
        calls.append(1)
        return x * 2

    model = nn.Sequential(nn.Linear(4, 4))
    model.forward = lambda x: count(model[0](x))  # noqa: E731 - a tiny model with a break
    manager = cgcompile.GraphManager(nn.Identity(), cgcompile.Config(use_breakable=True), boundary=None,
                                     segments="op_replay")
    runner = cgcompile.BreakableRunner(model, manager.config, manager.session, segments="op_replay")
    for _ in range(4):  # observe, capture, replay, replay
        runner(torch.randn(2, 4))
    assert len(calls) == 4 and runner.graph_count() == 1


class State:
    k = None


@cgcompile.eager_break
def grow(x, state):
    """The common mistake: returns the growing cache itself, which a captured op reads."""
    state.k = x if state.k is None else torch.cat([state.k, x], 1)
    return state.k  # [B, L]


class Growing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.state = State()

    def forward(self, x):  # x: [B, 4]
        return x * grow(self.a(x), self.state).mean(1, keepdim=True)  # the mean is captured


def test_a_captured_op_reading_a_result_whose_shape_changed_raises():
    model = Growing()
    manager = manager_for(model)
    manager.run_pw_graph(model, (torch.randn(4, 4),))  # observe
    manager.run_pw_graph(model, (torch.randn(4, 4),))  # capture, with a cache of length 2
    with pytest.raises(cgcompile.CaptureError, match=r"Growing\[size 4\]: eager step grow: expected a result of "
                                                     r"shape \(4, 2\), as at capture \(a captured op reads it.*got "
                                                     r"\(4, 3\); move the ops that read it into the eager break"):
        manager.run_pw_graph(model, (torch.randn(4, 4),))


class Meta:
    def __init__(self, scale):
        self.scale = scale


@cgcompile.eager_break
def scale_by(x, meta):
    return x * meta.scale


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, meta, flag=True):
        y = scale_by(self.a(x), meta)
        return y if flag else -y


def test_a_changed_python_input_is_another_signature_not_an_error():
    model, meta = Scaled(), Meta(2.0)
    manager = manager_for(model)
    runner = runner_of(manager)
    for flag in (True, True, True, False, False, True):
        x = torch.randn(4, 4)
        torch.testing.assert_close(manager.run_pw_graph(model, (x, meta, flag)), model(x, meta, flag))
    assert runner.graph_count() == 2  # one per value of flag
    other = Meta(-1.0)  # another object: its own signature; runs eagerly, correctly
    x = torch.randn(4, 4)
    torch.testing.assert_close(manager.run_pw_graph(model, (x, other, True)), model(x, other, True))


class Syncs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return y * float(y.detach().abs().max())  # .item(): a host sync inside what would be a segment


def test_a_host_sync_in_a_segment_makes_the_call_uncapturable_not_wrong(caplog):
    model = Syncs()
    manager = manager_for(model)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for _ in range(4):
            x = torch.randn(4, 4)
            torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x))
    assert runner_of(manager).graph_count() == 0
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "run eagerly" in warning and "_local_scalar_dense" in warning and "synchronises with the host" in warning


def test_an_eager_break_that_changes_its_result_structure_raises():
    flip = Flip()
    model = FlipModel(flip, 4)
    manager = manager_for(model)
    for _ in range(2):  # observe, capture
        manager.run_pw_graph(model, (torch.randn(4, 4),))
    flip.tuple_result = True
    with pytest.raises(cgcompile.CaptureError,
                       match=r"eager step scale_or_pair: expected 1 tensor\(s\) in its result, as at capture .*got 2"):
        manager.run_pw_graph(model, (torch.randn(4, 4),))


def test_ahead_of_time_capture_observes_in_warm_up_and_captures_in_the_capture_run():
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=32, vocab=64)
    manager = manager_for(model)
    runner = runner_of(manager)
    for size in (8, 4):  # what GraphManager.capture does on a GPU, without its final synchronize
        for mode in (Mode.WARMUP, Mode.CAPTURE):
            with manager.session.mode_as(mode):
                manager.run_breakable(torch.zeros(size, dtype=torch.long))
    assert sorted(runner.graphs) == [4, 8]
    ids = torch.randint(0, 64, (7,))
    torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))


def test_ahead_of_time_capture_at_exact_sizes_gets_every_capture_size():
    # The default: exact sizes, 35 capture sizes, more than exact_size_limit (32).
    model = ToyLlama(1, hidden=16, vocab=32)
    manager = manager_for(model, padding=None, capture_sizes=cgcompile.Config().sizes.capture_sizes)
    sizes = sorted(manager.config.sizes.capture_sizes, reverse=True)
    assert len(sizes) > manager.config.sizes.exact_size_limit
    for size in sizes:  # what GraphManager.capture does on a GPU, largest first
        for mode in (Mode.WARMUP, Mode.CAPTURE):
            with manager.session.mode_as(mode):
                manager.run_breakable(torch.zeros(size, dtype=torch.long))
    assert sorted(runner_of(manager).graphs) == sorted(sizes)


def test_clear_drops_graphs_and_later_calls_capture_again():
    model = ToyLlama(1, hidden=32, vocab=64)
    manager = manager_for(model)
    for _ in range(2):
        manager.run_pw_graph(model, (torch.randint(0, 64, (4,)),))
    manager.clear()
    assert manager.breakable.graph_count() == 0
    for _ in range(2):  # the signature is still known: two calls in a row capture it
        ids = torch.randint(0, 64, (4,))
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))
    assert manager.breakable.graph_count() == 1


def _replace_weight(model, how: str) -> None:
    """Give the first layer new weights without touching the old tensors' memory."""
    layer = model.layers[0]
    if how == "parameter":
        layer.qkv.weight = nn.Parameter(torch.randn_like(layer.qkv.weight))
    elif how == "data":
        layer.qkv.weight.data = torch.randn_like(layer.qkv.weight)
    else:  # a submodule swapped for another
        up = nn.Linear(layer.up.in_features, layer.up.out_features, bias=False)
        layer.up = up


def _captured_toy():
    """A ToyLlama whose size-4 graph is captured and replayed once: (model, manager, runner, ids)."""
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=32, vocab=64)
    manager = manager_for(model)
    ids = torch.randint(0, 64, (4,))
    for _ in range(3):
        manager.run_pw_graph(model, (ids,))
    runner = runner_of(manager)
    assert runner.graph_count() == 1
    return model, manager, runner, ids


@pytest.mark.parametrize("how", ["parameter", "data", "submodule"])
def test_replaced_weights_never_replay_and_are_captured_again(how, caplog):
    model, manager, runner, ids = _captured_toy()
    _replace_weight(model, how)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for _ in range(4):  # eager (moved), recaptured (settled: observed again), captured, replayed
            torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))
    assert runner.addresses.calls_without_graphs == 1 and runner.addresses.recaptures == 1
    assert runner.graph_count() == 1
    moved = [r.getMessage() for r in caplog.records if "runs without CUDA graphs" in r.getMessage()]
    assert len(moved) == 1 and "layers.0." in moved[0]


def test_weights_updated_in_place_keep_their_graphs():
    model, manager, runner, ids = _captured_toy()
    with torch.no_grad():
        model.layers[0].qkv.weight.copy_(torch.randn_like(model.layers[0].qkv.weight))
    entry = runner.graphs[4][0]
    torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))
    assert runner.graphs[4][0] is entry and runner.addresses.calls_without_graphs == 0


class RowMixing(nn.Module):
    """Centres over dim 0 and normalises over it: a padding row would change every real row."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):  # x: [N, 8]
        h = self.a(x)
        h = torch.ops.cgcompile_testing.silly_attention(h - h.mean(0, keepdim=True), h, h)
        return self.b(h).softmax(0)


def test_breakable_graphs_pad_only_when_told_rows_never_mix():
    torch.manual_seed(0)
    model = RowMixing()
    manager = manager_for(model, padding=None)  # the default: exact sizes, as nothing proves padding safe
    for _ in range(3):
        x = torch.randn(3, 8)
        torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x))
    assert sorted(runner_of(manager).graphs) == [3]
    padded = manager_for(model, padding=True)  # the user's word: here a wrong one
    x = torch.randn(3, 8)
    padded.run_pw_graph(model, (x,))
    assert runner_of(padded).sizes.size_for(3) == 4


class ReshapesInPlace(nn.Module):
    """In-place view ops (`t_`, `unsqueeze_`) change a tensor object's shape, not its data."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):  # x: [N, 8]
        h = torch.ops.cgcompile_testing.silly_attention(x, x, x)
        y = self.a(h) * 2.0
        y.t_()  # [8, N]
        y.unsqueeze_(0)  # [1, 8, N]
        return y + 1.0


def test_op_replay_runs_in_place_view_ops_once_as_a_graph_does():
    torch.manual_seed(0)
    model = ReshapesInPlace()
    manager = manager_for(model)
    for _ in range(4):
        x = torch.randn(4, 8)
        torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x))
    assert runner_of(manager).graph_count() == 1


def test_describe_and_dump_show_each_graphs_steps(tmp_path, capsys):
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=32, vocab=64)
    manager = manager_for(model, dump_dir=str(tmp_path))
    for _ in range(2):
        manager.run_pw_graph(model, (torch.randint(0, 64, (3,)),))
    text = manager.breakable.describe()
    lines = text.splitlines()
    assert lines[0] == "runner 0: ToyLlama: 1 graph" and lines[1].startswith("  size 4 [args[0] (4,) int64")
    steps = [line.strip() for line in lines[2:]]
    assert [s.split(":")[0] for s in steps] == ["graph segment", "eager step"] * 2 + ["graph segment"]
    assert steps[1] == "eager step: cgcompile_testing.silly_attention.default"
    assert "mm.default x4" in steps[2]  # o_proj, up, down and the next layer's qkv
    (dump,) = tmp_path.iterdir()
    assert dump.name.startswith("breakable_") and dump.read_text() == text + "\n"
    assert cgcompile.inspect.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"breakable graphs\n{text}\n"


def test_segments_argument_is_checked():
    with pytest.raises(cgcompile.ArgumentError, match=r"GraphManager: segments: expected one of \('cuda_graphs', "
                                                      r"'op_replay'\), got 'ops'"):
        cgcompile.GraphManager(ToyLlama(1), cgcompile.Config(use_breakable=True), segments="ops")
    with pytest.raises(cgcompile.ArgumentError, match="set Config\\(use_breakable=True\\)"):
        cgcompile.GraphManager(ToyLlama(1), cgcompile.Config(use_breakable=False), segments="op_replay")


class FakeGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


class FakeSession:
    """The CaptureSession calls CudaGraphSegments makes, logged; ops run eagerly on the CPU."""

    def __init__(self):
        self.log = []

    def begin_graph(self):
        self.log.append("begin")
        return FakeGraph(self.log)

    def end_graph(self, graph, name):
        self.log.append(f"end {name.split('(segment before ')[1].rstrip(')')}")

    def abandon(self, graph):
        self.log.append("abandon")

    def on_capture_stream(self):
        self.log.append("capture stream")
        return contextlib.nullcontext()


def test_cuda_segments_begin_where_the_last_ended_and_replay_once_after_capture():
    # What only the GPU runs, driven with a logging session: the order of the session's calls.
    from cgcompile.breakable.segments import CudaGraphSegments

    session = FakeSession()
    model = ToyLlama(2, hidden=32, vocab=64)
    leaves, structure = flatten_call((torch.zeros(4, dtype=torch.long),), {})
    split_ops = cgcompile.Config(splitting_ops=(SILLY_OP,)).split_ops
    recorder = Recorder("Toy[size 4]", CudaGraphSegments(session), split_ops, leaves, structure, model, {0})
    with CudaGraphSegments(session).context():
        with recorder:
            model(*leaves)
        recording = recorder.finish(None)
    attention = "cgcompile_testing.silly_attention.default"
    assert session.log == ["capture stream", "begin", f"end {attention}", "replay", "begin", f"end {attention}",
                           "replay", "begin", "end the end of forward", "replay"]
    assert [type(s).__name__ for s in recording.steps] == ["SegmentStep", "EagerStep"] * 2 + ["SegmentStep"]


def test_an_empty_cuda_segment_is_ended_without_a_replay():
    from cgcompile.breakable.segments import CudaGraphSegments

    session = FakeSession()
    segments = CudaGraphSegments(session)
    assert segments.end(segments.begin(), "X (segment before y)", True) is None
    assert session.log == ["begin", "end y"]


def test_a_buffer_a_segment_updates_changes_once_per_call_also_when_capturing():
    # Observed call, capturing call, replays: each updates the buffer exactly once.
    torch.manual_seed(0)
    model, reference = RunningStat(4), RunningStat(4)
    reference.load_state_dict(model.state_dict())
    manager = manager_for(model)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 4)
            torch.testing.assert_close(manager.run_pw_graph(model, (x,)), reference(x))
            torch.testing.assert_close(model.stat, reference.stat)


class WritesIntoOut(nn.Module):
    """Writes into its input `out` (and returns what `how` says), through the split op
    silly_accumulate (`out += sin(v)`) as attention writes the output buffer it is handed.

    how: "eager" (only the split op touches out: live at replay), "view" (into a view a
    captured op makes: out gets a static buffer), "captured" (a captured op scales out after
    the split op), "read_after" (a captured op reads out after the split op wrote it),
    "buffer" (into rows of a buffer of the module; out untouched).
    """

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a = nn.Linear(8, 8)
        self.register_buffer("acc", torch.zeros(16, 8))

    def forward(self, x, out):  # x, out: [n, 8]
        h = self.a(x)
        accumulate = torch.ops.cgcompile_testing.silly_accumulate
        if self.how == "eager":
            accumulate(out, h)
        elif self.how == "view":
            accumulate(out[:, 3:], h[:, :5])
        elif self.how == "captured":
            accumulate(out, h)
            out.mul_(-2.0)
        elif self.how == "read_after":
            accumulate(out, h)
            return out * 3.0
        else:
            accumulate(self.acc[:x.shape[0]], h)
            return self.acc * 1.0
        return None


# (how, padding). Not ("buffer", True): padded, the module sees the padded row count and
# writes rows n.. of its buffer too, as eager would at that size (padding=True is the
# user's word that no row reaches another, which a write of rows [:n] into state breaks).
WRITES = [(how, padding) for how in ("eager", "view", "captured", "read_after", "buffer") for padding in (None, True)
          if (how, padding) != ("buffer", True)]
WRITE_IDS = [f"{how}-{'padded' if padding else 'exact'}" for how, padding in WRITES]


def _writes_match_eager(manager, model, reference, device: str, calls: int = 5) -> None:
    """Every call (observe, capture, replays) writes into the caller's tensors exactly once."""
    n = 3
    for call in range(calls):
        x = torch.randn(n, 8, device=device)
        big = torch.randn(n, 12, device=device)  # out is a view of it: writes must reach big
        want = big.clone()
        got = manager.run_pw_graph(model, (x, big[:, 2:10]))
        torch.testing.assert_close(got, reference(x, want[:, 2:10]), msg=lambda m: f"call {call}: {m}")
        torch.testing.assert_close(big, want, msg=lambda m: f"call {call}: out: {m}")
        torch.testing.assert_close(model.acc, reference.acc, msg=lambda m: f"call {call}: acc: {m}")
    assert sum(r.graph_count() for r in manager.breakable.runners) == 1


@pytest.mark.parametrize("how, padding", WRITES, ids=WRITE_IDS)
def test_a_write_into_an_input_or_buffer_lands_once_per_call_also_when_recording(how, padding):
    torch.manual_seed(0)
    model, reference = WritesIntoOut(how), WritesIntoOut(how)
    reference.load_state_dict(model.state_dict())
    manager = manager_for(model, splitting_ops=(SILLY_OP, ACCUMULATE_OP), padding=padding)
    with torch.no_grad():
        _writes_match_eager(manager, model, reference, "cpu")


# ---- CUDA: breakable CUDA graphs and the manager, against eager ----
# A signature is captured on the second call of a size that has it (the first is observed:
# run eagerly under the recorder).

def _config(**kw):
    # padding=True: these models' rows never mix (the user's word, which breakable graphs need to pad).
    fields = dict(splitting_ops=(SILLY_OP,), capture_sizes=SIZES, use_breakable=True, compiler="eager", padding=True)
    return cgcompile.Config(**(fields | kw))


def _toy():
    torch.manual_seed(0)
    return ToyLlama(3, hidden=64, vocab=128).cuda()


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("n", [2, 3, 5, 16])
def test_toy_llama_equals_eager_at_padded_sizes(n, monkeypatch):
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    model = _toy()
    manager = cgcompile.GraphManager(model, _config())
    for _ in range(3):
        ids = torch.randint(0, 128, (n,), device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids), rtol=1e-5, atol=1e-5)
    (runner,) = manager.breakable.runners
    ((entry,),) = runner.graphs.values()  # the first call observed, the second captured, the third replayed
    segments = [s for s in entry.steps if not isinstance(s, EagerStep)]
    assert len(segments) == 4 and len(entry.steps) == 7  # 3 silly attentions break 4 segments


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
def test_changed_non_tensor_input_is_another_signature_run_eagerly():
    model = LazyModel().cuda()
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    for _ in range(3):  # a new object every call: a new signature every call, never captured, always right
        x = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(manager.run_pw_graph(model, (x, LazyMeta())), model(x, LazyMeta()))
    assert manager.breakable.graph_count() == 0


@pytest.mark.cuda
def test_hf_llama_forward_equals_eager_at_padded_batches():
    model = tiny_llama(device="cuda")
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("how", ["parameter", "data"])
def test_replaced_weights_are_never_replayed_stale_and_are_captured_again(how):
    # One runner: dropping its graphs empties the pool, so the recapture needs a fresh one.
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


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("tail", [True, False])
def test_a_module_that_starts_with_a_break_captures_into_a_live_pool(tail):
    # The empty first segment's graph is dropped; with no other graph in the pool, torch
    # released the pool and the next segment's capture failed (use_count > 0).
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


@pytest.mark.cuda
def test_unjoined_side_stream_before_a_break_is_a_clear_error():
    # The first call is observed (eager, on the capture stream), the second captured.
    # Under no_grad, as inference runs: a call that needs gradients would run eagerly.
    capture = 'with torch.no_grad(): [manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),)) for _ in range(2)]'
    out = capture_error_in_own_process(_FORKS_BEFORE_A_BREAK, capture)
    assert "CaptureError: capturing Forks[size 4] (segment before" in out, out


@pytest.mark.cuda
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


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_a_buffer_a_segment_updates_changes_once_per_call_also_when_capturing_on_cuda(monkeypatch):
    # Observed call, capturing call, replays: each must update the buffer exactly once.
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    torch.manual_seed(0)
    model, reference = RunningStat(16).cuda(), RunningStat(16).cuda()
    reference.load_state_dict(model.state_dict())
    manager = cgcompile.GraphManager(model, _config(), boundary=None)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 16, device="cuda")
            torch.testing.assert_close(manager.run_pw_graph(model, (x,)), reference(x))
            torch.testing.assert_close(model.stat, reference.stat)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("how, padding", WRITES, ids=WRITE_IDS)
def test_a_write_into_an_input_or_buffer_lands_once_per_call_also_when_capturing_on_cuda(how, padding,
                                                                                         monkeypatch):
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    torch.manual_seed(0)
    model, reference = WritesIntoOut(how).cuda(), WritesIntoOut(how).cuda()
    reference.load_state_dict(model.state_dict())
    manager = cgcompile.GraphManager(model, _config(splitting_ops=(SILLY_OP, ACCUMULATE_OP), padding=padding),
                                     boundary=None)
    with torch.inference_mode():
        _writes_match_eager(manager, model, reference, "cuda")


class _WrappedWeight(nn.Module):
    """A weight that is a wrapper subclass (as a DTensor shard is): graphs read what it wraps."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        w = torch.randn(8, 8)
        self.w = nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)

    def forward(self, x):
        h = torch.relu(x @ self.w).a
        return torch.ops.cgcompile_testing.silly_attention(h, h, h) * 2


def test_a_replaced_wrapper_subclass_weight_never_replays_stale(caplog):
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    model = _WrappedWeight()
    manager = manager_for(model, boundary=None, capture_sizes=(4,))
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x))
        w = torch.randn(8, 8)
        model.w = nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)
        with caplog.at_level(logging.WARNING, logger="cgcompile"):
            for _ in range(3):  # without graphs, captured again, replayed
                torch.testing.assert_close(manager.run_pw_graph(model, (x,)), model(x))
    runner = runner_of(manager)
    assert runner.addresses.calls_without_graphs == 1 and runner.addresses.recaptures == 1
    assert "'w.a' is at" in caplog.text
