"""The backend as users reach it: by name, with options, and with Inductor; and its CUDA graph
runtime against eager (marked `cuda`)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import cgcompile
from cgcompile.testing.models import SILLY_OP, ToyLlama
from cgcompile.testing.gpu import capture_error_in_own_process, compiled_toy_llama, dynamic_ids, private_pools

BY_NAME = textwrap.dedent(
    """
    import sys
    import torch

    assert "cgcompile" not in sys.modules
    f = torch.compile(lambda x: (x.sin() @ x.T).relu(), backend="cgcompile", options={"compiler": "eager"})
    x = torch.randn(4, 4)
    assert torch.equal(f(x), (x.sin() @ x.T).relu())
    assert "cgcompile.backend" in sys.modules  # loaded through the entry point
    print("ok")
    """
)


def test_backend_by_name_without_import():
    result = subprocess.run([sys.executable, "-c", BY_NAME], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_options_become_config_fields(tmp_path):
    torch.manual_seed(0)
    model = ToyLlama(2)
    options = {"compiler": "eager", "splitting_ops": [SILLY_OP], "dump_dir": str(tmp_path)}
    ids = torch.randint(0, 64, (5,))
    assert torch.equal(torch.compile(model, backend="cgcompile", options=options)(ids), model(ids))
    with open(tmp_path / "graph_0" / "summary.json") as f:
        pieces = json.load(f)["pieces"]
    assert [p["capturable"] for p in pieces] == [True, False, True, False, True]


def test_default_config():
    backend = cgcompile.Backend()
    assert backend.config == cgcompile.Config()
    assert backend.pieces == []
    assert backend.stats == cgcompile.BackendStats()


def test_identical_pieces_compile_once_with_inductor():
    torch.manual_seed(0)
    model = ToyLlama(3)
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", splitting_ops=[SILLY_OP]))
    compiled = torch.compile(model, backend=backend)
    for n in (6, 11):
        ids = torch.randint(0, 64, (n,))
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids))
    stats = backend.stats
    # First layer's piece (embedding + norm + qkv), the layer-to-layer piece shared by
    # both middle boundaries, and the last piece (o_proj + MLP + lm_head).
    assert (stats.graphs_seen, stats.pieces, stats.capturable_pieces, stats.compilations) == (1, 7, 4, 3)
    assert stats.compile_s > 0  # the warm-up those compiles took
    assert stats.graphs_captured == 0


def test_graph_outputs_are_copied_contiguous_only_where_eager_is_contiguous():
    # The copy out of a CUDA graph buffer takes eager's layout when that is contiguous
    # (Inductor may have chosen another); otherwise it keeps the buffer's layout.
    from cgcompile.build.phases import _statically_contiguous

    x = torch.empty(2, 3, 5, 4)
    assert _statically_contiguous(x)
    assert not _statically_contiguous(x.transpose(1, 2))
    assert not _statically_contiguous(x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3))
    assert _statically_contiguous(torch.empty(1, 3, 1, 4).as_strided((1, 3, 1, 4), (7, 4, 99, 1)))  # size-1 strides are free
    assert not _statically_contiguous(x[:, :, :4])  # a non-dense view
    assert not _statically_contiguous(3)


SIZES = (2, 4, 8, 16, 32, 64)


def _compiled(compiler="eager", n_layers=3, **cfg):
    return compiled_toy_llama(compiler, SIZES, n_layers, **cfg)


def _capturable(backend):
    return sum(p.capturable for p in backend.pieces)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("n", [3, 5, 37, 8, 2])
def test_eager_pieces_equal_eager_at_padded_sizes(n):
    model, backend, compiled = _compiled()
    for _ in range(3):  # capture, then replay twice
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.stats.graphs_captured == _capturable(backend) == 4


@pytest.mark.cuda
def test_inductor_pieces_close_to_eager_mixed_sizes():
    model, backend, compiled = _compiled("inductor")
    sizes = [3, 17, 5, 64, 3, 40, 17, 2]
    for n in sizes:
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    padded = {backend.session.padding.padded(n) for n in sizes}
    assert backend.stats.graphs_captured == len(padded) * _capturable(backend)
    assert backend.stats.compilations == 3


@pytest.mark.cuda
def test_above_largest_size_runs_without_graphs():
    model, backend, compiled = _compiled()
    ids = dynamic_ids(100)
    torch.testing.assert_close(compiled(ids), model(ids))
    assert backend.stats.graphs_captured == 0


@pytest.mark.cuda
def test_held_outputs_are_not_overwritten():
    model, backend, compiled = _compiled()
    first_ids, second_ids = dynamic_ids(5), dynamic_ids(5)
    first = compiled(first_ids)
    expected = model(first_ids).clone()
    compiled(second_ids)
    compiled(second_ids)
    torch.testing.assert_close(first, expected)


@pytest.mark.cuda
def test_reuse_output_buffers_returns_static_buffers():
    model, backend, compiled = _compiled(reuse_output_buffers=True)
    a, b = dynamic_ids(5), dynamic_ids(5)
    first = compiled(a)
    second = compiled(b)
    assert first.data_ptr() == second.data_ptr()  # the documented risk of the opt-out
    torch.testing.assert_close(second, model(b))


@pytest.mark.cuda
def test_graph_allocations_live_in_the_one_pool():
    model, backend, compiled = _compiled()
    before = private_pools()
    for n in (3, 16, 64):
        compiled(dynamic_ids(n))
    assert private_pools() - before == {tuple(backend.session.pool.handle)}
    assert backend.graph_memory() > 0


@pytest.mark.cuda
def test_ahead_of_time_capture_all_sizes_then_replay():
    model, backend, compiled = _compiled()
    captured = backend.capture(compiled, lambda size, warmup: (dynamic_ids(size),), progress=False)
    assert captured == len(SIZES) * _capturable(backend)
    before = backend.stats.graphs_captured
    for n in (3, 33, 64, 7):
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.stats.graphs_captured == before  # nothing captured lazily


@pytest.mark.cuda
def test_profile_capture_memory_releases_everything():
    model, backend, compiled = _compiled()
    compiled(dynamic_ids(3))  # compile only (size 3 captures: clear it)
    backend.clear()
    profile = backend.profile_capture_memory(compiled, lambda size, warmup: (dynamic_ids(size),))
    assert profile.bytes > 0
    assert profile.graphs == len(SIZES) * _capturable(backend)
    assert backend.graph_memory() == 0
    ids = dynamic_ids(9)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_pool_for_all_sizes_close_to_largest_alone():
    model, backend, compiled = _compiled(n_layers=4)
    compiled(dynamic_ids(3))
    backend.clear()
    largest = backend.profile_capture_memory(compiled, lambda s, w: (dynamic_ids(s),), sizes=(64,)).bytes
    every = backend.profile_capture_memory(compiled, lambda s, w: (dynamic_ids(s),)).bytes
    assert every <= 1.25 * largest, (every, largest)


@pytest.mark.cuda
def test_clear_releases_and_recaptures():
    model, backend, compiled = _compiled()
    compiled(dynamic_ids(6))
    captured = backend.stats.graphs_captured
    backend.clear()
    assert backend.graph_memory() == 0
    ids = dynamic_ids(6)
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.stats.graphs_captured == 2 * captured


@pytest.mark.cuda
def test_check_addresses_names_the_piece_when_a_parameter_moves():
    model, backend, compiled = _compiled(check_addresses=True)
    compiled(dynamic_ids(4))
    model.layers[0].qkv.weight.data = model.layers[0].qkv.weight.data.clone()
    with pytest.raises(cgcompile.CaptureError, match=r"graph0\.piece_\d+: input \d+"):
        compiled(dynamic_ids(4))


@torch.library.custom_op("cgcompile_test::lazy_scale", mutates_args=())
def lazy_scale(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Like attention backends that build metadata on first use: state[0] is 0 until initialised."""
    if state[1].item() == 0:
        state[0] = 2.0
        state[1] = 1.0
    return x * state[0]


