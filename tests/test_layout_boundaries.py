"""Layout-exact piece boundaries: a compiled piece gets its traced input layout whatever an
eager piece returns (CPU, Inductor)."""

import pytest
import torch

import cgcompile

LIB = torch.library.Library("cgcompile_layout_test", "DEF")
LIB.define("rows_outer(Tensor x) -> Tensor")


def _heads_outer(x):
    # The real kernel returns a transposed layout; the fake below promises a contiguous one,
    # as SDPA's meta function does for its CUDA kernels.
    return (x * 2).t().contiguous().t()


LIB.impl("rows_outer", _heads_outer, "CPU")
LIB.impl("rows_outer", lambda x: torch.empty_like(x, memory_format=torch.contiguous_format), "Meta")


def _model(x):
    y = torch.ops.cgcompile_layout_test.rows_outer(torch.sin(x))
    return torch.relu(y) + 1


def test_eager_output_with_another_layout_is_copied_into_the_traced_one():
    backend = cgcompile.Backend(cgcompile.Config(
        compiler="inductor", capture_sizes=(1, 2, 4, 8), splitting_ops=["cgcompile_layout_test::rows_outer"],
    ))
    compiled = torch.compile(_model, backend=backend)
    for n in (3, 5, 12):
        x = torch.randn(n, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), _model(x))
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    assert backend.stats.layout_copies == 3  # one per call, for the piece after the split op


def test_padded_runs_allocate_inputs_in_the_traced_layout():
    backend = cgcompile.Backend(cgcompile.Config(
        compiler="inductor", capture_sizes=(1, 2, 4, 8), padding=True,
        splitting_ops=["cgcompile_layout_test::rows_outer"],
    ))
    compiled = torch.compile(_model, backend=backend)
    for n in (3, 8, 12):
        x = torch.randn(n, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), _model(x))
    assert backend.pieces[0].sizes == "padded to the capture sizes"


LIB.impl("rows_outer", _heads_outer, "CUDA")


@pytest.mark.cuda
def test_graph_inputs_from_an_eager_piece_take_the_traced_layout_on_cuda():
    backend = cgcompile.Backend(cgcompile.Config(
        compiler="inductor", capture_sizes=(1, 2, 4, 8), splitting_ops=["cgcompile_layout_test::rows_outer"],
    ))
    compiled = torch.compile(_model, backend=backend)
    for n in (3, 5, 8, 12, 5):
        x = torch.randn(n, 16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), _model(x))
    assert backend.stats.graphs_captured == 4  # sizes 4 and 8, two pieces each
    assert backend.stats.layout_copies == 1  # only size 12 ran without graphs


def test_compiled_output_with_another_layout_than_traced_is_copied():
    # Inductor drops the empty operand of the cat and returns k's transposed layout; eager's
    # cat (and so the trace) is contiguous. The next compiled piece must get the traced one.
    def f(x):  # x: [n, 8, 2, 16]
        k = x.transpose(1, 2) * 2
        k = torch.cat([torch.tensor([], dtype=x.dtype), k], dim=-2)
        a = torch.nn.functional.scaled_dot_product_attention(k, k, k)
        return a + k

    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor"))
    x = torch.randn(1, 8, 2, 16)
    torch.testing.assert_close(torch.compile(f, backend=backend)(x), f(x))
