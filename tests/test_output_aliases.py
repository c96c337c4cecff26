"""State a caller keeps across calls must not live in CUDA graph memory.

A graph's outputs are static buffers in a pool shared by every graph of the Backend;
after a replay the runners hold them only through non-owning aliases, so the pool may
hand their memory to graphs captured later (another size, another Dynamo graph). An
output the caller keeps (a sliding-window KV cache keeps `cat([keys, new])[:, :, 1:]`)
must therefore be a copy, also when the view is made by an eager piece after the graph.
"""

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.passes import example_value, values_sharing_memory
from cgcompile.run.runtime import copy_with_strides
from cgcompile.testing.models import SILLY_OP
from cgcompile.testing.fx import traced


class KeepsAWindow(nn.Module):
    """Returns, besides its result, the last rows of a tensor made in a captured piece, as a
    sliding-window KV cache keeps `cat([keys, new])[:, :, -(window - 1):]`.

    The window length comes as a size (`keep.shape[0]`), symbolic like the window of
    transformers' sliding-window cache under `dynamic_sources`: the slice then has a size
    other than the capture dimension and runs in an eager piece, while the concatenation
    it views is captured.
    """

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, keep):  # x: [n, 8], keep: [3]
        h = self.proj(x)
        full = torch.stack([h, h * 2.0, h.sin(), h.cos()], dim=1)  # [n, 4, 8]: a captured piece
        kept = full[:, full.shape[1] - keep.shape[0]:]  # [n, 3, 8], a view made eagerly
        mixed = torch.ops.cgcompile_testing.silly_attention(full, full, full)  # eager
        return mixed.sum(1) * 2.0, kept


def test_views_of_a_piece_output_share_its_memory_however_far_downstream():
    def fn(x, y):
        full = torch.cat([x, y], dim=1).sin()
        other = x.cos()
        return full[:, 1:].t(), other, x[1:], full

    gm = traced(fn, torch.randn(4, 3), torch.randn(4, 1))
    nodes = {n.name: n for n in gm.graph.nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = list(output.args[0])
    sin = next(n for n in gm.graph.nodes if n.target in ("sin", torch.sin))
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert example_value(values[0]).shape == (3, 4)  # the transposed slice
    # Owner: the sin (a graph piece's output). Its view and itself are flagged, not `other`.
    assert values_sharing_memory(values, [sin]) == (0, 3)
    # A view of a graph input shares the caller's memory, not the pool's.
    x_placeholder = inputs[0]
    assert values_sharing_memory(values, [x_placeholder], exclude=inputs) == ()
    assert values_sharing_memory(values, [nodes[values[2].name]], exclude=inputs) == (2,)


def test_copy_with_strides_keeps_a_views_layout_in_new_memory():
    base = torch.randn(2, 3, 5, 4)
    for view in (base[:, :, 1:], base.transpose(1, 2), base[:, ::2], base):
        copy = copy_with_strides(view)
        assert copy.stride() == view.stride() and torch.equal(copy, view)
        if view._base is not None:  # Dynamo guards on an input view's base too
            assert copy._base.shape == view._base.shape
        assert copy.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    expanded = torch.randn(3, 1).expand(3, 4)  # overlapping elements: a plain clone
    assert torch.equal(copy_with_strides(expanded), expanded)


def _every_output(model, sizes):
    """Both outputs of a call at each size, all kept until the end, as a caller keeps a cache."""
    generator = torch.Generator().manual_seed(0)
    keep = torch.zeros(3, device="cuda")
    torch._dynamo.mark_dynamic(keep, 0)
    kept = []
    for n in sizes:
        x = torch.randn(n, 8, generator=generator).to("cuda")
        torch._dynamo.mark_dynamic(x, 0)
        kept.append(model(x, keep))
    return kept


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_outputs_kept_across_calls_keep_their_values(compiler, exact_fp32_matmuls):
    torch.manual_seed(0)
    model = KeepsAWindow().cuda()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler=compiler,
                                                 capture_sizes=(2, 4, 8)))
    compiled = torch.compile(model, backend=backend)
    # Replays of one size, then another size captured and replayed (3 runs padded to 4),
    # then the first again: no output the caller holds may change meanwhile.
    sizes = (2, 2, 2, 4, 4, 3, 2, 2)
    with torch.no_grad():
        want = _every_output(model, sizes)
        got = _every_output(compiled, sizes)
    assert backend.stats.graphs_seen == 1 and backend.stats.graphs_captured > 0
    assert any("dynamic_shape" in (p.reason or "") for p in backend.pieces)  # the kept view: eager
    for call, ((out, kept), (want_out, want_kept)) in enumerate(zip(got, want)):
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg=f"call {call}: result")
        torch.testing.assert_close(kept, want_kept, rtol=1e-5, atol=1e-5, msg=f"call {call}: kept window")
        assert kept.stride() == want_kept.stride()  # the copy keeps the view's layout