@lazy_scale.register_fake
def _(x, state):
    return torch.empty_like(x)


class LazyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x, state):
        return self.b(torch.ops.cgcompile_test.lazy_scale(self.a(x), state))


@pytest.mark.cuda
def test_lazy_init_op_gets_fresh_state_for_capture():
    torch._dynamo.reset()
    model = LazyModel().cuda().requires_grad_(False)  # inference: graphs that need gradients are not captured
    backend = cgcompile.Backend(cgcompile.Config(
        splitting_ops=("cgcompile_test::lazy_scale",), compiler="eager", capture_sizes=(4, 8)))
    compiled = torch.compile(model, backend=backend)
    states = {}

    def make_inputs(size, warmup):
        x = torch.randn(size, 16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        states[(size, warmup)] = torch.zeros(2, device="cuda")
        return (x, states[(size, warmup)])

    assert backend.capture(compiled, make_inputs, progress=False) == 4
    for key, state in states.items():
        assert state[1].item() == 1.0, f"state {key} was never initialised by its own run"
    x = torch.randn(6, 16, device="cuda")
    fresh = torch.zeros(2, device="cuda")
    expected = model(x, torch.zeros(2, device="cuda"))
    torch.testing.assert_close(compiled(x, fresh), expected)


_FORK_WITHOUT_JOIN = """
lin = torch.nn.Linear(16, 16).cuda()
x = torch.randn(4, 16, device="cuda")
def fork_without_join(x):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = lin(x)
    return (y,)
fork_without_join(x)
torch.cuda.synchronize()
"""


@pytest.mark.cuda
def test_unjoined_side_stream_fails_naming_the_piece():
    capture = 'cgcompile.run.capture.CaptureSession((4,)).capture("my_piece", fork_without_join, lambda: (x,))'
    out = capture_error_in_own_process(_FORK_WITHOUT_JOIN, capture)
    assert "CaptureError: capturing my_piece failed" in out, out


class _RunningMean(torch.nn.Module):
    """A buffer a capturable piece updates in place (as batch norm's running mean)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):  # x: [n, 8]
        h = torch.ops.cgcompile_testing.silly_attention(x, x, x)
        self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return h * self.mean


@pytest.mark.cuda
def test_a_buffer_the_piece_updates_changes_once_per_call_also_when_capturing():
    # The warm-up run before a capture used to update the buffer a second time.
    torch._dynamo.reset()
    model, reference = _RunningMean().cuda(), _RunningMean().cuda()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler="eager", capture_sizes=SIZES))
    compiled = torch.compile(model, backend=backend)
    for n in (4, 4, 3, 8, 4):  # capture, replay, exact or padded, capture, replay
        x = torch.randn(n, 8, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), reference(x))
        torch.testing.assert_close(model.mean, reference.mean)
    assert backend.stats.graphs_captured >= 2


@pytest.mark.cuda
@pytest.mark.cuda
def test_release_all_graphs_drops_every_graph_and_the_next_call_recaptures():
    """What distributed.shut_down does before tearing NCCL down: after it no graph of the
    session is alive (none holds its pool), and the model still answers as eager."""
    from cgcompile.run.capture import release_all_graphs

    model, backend, compiled = compiled_toy_llama("eager", SIZES)
    ids = dynamic_ids(3)
    with torch.no_grad():
        expected = model(ids)
        torch.testing.assert_close(compiled(ids), expected)
        pool = tuple(backend.session.pool.handle)
        assert pool in private_pools()
        stray = next(iter(backend.session._graphs))  # a reference that outlives the runners'
        assert release_all_graphs() >= 1
        assert pool not in private_pools()  # no graph holds its memory any more
        with pytest.raises(RuntimeError):
            stray.replay()  # reset: the stray reference holds no graph (nor its communicators)
        captured = backend.session.graphs_captured
        torch.testing.assert_close(compiled(ids), expected)
    assert backend.session.graphs_captured > captured


class _KernelFreePiece(torch.nn.Module):
    """Between two split ops, a piece whose one op launches no kernel: float() of a
    float32 tensor returns the tensor itself."""

    def forward(self, x):
        a = torch.ops.cgcompile_testing.silly_attention(x, x, x)
        b = a.float()
        return torch.ops.cgcompile_testing.silly_attention(b, b, x)


@pytest.mark.cuda
def test_a_piece_that_launches_no_kernel_replays_nothing_and_does_not_warn(caplog):
    import logging
    import warnings

    from cgcompile.run.capture import EmptyGraph
    from cgcompile.run.graph_piece import CudaGraphPiece

    torch._dynamo.reset()
    model = _KernelFreePiece()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler="eager", capture_sizes=SIZES))
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="cgcompile"):
        warnings.simplefilter("always")
        for n in (3, 3, 5, 4, 3):  # capture size 4, replay, capture 8, exact 4, replay
            x = torch.randn(n, 8, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x))
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    assert "launches no GPU work" in caplog.text
    graphs = [g.graph for r in backend.runtimes[0].runners if isinstance(r, CudaGraphPiece) for g in r.graphs.values()]
    assert len(graphs) == 2 == backend.stats.graphs_captured
    assert all(isinstance(g, EmptyGraph) for g in graphs)


@pytest.mark.cuda
def test_a_second_instance_never_replays_the_first_ones_graphs():
    """Dynamo reuses one compiled graph for two models of the same class (parameters are
    graph inputs); the graphs hold the first model's parameter addresses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    from cgcompile.testing.models import ToyLlama

    first, second = ToyLlama(3, hidden=64, vocab=128).cuda(), ToyLlama(3, hidden=64, vocab=128).cuda()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler="eager", capture_sizes=SIZES))
    compiled_first, compiled_second = torch.compile(first, backend=backend), torch.compile(second, backend=backend)
    with torch.no_grad():
        for model, compiled in [(first, compiled_first), (second, compiled_second)] * 3:
            ids = dynamic_ids(5)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.stats.graphs_seen == 1  # one Dynamo graph for both models
    addresses = backend.runtimes[0].addresses
    assert addresses.calls_without_graphs == 3 and addresses.recaptures == 0
    assert backend.stats.calls_with_moved_parameters == 3


