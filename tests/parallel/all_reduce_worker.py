"""The fast all-reduce on 2 gloo ranks (run by tests/parallel/test_all_reduce.py under
torchrun): the set-up chooses NCCL's place-holder, the group's own all-reduce, with the
reason; a graph whose all-reduces were routed to `cgcompile::all_reduce` still sums across
ranks; a compiled tensor-parallel layer equals eager; a DTensor layer (`parallelize_module`),
whose all-reduce only Inductor's aten graph shows, is found there, and routed there it still
equals eager."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.parallel.all_reduce_choice import NCCL  # noqa: E402
from cgcompile.parallel.distributed import prepare_collectives, setup_all_reduce  # noqa: E402
from cgcompile.parallel.fast_all_reduce import _mesh_groups, all_reduce_report  # noqa: E402
from cgcompile.parallel.symm_all_reduce import ALL_REDUCE_OP  # noqa: E402
from cgcompile.passes.fast_all_reduce import find_all_reduces, route_all_reduces  # noqa: E402


def layer(x, w):
    y = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    dist.all_reduce(y)
    return torch.relu(y)


def rank_inputs():
    torch.manual_seed(dist.get_rank())
    return torch.randn(3, 8), torch.randn(8, 8)


def gloo_falls_back():
    prepare_collectives("cpu")
    choice = setup_all_reduce("cpu")  # recorded once: the same record
    assert choice.kind == NCCL and "tensors on cpu" in choice.reason, choice
    assert all_reduce_report().groups == (choice,)
    return "gloo falls back"


def routed_op_equals_eager():
    x, w = rank_inputs()
    graphs = []

    def route_and_keep(gm, example_inputs):
        route_all_reduces(gm, find_all_reduces(gm), ALL_REDUCE_OP)
        graphs.append(gm)
        return gm.forward

    routed = torch.compile(layer, backend=route_and_keep)(x, w)
    assert str(graphs[0].code).count("cgcompile.all_reduce") == 2, graphs[0].code
    torch.testing.assert_close(routed, layer(x, w))
    compiled = torch.compile(layer, backend=cgcompile.Backend(cgcompile.Config(compiler="eager")))
    torch._dynamo.reset()
    torch.testing.assert_close(compiled(x, w), layer(x, w))
    calls = all_reduce_report().calls[dist.group.WORLD.group_name]
    assert calls == {NCCL: 2}, calls  # the routed op ran twice, each time by the group's own path
    return "routed op equals eager"


def sharded_mlp():
    """Column- then row-parallel linears: the row-parallel output is a Partial DTensor whose
    redistribute to Replicate is an all-reduce only after AOTAutograd's dispatch."""
    torch.manual_seed(0)  # the same input and weights on every rank
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), torch.randn(4, 16)


class RouteEverySum(CustomGraphPass):
    """A post-grad pass that routes every routable all-reduce, whatever its group's choice."""

    def __init__(self):
        self.routed = []

    def __call__(self, graph):
        self.routed.append(route_all_reduces(graph.owning_module, find_all_reduces(graph.owning_module),
                                             ALL_REDUCE_OP))

    def uuid(self):
        return None  # no caching: the pass must run


def dtensor_all_reduce_routed_inside_inductor():
    mlp, x = sharded_mlp()
    torch._dynamo.reset()
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor"))
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):  # the pass runs every compile
        torch.testing.assert_close(torch.compile(mlp, backend=backend)(x), mlp(x))
        inside = [r for r in all_reduce_report().sites if r.level == "inductor"]
        assert [r.kind for r in inside] == [NCCL] and "its input is on cpu" in inside[0].reason, inside
        torch._dynamo.reset()
        graphs = []
        torch.compile(mlp, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)(x)
        mesh_group = mlp[0].weight.device_mesh.get_group().group_name
        assert [g.group_name for g in _mesh_groups(graphs[0])] == [mesh_group]  # what CUDA graphs set up
        torch._dynamo.reset()
        route = RouteEverySum()
        routed = torch.compile(mlp, options={"post_grad_custom_post_pass": route})(x)
        assert route.routed == [1], route.routed
        torch.testing.assert_close(routed, mlp(x))
    return "dtensor all-reduce routed inside inductor"


def fused_norm_op_falls_back():
    """The fused op on a group without the Lamport kernel: the group's all-reduce, then the add
    and the norm as torch ops, equal to eager's."""
    x, _ = rank_inputs()
    residual, weight = torch.randn(3, 8, generator=torch.Generator().manual_seed(5)), torch.rand(8)
    got = torch.ops.cgcompile.all_reduce_add_rms_norm(x, residual, weight, 1e-6, dist.group.WORLD.group_name)
    total = x.clone()
    dist.all_reduce(total)
    total = total + residual
    normed = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(got[0], total, rtol=0, atol=0)
    torch.testing.assert_close(got[1], normed)
    return "fused norm op falls back"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for scenario in (gloo_falls_back, routed_op_equals_eager, dtensor_all_reduce_routed_inside_inductor,
                     fused_norm_op_falls_back):
        print(f"rank {dist.get_rank()}: {scenario()}: ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()
