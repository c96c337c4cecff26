"""Breakable graphs on the CPU: the runner's bookkeeping with segments="op_replay".

op_replay records each segment's ops and re-runs them at replay on the tensors they were
recorded with, copying results into the recorded outputs: what a CUDA graph does (fixed
addresses, shapes and Python values frozen at capture), minus CUDA. So these tests check
on the CPU what decides the breaks and the signatures, what a replay reads live, and that
a stale replay is caught; tests/test_cuda_breakable*.py check the same with CUDA graphs.
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
from cgcompile.capture import Mode
from cgcompile.testing.models import SILLY_OP, ToyLlama

from breakable_models import Flip, FlipModel, RunningStat

SIZES = (2, 4, 8, 16)


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
    manager = manager_for(model, padding=None, capture_sizes=cgcompile.Config().capture_sizes)
    sizes = sorted(manager.config.capture_sizes, reverse=True)
    assert len(sizes) > manager.config.exact_size_limit
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
