"""The runtime of one Dynamo graph: its executors, the sizes it hands down, and capture
recovery as an exception the runtime catches (CPU, with faked CUDA graphs)."""

import pytest
import torch
from torch.fx import Interpreter

import cgcompile
from cgcompile.build import phases
from cgcompile.run import recovery
from cgcompile.run.full_graph import FullGraph
from cgcompile.run.replay_plan import ReplayPlans
from cgcompile.run.runtime import CallSize, PieceCaptureFailed, PieceRunner, SplitPiece, Stitch
from cgcompile.testing import fake_graphs

LIB = torch.library.Library("cgcompile_runtime_test", "DEF")
LIB.define("reads_on_host(Tensor x) -> Tensor")


def _reads_on_host(x):
    # Fine eagerly; refused while a (fake) capture runs, as a device-to-host read is.
    if fake_graphs.FakeGraph.capturing:
        raise RuntimeError("operation not permitted when stream is capturing")
    return x * (1.0 if x.abs().sum().item() >= 0 else 2.0)


LIB.impl("reads_on_host", _reads_on_host, "CPU")
LIB.impl("reads_on_host", lambda x: torch.empty_like(x), "Meta")

W = torch.randn(16, 16)


def _model(x):
    y = torch.sin(x) @ W
    y = torch.ops.cgcompile_runtime_test.reads_on_host(y)
    return torch.relu(y) * 2


def _fake_capture_alone(finder, node):
    fake_graphs.FakeGraph.capturing = True
    try:
        Interpreter.run_node(finder, node)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        fake_graphs.FakeGraph.capturing = False
    return None


def _paddable(x):
    return torch.relu(torch.sin(x) @ W) * 2


def _run(compiled, sizes=(3, 5, 3, 5), model=_model):
    for n in sizes:
        x = torch.randn(n, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), model(x))


def _compiled(monkeypatch, model=_model):
    torch._dynamo.reset()
    fake_graphs.fake_cuda_graphs(monkeypatch)
    monkeypatch.setattr(recovery._NodeByNodeCapture, "_capture_alone", _fake_capture_alone)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_sizes=(1, 2, 4, 8), padding=True))
    return backend, torch.compile(model, backend=backend)


def test_a_failed_capture_is_recovered_by_the_runtime_and_nothing_is_patched(monkeypatch):
    backend, compiled = _compiled(monkeypatch)
    _run(compiled)
    (runtime,) = backend.runtimes
    # The runtime swapped its own runner for the re-split; the pieces carry no callback.
    replaced = runtime.stitch.runners["piece_0"]
    assert isinstance(replaced, SplitPiece)
    assert [r.piece_name for r in replaced.inner.runners.values()] == [
        "graph0.piece_0.piece_0", "graph0.piece_0.piece_1", "graph0.piece_0.piece_2"]
    assert not any(hasattr(r, "recover") for r in runtime.runners)
    assert not any(hasattr(r, "step") for r in runtime.runners)  # sizes are passed, not shared
    # The stitch it was handed holds the split's own piece modules, not the runners.
    assert not any(isinstance(m, PieceRunner) for m in runtime.stitch.stitch.children())
    assert fake_graphs.FakeGraph.replays > 0 and backend.graphs_held() > 0
    assert backend.pieces[0].reason.startswith("capture_failed: split at ")


def test_without_recovery_a_failed_capture_raises_the_piece_and_its_arguments(monkeypatch):
    monkeypatch.setattr(phases, "piece_recovery", lambda *args: None)
    backend, compiled = _compiled(monkeypatch)
    x = torch.randn(3, 16)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(PieceCaptureFailed) as raised:
        compiled(x)
    failed = raised.value
    assert failed.piece.piece_name == "graph0.piece_0"
    assert isinstance(failed.cause, cgcompile.CaptureError) and failed.__cause__ is failed.cause
    assert [tuple(v.shape) for v in failed.inputs] == [(3, 16), (16, 16)]  # x, then W
    # The host read makes the graph unsafe to pad: it captures at the exact size, on copies.
    assert [tuple(v.shape) for v in failed.padded] == [(3, 16), (16, 16)]
    assert failed.padded[0] is not failed.inputs[0] and torch.equal(failed.padded[0], x)
    assert isinstance(failed, cgcompile.CaptureError)  # what callers of a capture catch


def test_each_call_runs_one_executor_at_the_size_it_was_handed(monkeypatch):
    backend, compiled = _compiled(monkeypatch, _paddable)
    _run(compiled, sizes=(3, 3, 3), model=_paddable)
    (runtime,) = backend.runtimes
    assert runtime.step == CallSize(3, 4)
    assert [type(e) for e in runtime.executors] == [ReplayPlans, Stitch]
    assert [e.kind for e in runtime.executors] == ["replay plan", "stitch"]
    assert all(isinstance(e.kind, str) and callable(e.run) for e in runtime.executors)
    assert FullGraph.kind == "full graph"
    assert runtime.plans.get(3, 4) is not None  # every graph piece captured at 4: a plan runs it
    # The stitch runs any (n, size) it is handed; without graphs it captures nothing.
    x = torch.randn(5, 16)
    captures = fake_graphs.FakeGraph.captures
    by_name = {"l_x_": x, "g_w_": W}  # Dynamo's inputs; any other is the size symbol
    placeholders = [n.name for n in runtime.stitch.stitch.graph.nodes if n.op == "placeholder"]
    outputs = runtime.stitch.run(tuple(by_name.get(name, 5) for name in placeholders), 5, None)
    torch.testing.assert_close(outputs[0], _paddable(x))
    assert fake_graphs.FakeGraph.captures == captures

