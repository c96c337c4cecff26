"""A probe (`CaptureSession.probe`, what a memory plan measures with) captures into a
temporary pool through the runners' own session: nothing is patched onto the runners or
runtimes, nothing registered twice, and the session comes back as it was. On CPU through
fake graphs (the pool's bytes need CUDA: the GPU tests of test_memory_plan measure them)."""

import torch

import cgcompile
from cgcompile.tools.aot_capture import capture_all
from cgcompile.testing import fake_graphs
from cgcompile.testing.models import SILLY_OP, ToyLlama


def _ids(n):
    ids = torch.randint(0, 64, (n,))
    torch._dynamo.mark_dynamic(ids, 0)
    return ids


def _fake_backend(monkeypatch):
    fake_graphs.fake_cuda_graphs(monkeypatch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # clear() and capture_all wait on CUDA
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyLlama(2)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=(SILLY_OP,), capture_sizes=(2, 4, 8)))
    return model, backend, torch.compile(model, backend=backend)


@torch.no_grad()
def test_a_probe_captures_through_the_runners_own_session_and_gives_it_back(monkeypatch):
    model, backend, compiled = _fake_backend(monkeypatch)
    ids = _ids(3)
    torch.testing.assert_close(compiled(ids), model(ids))  # traced, and graphs of size 4 captured lazily
    session = backend.session
    session.clear()
    registered = len(session._runners)
    runners = [r for r in backend.runtimes[0].runners if r.replays_graphs]
    assert runners and all(r.session is session for r in runners)
    make = lambda size, warmup: (_ids(size),)  # noqa: E731

    with session.probe() as probe:
        assert probe is session  # the session every runner holds, not one patched onto them
        capture_all(probe, compiled, make, (8, 4), progress=False)
        assert backend.graphs_held() == 2 * len(runners)  # every graph piece, at sizes 8 and 4

    assert backend.graphs_held() == 0  # the probe's graphs went with its pool
    assert session.lazy_capture and session.padding.sizes == (2, 4, 8)
    assert len(session._runners) == registered  # nothing registered again
    assert all(r.session is session for r in runners)
    ids = _ids(5)
    torch.testing.assert_close(compiled(ids), model(ids))  # lazily captured again, into the session's pool
    assert backend.graphs_held() == len(runners)  # size 8's graphs


@torch.no_grad()
def test_a_probe_leaves_a_budgeted_sessions_settings(monkeypatch):
    model, backend, compiled = _fake_backend(monkeypatch)
    compiled(_ids(3))
    session = backend.session
    session.clear()
    session.keep_only((4,))  # what a capture under a memory budget leaves
    with session.probe():
        assert session.lazy_capture  # the probe's own settings meanwhile: what clear() gives
    assert not session.lazy_capture and session.padding.sizes == (4,)
    for n, size in [(3, 4), (4, 4), (6, None)]:
        ids = _ids(n)
        torch.testing.assert_close(compiled(ids), model(ids))
        step = backend.runtimes[0].step
        assert (step.n, step.size) == (n, size)
