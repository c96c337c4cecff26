"""Dynamo's DTensor spec guards on parameters dropped (by the backend, or by a guard filter),
and cgcompile's own check of the specs at every call (one gloo rank on CPU)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cgcompile
from cgcompile.parallel.dtensor_guards import without_parameter_spec_guards


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class Sharded(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]), requires_grad=False)

    def forward(self, x):
        return torch.relu(x @ self.w.to_local())


@dataclasses.dataclass
class Entry:  # the fields of torch._dynamo.types.GuardFilterEntry the filter reads
    name: str
    guard_type: str


def test_the_filter_drops_only_the_spec_guards_of_parameters():
    entries = [Entry("L['self']._modules['q']._parameters['weight']", "DTENSOR_SPEC_MATCH"),
               Entry("L['self']._modules['q']._parameters['weight']", "TENSOR_MATCH"),
               Entry("L['x']", "DTENSOR_SPEC_MATCH"),  # an activation: Dynamo keeps checking it
               Entry("L['self']._modules['q']._buffers['scale']", "DTENSOR_SPEC_MATCH")]
    assert without_parameter_spec_guards(entries) == [False, True, True, True]


def compiled(model, filtered: bool, spec_guards: str = "cgcompile", record=None):
    """(forward, backend); `record`, a list, receives the guards Dynamo builds the frame's check from."""
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", dtensor_spec_guards=spec_guards))
    if record is not None:
        def guard_filter(entries):
            record.extend(entries)
            return without_parameter_spec_guards(entries) if filtered else [True] * len(entries)
        options = {"guard_filter_fn": guard_filter}
    else:
        options = {"guard_filter_fn": without_parameter_spec_guards} if filtered else None
    return torch.compile(model, backend=backend, options=options), backend


def spec_guards(entries) -> list[str]:
    return [entry.name for entry in entries if entry.guard_type == "DTENSOR_SPEC_MATCH"]


@pytest.mark.parametrize("spec_guards_by", ["cgcompile", "dynamo"])
def test_the_backend_drops_dynamos_spec_guards_of_the_parameters_it_checks(mesh, spec_guards_by):
    entries = []
    forward, backend = compiled(Sharded(mesh), filtered=False, spec_guards=spec_guards_by, record=entries)
    with torch.no_grad():
        forward(torch.randn(3, 8))
    assert backend.runtimes[0].specs is not None  # checked by cgcompile either way
    kept = spec_guards(entries)
    if spec_guards_by == "cgcompile":
        assert kept == []
    else:
        assert len(kept) == 1 and "_parameters['w']" in kept[0]


class ReadsPlacements(torch.nn.Module):
    """`w` feeds the graph; `v` is only looked at (its placements pick the branch), so it is
    no input of the graph and its spec guard is Dynamo's alone."""

    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]), requires_grad=False)
        self.v = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]), requires_grad=False)

    def forward(self, x):
        y = x @ self.w.to_local()
        return y * 2 if self.v.placements[0].is_shard() else y - 1


def test_a_spec_guard_of_a_parameter_that_is_no_graph_input_stays(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    model, entries = ReadsPlacements(mesh), []
    forward, backend = compiled(model, filtered=False, record=entries)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(forward(x), model(x))
        assert backend.runtimes[0].specs.names == ("l_self_parameters_w_",)
        assert [name for name in spec_guards(entries) if "_parameters['v']" in name]
        assert not [name for name in spec_guards(entries) if "_parameters['w']" in name]
        model.v = torch.nn.Parameter(distribute_tensor(model.v.full_tensor(), mesh, [Replicate()]),
                                     requires_grad=False)
        torch.testing.assert_close(forward(x), model(x))  # the other branch: Dynamo compiled it
    assert backend.stats.graphs_seen == 2


@pytest.mark.parametrize("filtered", [False, True], ids=["guarded", "filtered"])
def test_equal_specs_in_new_objects_run_on(mesh, filtered):
    """A parameter replaced by another with the same placements (a reloaded checkpoint)."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = Sharded(mesh)
    forward, backend = compiled(model, filtered)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(forward(x), model(x))
        model.w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, model.w.placements),
                                     requires_grad=False)
        for _ in range(2):
            torch.testing.assert_close(forward(x), model(x))
    assert backend.runtimes[0].specs is not None and backend.runtimes[0].specs.names == ("l_self_parameters_w_",)


def _resharded_after_a_call(mesh, filtered: bool, spec_guards: str = "cgcompile"):
    """(model, forward, backend, x): a call compiled, then the parameter replaced by a replicated one."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.manual_seed(0)
    model = Sharded(mesh)
    forward, backend = compiled(model, filtered, spec_guards)
    x = torch.randn(3, 8)
    with torch.no_grad():
        forward(x)
    model.w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]), requires_grad=False)
    return model, forward, backend, x


@pytest.mark.parametrize("filtered", [False, True], ids=["default", "filtered"])
def test_a_resharded_parameter_raises_where_dynamo_no_longer_checks(mesh, filtered):
    _, forward, _, x = _resharded_after_a_call(mesh, filtered)
    with torch.no_grad():
        with pytest.raises(cgcompile.CGCompileError, match=r"l_self_parameters_w_.*expected the spec its graph was "
                                                             r"compiled for .*dtensor_spec_guards='dynamo'"):
            forward(x)


def test_with_dynamos_guards_a_resharded_parameter_compiles_again(mesh):
    model, forward, backend, x = _resharded_after_a_call(mesh, filtered=False, spec_guards="dynamo")
    with torch.no_grad():
        torch.testing.assert_close(forward(x), model(x))
    assert backend.stats.graphs_seen == 2


def test_where_the_guards_cannot_be_reached_dynamo_keeps_them_and_a_warning_says_so(mesh, monkeypatch, caplog):
    """A torch that keeps a frame's guards elsewhere: nothing is dropped, the call is still
    right and still checked, and the log says why the host time did not drop."""
    from cgcompile import compat
    from cgcompile.build import phases

    monkeypatch.setattr(compat, "_frame_guard_set", lambda context: None)
    phases._warn_spec_guards_kept.cache_clear()
    model, entries = Sharded(mesh), []
    forward, backend = compiled(model, filtered=False, record=entries)
    x = torch.randn(3, 8)
    with torch.no_grad(), caplog.at_level("WARNING", logger="cgcompile.build.phases"):
        torch.testing.assert_close(forward(x), model(x))
    assert len(spec_guards(entries)) == 1 and backend.runtimes[0].specs is not None
    assert "could not be dropped" in caplog.text


def test_outside_dynamo_the_backend_checks_the_specs_and_drops_nothing(mesh, caplog):
    """The backend called on a graph directly (no frame being compiled): no guards to drop,
    and no warning that they could not be."""
    from cgcompile.build import phases

    phases._warn_spec_guards_kept.cache_clear()
    model = Sharded(mesh)
    gm = torch.fx.symbolic_trace(lambda x, w: torch.relu(x @ w.to_local()))
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    x = torch.randn(3, 8)
    with torch.no_grad(), caplog.at_level("WARNING", logger="cgcompile.build.phases"):
        run = backend(gm, [x, model.w])
        torch.testing.assert_close(run(x, model.w), model(x))
    assert backend.runtimes[0].specs is not None and "could not be dropped" not in caplog.text