@pytest.mark.cuda
def test_parameters_replaced_by_new_tensors_are_captured_again():
    model, backend, compiled = _compiled()
    ids = dynamic_ids(5)
    with torch.no_grad():
        compiled(ids)
        for p in model.parameters():
            p.data = p.data * 1.5  # new tensors, at new addresses
        for _ in range(3):  # without graphs, then captured again, then replayed
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert backend.runtimes[0].addresses.recaptures == 1 == backend.stats.parameter_recaptures


@pytest.mark.cuda
def test_graphs_captured_again_reuse_their_pool_memory():
    """Parameters that move for good drop every graph, and the next call captures them
    again: into the same pool, whose memory the dropped graphs gave back. A new pool per
    recapture would leave the old one's memory cached, reserved, until an allocation fails."""
    model, backend, compiled = _compiled(n_layers=3)
    ids = dynamic_ids(37)
    reserved = []
    with torch.no_grad():
        compiled(ids)
        for _ in range(6):
            for p in model.parameters():
                p.data = p.data.clone()  # new tensors, at new addresses
            compiled(ids)  # runs without graphs
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)  # captured again
            reserved.append(torch.cuda.memory_reserved())
    assert backend.stats.parameter_recaptures == 6
    assert reserved[-1] == reserved[1], reserved

