"""CPU tensors never cross a captured graph boundary: the split rule runs every op that
reads or makes one eagerly (tests/passes/test_split_rule.py), and a capture that would
still hold one fails with `HostTensorError` instead of freezing the host value."""

import logging

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.run.capture import HostTensorError, refuse_host_tensors

SIZES = (1, 3, 8, 1)
DEFENCE = "expected every tensor input of a captured piece on the GPU"


def test_refusal_names_the_piece_and_the_first_cpu_position():
    meta = torch.empty(3, device="meta")  # any device but the CPU passes
    refuse_host_tensors("graph0.piece_1", "input", [4, meta, None])
    with pytest.raises(HostTensorError) as error:
        refuse_host_tensors("graph0.piece_1", "input", [4, meta, torch.tensor(0.5), torch.zeros(2)])
    assert str(error.value).startswith(f"graph0.piece_1: {DEFENCE}, got input 2: a tensor of shape () on cpu;")
    with pytest.raises(HostTensorError, match="got output 1: "):
        refuse_host_tensors("graph0.piece_1", "output", (meta, (meta, torch.zeros(2))))
    assert issubclass(HostTensorError, cgcompile.CaptureError)  # capture recovery handles it


class HostMix(nn.Module):
    """CUDA layers fed by host values: a CPU graph input, a 0-dim CPU tensor made in the
    graph, a CPU tensor attribute (not a buffer: `.cuda()` leaves it) and CPU indices."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(8, 4)
        self.eps = torch.tensor(1e-3)

    def forward(self, x, scale, idx):  # x: [n, 16] cuda; scale: [] cpu; idx: [8] cpu long
        h = self.inp(x).relu() * scale  # [n, 32]
        h = h + torch.tensor(0.25, dtype=h.dtype) + self.eps
        return self.out(h[:, idx]).sin()  # [n, 4]


def _host_inputs(n: int, seed: int):
    """x on CUDA, and host values that change every call (a graph that froze them fails)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g).cuda()
    torch._dynamo.mark_dynamic(x, 0)
    return x, torch.rand((), generator=g) + 0.5, torch.randperm(32, generator=g)[:8]


@pytest.mark.cuda
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_host_values_in_cuda_ops_match_eager(compiler, caplog, exact_fp32_matmuls):
    torch.manual_seed(0)
    model = HostMix().cuda()
    backend = cgcompile.Backend(cgcompile.Config(compiler=compiler))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgcompile"):
        for seed, n in enumerate(SIZES):
            args = _host_inputs(n, seed)
            torch.testing.assert_close(compiled(*args), model(*args))
    assert backend.stats.graphs_captured > 0  # the CUDA layers around the host values are captured
    assert any("[cpu_tensor]" in (p.reason or "") for p in backend.pieces)
    assert DEFENCE not in caplog.text  # the split rule, not the capture-time check, kept them out


@pytest.mark.cuda
def test_a_cpu_tensor_the_split_rule_missed_fails_its_capture_and_the_piece_runs_eagerly(monkeypatch, caplog):
    # A split rule that forgot cpu_tensor: the capture-time check stops the capture, and
    # recovery runs the piece eagerly (a captured graph would replay the first scale).
    from cgcompile.build import phases

    classify = phases.classify_nodes

    def without_cpu_rule(*args, **kwargs):
        return {node: r for node, r in classify(*args, **kwargs).items() if r.rule != "cpu_tensor"}

    monkeypatch.setattr(phases, "classify_nodes", without_cpu_rule)

    def f(x, scale):
        return (x.sin() * scale).cos()

    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    compiled = torch.compile(f, backend=backend)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for seed, n in enumerate(SIZES):
            x, scale, _ = _host_inputs(n, seed)
            torch.testing.assert_close(compiled(x, scale), f(x, scale))
    assert DEFENCE in caplog.text
    assert any((p.reason or "").startswith("capture_failed") for p in backend.pieces)


def _same_detections(got: list[dict], want: list[dict], exact_order: bool) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["boxes"].shape == w["boxes"].shape  # as many detections
        if exact_order:
            for key in ("boxes", "scores", "labels"):
                torch.testing.assert_close(g[key], w[key], rtol=1e-4, atol=1e-4)
        else:  # near-equal scores may swap places: compare what ordering does not change
            torch.testing.assert_close(g["scores"].sort().values, w["scores"].sort().values, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_fasterrcnn_matches_eager(compiler, caplog, exact_fp32_matmuls):
    # torchvision's MultiScaleRoIAlign computes its levels with torch.tensor and log2 on
    # host values, and the image sizes are host values too.
    models = pytest.importorskip("torchvision.models.detection")
    torch.manual_seed(0)
    # A score threshold of 0: at random weights every score is near 1/91, below the default 0.05.
    model = models.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None,
                                                         box_score_thresh=0.0).eval().cuda()
    backend = cgcompile.Backend(cgcompile.Config(compiler=compiler))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgcompile"):
        for seed, n in enumerate(SIZES):
            g = torch.Generator().manual_seed(seed)
            images = [torch.rand(3, 320, 320, generator=g).cuda() for _ in range(n)]
            got, want = compiled(images), model(images)
            _same_detections(got, want, exact_order=compiler == "eager")
            assert sum(len(d["boxes"]) for d in want) > 0  # not a comparison of nothing
    assert DEFENCE not in caplog.text


class LiteralHostData(nn.Module):
    """A rolling buffer written through a literal index tensor built at every call (as
    transformers' sliding-window cache does) and rows picked with a Python list (as Falcon
    does): host data copied to the GPU at every call, unless made once."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("window", torch.zeros(4, 16))

    def forward(self, x):  # x: [n, 16]
        index = torch.tensor([-1], dtype=torch.long, device=x.device)
        rolled = self.window.roll(-1, dims=0)
        rolled[index] = x.mean(0, keepdim=True)
        self.window.copy_(rolled)
        y = torch.nn.functional.scaled_dot_product_attention(
            self.proj(x)[None, None], self.window[None, None], self.window[None, None])[0, 0]
        return self.proj(y)[..., [0, 2]]


@pytest.mark.cuda
def test_literal_host_data_is_made_once_and_the_full_graph_replays(caplog):
    torch.manual_seed(0)
    model = LiteralHostData().cuda().requires_grad_(False)
    eager_model = LiteralHostData().cuda().requires_grad_(False)
    eager_model.load_state_dict(model.state_dict())
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=("attention",)))
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        for n in (2, 2, 2, 2):
            x = torch.randn(n, 16, device="cuda")
            torch.testing.assert_close(compiled(x), eager_model(x))
    torch.testing.assert_close(model.window, eager_model.window)
    assert "tensors of literal host data made once" in caplog.text
    assert "capturing the full graph failed" not in caplog.text
    assert backend.stats.full_graph_calls >= 1, backend.stats
