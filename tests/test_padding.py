"""Padded inputs by what they are: rows, a broadcast along the rows, module state.

On CPU `Config(padding=True)` pads without graphs; on CUDA the graphs pad. Both fill a
piece's inputs through `buffers.copy_rows`, so both must agree with eager here.
"""

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.testing.models import SILLY_OP

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
SIZES = (3, 5, 2, 8, 3)  # padded to 4 and 8, exact at 2 and 8


def _backend(device):
    config = cgcompile.Config(splitting_ops=(SILLY_OP,), compiler="eager", capture_sizes=(2, 4, 8),
                              padding=True if device == "cpu" else None)
    return cgcompile.Backend(config)


def _broadcast_rows(x):  # x: [n, 8]
    t = torch.ops.cgcompile_testing.silly_attention(x, x, x)
    shared = t[:1].expand(x.shape[0], 8)  # [n, 8], stride 0 along the rows, made eagerly
    u = torch.ops.cgcompile_testing.silly_attention(shared, shared, shared)
    return shared * 2.0 + u.sin()  # a captured piece reads the broadcast as an input


@pytest.mark.parametrize("device", DEVICES)
def test_an_input_broadcast_along_the_rows_is_padded(device):
    backend = _backend(device)
    compiled = torch.compile(_broadcast_rows, backend=backend)
    with torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, 8, device=device)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), _broadcast_rows(x))
    assert any(p.sizes.startswith("padded") for p in backend.pieces)


class HeldState(nn.Module):
    """Keeps per-row state on the module, marked static, as a recurrent layer's cache is."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.state = None

    def forward(self, x):  # x: [n, 8], self.state: [n, 4]
        h = torch.ops.cgcompile_testing.silly_attention(x, x, x)
        return torch.cat([self.state, self.proj(h)], dim=1).relu()


@pytest.mark.parametrize("device", DEVICES)
def test_module_state_sized_by_the_rows_runs_at_exact_sizes(device):
    model = HeldState().to(device)
    backend = _backend(device)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, 8, device=device)
            torch._dynamo.mark_dynamic(x, 0)
            model.state = torch.randn(n, 4, device=device)
            torch._dynamo.mark_static_address(model.state)
            torch._dynamo.mark_dynamic(model.state, 0)
            want = torch.cat([model.state, model.proj(x + x * x)], dim=1).relu()
            torch.testing.assert_close(compiled(x), want)
    captured = [p for p in backend.pieces if p.capturable]
    assert captured and all(p.sizes.startswith("exact sizes") for p in captured)
    assert "module state" in captured[0].padding_unsafe


def _regroup(x):  # x: [n, 16], a strided view: its traced strides are (16*s1, s1)
    return torch.softmax(x.reshape(-1, 8), dim=-1).reshape(x.shape)


def _strided_input(n, device):
    x = torch.randn(n, 32, device=device)[:, ::2]
    torch._dynamo.mark_dynamic(x, 0)
    return x


def test_an_input_buffer_takes_strides_that_depend_on_another_size_from_the_input():
    # The piece that reshapes back reads x for its size only; x's strides are symbolic.
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_sizes=(2, 4, 8)))
    compiled = torch.compile(_regroup, backend=backend)
    x = _strided_input(5, "cpu")
    torch.testing.assert_close(compiled(x), _regroup(x))
    runners = [r for rt in backend.runtimes for r in rt.runners if hasattr(r, "traced")]
    layouts = [(r.traced, i) for r in runners for i, s in enumerate(r.traced._strides)
               if s is not None and r.traced.strides(i, 5) is None]
    assert layouts, "expected an input whose traced strides depend on another size"
    for traced, i in layouts:
        assert traced.zeros(i, x, x.shape, 5).stride() == x.stride()


@pytest.mark.parametrize("device", DEVICES)
def test_a_strided_input_view_with_inductor_pieces(device):
    config = cgcompile.Config(compiler="inductor", capture_sizes=(2, 4, 8),
                              padding=True if device == "cpu" else None)
    compiled = torch.compile(_regroup, backend=cgcompile.Backend(config))
    with torch.no_grad():
        for n in (5, 5, 3, 8):
            x = _strided_input(n, device)
            torch.testing.assert_close(compiled(x), _regroup(x))


def _mask_rows(x, mask):  # x: [n, 8]; mask: [n, 8], its rows a fixed size to Dynamo
    t = torch.ops.cgcompile_testing.silly_attention(x, x, x)
    rows = mask[torch.arange(x.shape[0], device=x.device)]  # positions 0..n-1 index the mask's rows
    return (t * rows).sin()


@pytest.mark.parametrize("device", DEVICES)
def test_positions_up_to_the_capture_size_do_not_index_an_unpadded_tensor(device):
    # Transformers' padding-mask function indexes the attention mask [B, L] with arange(B);
    # where Dynamo fixed the mask's B while the batch is the capture dimension, padding
    # would index past the mask's rows.
    backend = _backend(device)
    compiled = torch.compile(_mask_rows, backend=backend)
    with torch.no_grad():
        for n in SIZES:
            x, mask = torch.randn(n, 8, device=device), torch.randn(n, 8, device=device)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_static(mask, 0)
            torch.testing.assert_close(compiled(x, mask), _mask_rows(x, mask))
    unsafe = [p.padding_unsafe for p in backend.pieces if p.padding_unsafe]
    assert any("positions up to the capture size" in u for u in unsafe), unsafe
