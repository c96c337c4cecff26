"""Recovery from a failed capture: the piece is split at the node a graph cannot hold
(GPU; and on CPU through a fake capture that refuses the same op)."""

import pytest
import torch
from torch.fx import Interpreter

import cgcompile
from cgcompile.run import recovery
from cgcompile.testing import fake_graphs

LIB = torch.library.Library("cgcompile_recovery_test", "DEF")
LIB.define("reads_on_host(Tensor x) -> Tensor")


def _reads_on_host(x):
    # Like an op that reads offsets on the host: a device-to-host copy, fine eagerly,
    # not allowed while a stream captures.
    scale = 1.0 if x.abs().sum().item() >= 0 else 2.0
    return x * scale


LIB.impl("reads_on_host", _reads_on_host, "CUDA")


def _reads_on_host_cpu(x):
    if fake_graphs.FakeGraph.capturing:
        raise RuntimeError("operation not permitted when stream is capturing")
    return _reads_on_host(x)


LIB.impl("reads_on_host", _reads_on_host_cpu, "CPU")
LIB.impl("reads_on_host", lambda x: torch.empty_like(x), "Meta")

W = None


def _model(x):
    y = torch.sin(x) @ W
    y = torch.ops.cgcompile_recovery_test.reads_on_host(y)
    return torch.relu(y) * 2


@pytest.mark.cuda
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_opaque_op_that_reads_on_the_host_is_split_out(compiler, caplog):
    global W
    W = torch.randn(16, 16, device="cuda")
    backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, capture_sizes=(1, 2, 4, 8)))
    compiled = torch.compile(_model, backend=backend)
    for n in (3, 5, 8, 3, 5):
        x = torch.randn(n, 16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), _model(x))
    names = {p.name: p for p in backend.pieces}
    assert names["graph0.piece_0"].reason.startswith("capture_failed: split at ")
    eager = [p for p in backend.pieces if p.name.startswith("graph0.piece_0.") and not p.capturable]
    assert len(eager) == 1 and "cgcompile_recovery_test::reads_on_host" in eager[0].reason
    assert "[capture_failed]" in eager[0].reason
    assert backend.stats.graphs_captured >= 4  # the parts before and after, at sizes 4 and 8
    assert "splitting_ops=['cgcompile_recovery_test::reads_on_host']" in caplog.text


def _another_model(x):
    y = torch.cos(x) @ W
    y = torch.ops.cgcompile_recovery_test.reads_on_host(y) + 1.0
    return torch.tanh(y)


@pytest.mark.cuda
def test_a_later_graph_splits_at_a_known_uncapturable_op_without_searching(caplog):
    global W
    W = torch.randn(16, 16, device="cuda")
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_sizes=(1, 2, 4, 8)))
    first, second = torch.compile(_model, backend=backend), torch.compile(_another_model, backend=backend)
    for n in (3, 5, 3):
        x = torch.randn(n, 16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(first(x), _model(x))
        torch.testing.assert_close(second(x), _another_model(x))
    later = [p for p in backend.pieces if p.graph_index == 1]
    assert not any((p.reason or "").startswith("capture_failed") for p in later)  # no failed capture
    assert any("failed CUDA graph capture in an earlier graph" in (p.reason or "") for p in later)
    assert caplog.text.count("cannot be captured in a CUDA graph") == 1  # one warning per op
    assert "failed: capturing" not in caplog.text  # the message does not repeat itself


LIB.define("column_major(Tensor x) -> Tensor")
# Eagerly a column-major result where the fake promises a row-major one, as SDPA's CUDA
# kernels return heads-outer results: the pieces after it must get the traced layout.
LIB.impl("column_major", lambda x: (x * 1.0).t().contiguous().t(), "CUDA")
LIB.impl("column_major", lambda x: torch.empty_like(x), "Meta")


def _layout_model(x):
    u = torch.ops.cgcompile_recovery_test.column_major(x)
    y = torch.ops.cgcompile_recovery_test.reads_on_host(torch.sin(u) @ W)
    return torch.relu(y) + u * 2.0  # u reaches the piece after the cut


@pytest.mark.cuda
def test_pieces_after_a_recovered_cut_get_inputs_in_their_traced_layout():
    global W
    W = torch.randn(16, 16, device="cuda")
    config = cgcompile.Config(compiler="inductor", capture_sizes=(1, 2, 4, 8),
                              splitting_ops=["cgcompile_recovery_test::column_major"])
    backend = cgcompile.Backend(config)
    compiled = torch.compile(_layout_model, backend=backend)
    for n in (3, 5, 8, 3):
        x = torch.randn(n, 16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), _layout_model(x))
    assert any((p.reason or "").startswith("capture_failed: split at ") for p in backend.pieces)


def _fake_capture_alone(finder, node):
    fake_graphs.FakeGraph.capturing = True
    try:
        Interpreter.run_node(finder, node)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        fake_graphs.FakeGraph.capturing = False
    return None


def test_recovery_on_cpu_splits_the_piece_and_later_graphs_split_without_searching(monkeypatch, caplog):
    # The graph pieces, the recovery and the re-split run as on the GPU; only the capture
    # itself is faked, and the analysis says the graph's pieces are replayed from graphs.
    global W
    W = torch.randn(16, 16)
    fake_graphs.fake_cuda_graphs(monkeypatch)
    monkeypatch.setattr(recovery._NodeByNodeCapture, "_capture_alone", _fake_capture_alone)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_sizes=(1, 2, 4, 8)))
    first, second = torch.compile(_model, backend=backend), torch.compile(_another_model, backend=backend)
    for n in (3, 5, 8, 3, 5):
        x = torch.randn(n, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(first(x), _model(x))
        torch.testing.assert_close(second(x), _another_model(x))
    names = {p.name: p for p in backend.pieces}
    assert names["graph0.piece_0"].reason.startswith("capture_failed: split at ")
    assert [(p.name, p.capturable) for p in backend.pieces if p.name.startswith("graph0.piece_0.")] == [
        ("graph0.piece_0.piece_0", True), ("graph0.piece_0.piece_1", False), ("graph0.piece_0.piece_2", True)]
    assert "[capture_failed]" in names["graph0.piece_0.piece_1"].reason
    later = [p for p in backend.pieces if p.graph_index == 1]
    assert not any((p.reason or "").startswith("capture_failed") for p in later)  # no failed capture
    assert any("failed CUDA graph capture in an earlier graph" in (p.reason or "") for p in later)
    assert caplog.text.count("cannot be captured in a CUDA graph") == 1  # one warning per op
    assert backend.stats.capturable_pieces == sum(p.capturable for p in backend.pieces) == 4
    assert fake_graphs.FakeGraph.replays > 0 and backend.graphs_held() > 0
