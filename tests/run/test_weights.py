"""The per-call check that a graph's parameters are where its CUDA graphs read them."""

import logging

import pytest
import torch

import cgcompile
from cgcompile.run.weights import ParameterAddresses, storage_tensors


def _watch(drops: list) -> ParameterAddresses:
    return ParameterAddresses("graph0", [1, 2], ["w", "b"], lambda: drops.append(1))


def test_the_same_parameters_replay():
    drops = []
    watch = _watch(drops)
    w, b = torch.zeros(3), torch.zeros(3)
    assert all(watch.allow(("x", w, b)) for _ in range(3))
    assert drops == [] and watch.calls_without_graphs == 0


def test_alternating_instances_never_replay_each_others_graphs(caplog):
    drops = []
    watch = _watch(drops)
    first, second = (torch.zeros(3), torch.zeros(3)), (torch.zeros(3), torch.zeros(3))
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        allowed = [watch.allow(("x", *params)) for params in (first, second, first, second, first)]
    assert allowed == [True, False, True, False, True]
    assert drops == [] and watch.calls_without_graphs == 2
    warnings = [r for r in caplog.records if "runs without CUDA graphs" in r.getMessage()]
    assert len(warnings) == 1 and "'w' is at" in warnings[0].getMessage()


def test_parameters_replaced_for_good_are_captured_again():
    drops = []
    watch = _watch(drops)
    w, b = torch.zeros(3), torch.zeros(3)
    assert watch.allow(("x", w, b))
    new_b = torch.ones(3)  # b replaced by a new tensor
    assert not watch.allow(("x", w, new_b))  # the first call with it: no graphs
    assert watch.allow(("x", w, new_b))  # the second: settled, graphs dropped and captured anew
    assert drops == [1] and watch.recaptures == 1
    assert watch.allow(("x", w, new_b)) and drops == [1]


class _Wrapper(torch.Tensor):
    """A wrapper subclass (as quantized weights are): no storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_tensors_without_storage_are_not_checked():
    from cgcompile.run.weights import has_address

    assert has_address(torch.nn.Parameter(torch.zeros(3)))
    assert not has_address(_Wrapper(torch.zeros(3)))


class _WrappedWeight(torch.nn.Module):
    """A linear whose weight is a wrapper subclass (as a DTensor shard or quantized weights
    are): the tensor has no memory of its own, the graphs read the two it wraps."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        w = torch.randn(8, 8)
        self.w = torch.nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)

    def forward(self, x):
        return torch.relu(x @ self.w).a


def test_a_replaced_wrapper_subclass_parameter_is_never_replayed_stale(monkeypatch):
    """The graphs read a wrapper subclass's inner tensors in place: a parameter replaced by a
    new one must not replay the old one's graphs (as a plain parameter), so the inner
    tensors' addresses are watched. Before, such a parameter was left out of the watch and
    every call after the replacement returned the old weights' results."""
    from torch.testing._internal.two_tensor import TwoTensor

    from cgcompile.testing import fake_graphs

    fake_graphs.fake_cuda_graphs(monkeypatch)
    torch.manual_seed(0)
    model = _WrappedWeight()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_sizes=(4, 8)))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        for _ in range(2):  # captured, replayed
            torch.testing.assert_close(compiled(x), model(x))
        w = torch.randn(8, 8)
        model.w = torch.nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)  # a new tensor
        for _ in range(3):  # without graphs, captured again, replayed
            torch.testing.assert_close(compiled(x), model(x))
    assert backend.stats.calls_with_moved_parameters == 1 and backend.stats.parameter_recaptures == 1
    assert backend.runtimes[0].addresses.names == ("l_self_parameters_w_.a", "l_self_parameters_w_.b")


