"""passes.matvec_reduction: one-row half-precision linears become a multiply and a sum; every
other linear, and the graph handed in, stay as they were."""

import pytest
import torch
import torch.nn.functional as F

from cgcompile.passes import linear_as_reduction, matvec_as_reduction


class TwoLinears(torch.nn.Module):
    def forward(self, x, w, b, w2):
        return F.linear(x, w, b).relu(), F.linear(x, w2)


def _args(rows: int, dtype: torch.dtype, leading=(1,)):
    torch.manual_seed(0)
    return (torch.randn(*leading, rows, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype),
            torch.randn(32, dtype=dtype), torch.randn(16, 64, dtype=dtype))


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_linears_become_reductions_with_the_same_values(dtype):
    gm = torch.fx.symbolic_trace(TwoLinears())
    args = _args(1, dtype)
    rewritten, count = matvec_as_reduction(gm, args)
    assert count == 2
    assert _targets(rewritten).count(linear_as_reduction) == 2
    assert linear_as_reduction not in _targets(gm)  # the graph handed in is unchanged
    for got, want in zip(rewritten(*args), gm(*args)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows, dtype, leading", [
    (2, torch.bfloat16, (1,)),   # two rows: the reduction would read the weight twice
    (1, torch.bfloat16, (3,)),   # one row per sequence, three sequences: three rows in all
    (1, torch.float32, (1,)),    # not measured faster in float32
])
def test_other_linears_are_left_alone(rows, dtype, leading):
    gm = torch.fx.symbolic_trace(TwoLinears())
    rewritten, count = matvec_as_reduction(gm, _args(rows, dtype, leading))
    assert count == 0
    assert linear_as_reduction not in _targets(rewritten)


def test_linear_as_reduction_sums_every_feature_and_adds_the_bias():
    x = torch.full((1, 4096), 1 / 64, dtype=torch.bfloat16)
    w = torch.ones(1, 4096, dtype=torch.bfloat16)
    assert linear_as_reduction(x, w).item() == 64.0
    torch.testing.assert_close(linear_as_reduction(x, w, torch.ones(1, dtype=torch.bfloat16)),
                               torch.full((1, 1), 65.0, dtype=torch.bfloat16))


def test_dtensor_linears_are_left_alone():
    # A DTensor shard's placements would have to survive the rewrite: its linear keeps cuBLAS.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x, w, b, w2 = _args(1, torch.bfloat16)
        args = (distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Shard(0)]),
                distribute_tensor(b, mesh, [Shard(0)]), distribute_tensor(w2, mesh, [Shard(0)]))
        _, count = matvec_as_reduction(torch.fx.symbolic_trace(TwoLinears()), args)
        assert count == 0
    finally:
        dist.destroy_process_group()
