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
from cgcompile.runtime import copy_with_strides
from cgcompile.testing import SILLY_OP


class RollingWindow(nn.Module):
    """Each item keeps its last 3 projected rows, as a sliding-window KV cache does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, window):  # x: [n, 8], window: [n, 3, 8]
        full = torch.cat([window, self.proj(x)[:, None]], dim=1)  # [n, 4, 8]: a captured piece
        mixed = torch.ops.cgcompile_testing.silly_attention(full, full, full)  # eager
        kept = full[:, 1:]  # a view of the captured cat, made between two eager pieces
        out = torch.ops.cgcompile_testing.silly_attention(mixed, mixed, mixed).sum(1)
        return out * 2.0, kept


def _record_graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def test_views_of_a_piece_output_share_its_memory_however_far_downstream():
    def fn(x, y):
        full = torch.cat([x, y], dim=1).sin()
        other = x.cos()
        return full[:, 1:].t(), other, x[1:], full

    gm = _record_graph(fn, torch.randn(4, 3), torch.randn(4, 1))
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
        assert copy.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    expanded = torch.randn(3, 1).expand(3, 4)  # overlapping elements: a plain clone
    assert torch.equal(copy_with_strides(expanded), expanded)


def _steps(model, plan, windows):
    """Run `plan` ((stream, n), ...) keeping one window per stream; every output."""
    outputs = []
    generator = torch.Generator().manual_seed(0)
    for stream, n in plan:
        x = torch.randn(n, 8, generator=generator).to("cuda")
        if stream not in windows or windows[stream].shape[0] != n:
            windows[stream] = torch.randn(n, 3, 8, generator=generator).to("cuda")
        out, windows[stream] = model(x, windows[stream])
        outputs.append(out.clone())
    return outputs, windows


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_kept_view_survives_graphs_of_other_sizes(compiler, exact_fp32_matmuls):
    torch.manual_seed(0)
    model = RollingWindow().cuda()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=(SILLY_OP,), compiler=compiler,
                                                 capture_sizes=(2, 4, 8)))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    # Stream a at 2 items, then b captures size 4 (and replays it at 3, padded) while a's
    # window waits, then a goes on: its window must still hold what eager's holds.
    plan = [("a", 2)] * 3 + [("b", 4)] * 3 + [("a", 2)] * 3 + [("b", 3)] * 2 + [("a", 2)] * 3
    with torch.no_grad():
        want, want_windows = _steps(model, plan, {})
        got, got_windows = _steps(compiled, plan, {})
    assert backend.stats.graphs_captured > 0
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"step {step} {plan[step]}")
    for stream in want_windows:
        assert got_windows[stream].stride() == want_windows[stream].stride()
        torch.testing.assert_close(got_windows[stream], want_windows[stream], rtol=1e-5, atol=1e-5)