def test_storage_tensors_reach_through_wrapper_subclasses():
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.zeros(3), torch.ones(3)
    nested = TwoTensor(TwoTensor(a, b), TwoTensor(b.clone(), a.clone()))
    found = storage_tensors(nested, "w")
    assert [name for name, _ in found] == ["w.a.a", "w.a.b", "w.b.a", "w.b.b"]
    assert found[0][1] is a and found[1][1] is b
    assert storage_tensors(torch.zeros(3), "p")[0][0] == "p"
    assert storage_tensors(torch.empty(0), "empty") == []  # nothing to read, nothing to watch


def test_check_addresses_raises_for_a_replaced_wrapper_subclass_parameter(monkeypatch):
    """Config(check_addresses=True) raises instead of capturing again: for a wrapper subclass
    too, whose own data_ptr (0) never moves."""
    from torch.testing._internal.two_tensor import TwoTensor

    from cgcompile.testing import fake_graphs

    fake_graphs.fake_cuda_graphs(monkeypatch)
    torch.manual_seed(0)
    model = _WrappedWeight()
    compiled = torch.compile(model, backend=cgcompile.Backend(cgcompile.Config(
        compiler="eager", capture_sizes=(4, 8), check_addresses=True)))
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        compiled(x)
        compiled(x)
        w = torch.randn(8, 8)
        model.w = torch.nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)
        with pytest.raises(cgcompile.CaptureError, match=r"was captured at address \(0x[0-9a-f]+, 0x[0-9a-f]+\) but "):
            compiled(x)


class _ShardedLinear(torch.nn.Module):
    """A column-parallel linear as torch's `parallelize_module` or transformers' `tp_plan`
    makes it: a DTensor weight, the local shard used inside."""

    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]), requires_grad=False)

    def forward(self, x):
        return torch.relu(x @ self.w.to_local())


def test_a_dtensor_parameter_is_watched_by_its_local_shard(monkeypatch):
    """A DTensor flattens to its local tensor and, from torch 2.13 on, to its device mesh too:
    the watch reads the shard's address and skips the mesh, which holds no memory (reading
    the mesh's data_ptr failed every DTensor model's first call)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cgcompile.testing import fake_graphs

    fake_graphs.fake_cuda_graphs(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _ShardedLinear(init_device_mesh("cpu", (1,)))
        assert [name for name, _ in storage_tensors(model.w, "w")] == ["w._local_tensor"]
        backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capture_sizes=(4, 8)))
        compiled = torch.compile(model, backend=backend)
        x = torch.randn(4, 8)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(compiled(x), model(x))
            model.w = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(
                torch.randn(8, 8), model.w.device_mesh, model.w.placements), requires_grad=False)
            for _ in range(3):  # a new shard: without graphs once, then captured again
                torch.testing.assert_close(compiled(x), model(x))
        assert backend.stats.parameter_recaptures == 1
    finally:
        dist.destroy_process_group()


def test_wrapped_addresses_read_shards_in_one_pass_and_walk_anything_else():
    """Inputs that all wrap one tensor at one path (DTensor shards) are read together; a slot
    that later holds another kind of wrapper is walked in full, so its addresses are still read."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.two_tensor import TwoTensor

    from cgcompile.run.weights import WrappedAddresses

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shards = [distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]) for _ in range(3)]
        args = [torch.zeros(2), *shards]
        reader = WrappedAddresses([1, 2, 3], args)
        local = [s._local_tensor.data_ptr() for s in shards]
        assert reader._shared is not None and reader.read(args) == local
        two = TwoTensor(torch.zeros(4, 4), torch.ones(4, 4))
        swapped = [args[0], shards[0], two, shards[2]]
        assert reader.read(swapped) == [local[0], two.a.data_ptr(), two.b.data_ptr(), local[2]]
        mixed = WrappedAddresses([1, 2], [args[0], shards[0], two])
        assert mixed._shared is None and mixed.read([args[0], shards[0], two]) == [
            local[0], two.a.data_ptr(), two.b.data_ptr()]
    finally:
        dist.destroy_process_group()
