"""passes.device_scalars: a SymInt input the graph reads only as a value of tensor ops is
read from a device buffer; one that is a shape, a bound or an argument the pass does not
know stays a host value."""

import torch

from cgcompile.passes import example_value, read_scalars_from_device
from cgcompile.passes.device_scalars import BUFFER_NAME
from cgcompile.run.device_scalars import DeviceScalarBuffer


def _dynamo_graph(fn, x, values):
    """The graph of fn(x, n) for the last n of `values`: the second value makes n a SymInt
    input (automatic dynamic), as a cache length that grows every step is."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(fn, backend=record)
    for n in values:
        compiled(x, n)
    gm = graphs[-1]
    assert any(isinstance(example_value(p), torch.SymInt) for p in gm.graph.find_nodes(op="placeholder"))
    return gm


def _inputs(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _run(gm, found, x, n):
    """Call the rewritten graph as the runtime does: the buffer written, then appended."""
    values = torch.zeros(len(found.inputs), dtype=torch.int64)
    buffer = DeviceScalarBuffer(found, gm, values)
    args = buffer.extend([n if isinstance(example_value(p), torch.SymInt) else x for p in _inputs(gm)[:-1]])
    return buffer, args, gm(*args)


def sliding_mask_offset(x, n):
    # transformers' sliding-window mask: kv_offset = max(n - window + 1, 0), read by a tensor op.
    offset = max(n - 8 + 1, 0)
    positions = torch.arange(8) + offset
    return (positions * x).sum(), (positions <= n).sum(), n + 1  # n + 1: Dynamo hands the int back


def test_a_value_only_symbol_is_read_from_the_buffer_and_results_stay():
    x = torch.randn(8)
    gm = _dynamo_graph(sliding_mask_offset, x, [3, 12])
    rewritten, found = read_scalars_from_device(gm)
    assert rewritten is not gm and _inputs(rewritten)[-1].name == BUFFER_NAME
    assert len(found.inputs) == 1 and found.kept == () and found.device == torch.device("cpu")
    assert found.host_outputs == (2,)
    symint = _inputs(rewritten)[found.inputs[0]]
    assert all(user.op == "output" or isinstance(example_value(user), torch.SymInt) for user in symint.users)
    assert _inputs(gm)[-1].name != BUFFER_NAME  # Dynamo's graph is left as it was
    for n in (0, 5, 12, 40):  # below the window (offset 0) and above it
        buffer, args, got = _run(rewritten, found, x, n)
        want = sliding_mask_offset(x, n)
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1]) and got[2] == n + 1
        # A replayed graph returns the host ints of its capture; they are computed again.
        assert buffer.host_outputs(args, (None, None, -1)) == (None, None, n + 1)


def as_bound(x, n):
    return x[:n] * 2 + n


def as_size(x, n):
    return torch.arange(n).sum() + x.sum() + n


def as_fill(x, n):
    return torch.full((16,), n) + x  # torch.full takes no tensor fill value without a host sync


def test_a_symbol_used_as_a_bound_or_a_size_or_unknown_stays_a_host_value():
    x = torch.randn(16)
    for fn, why in ((as_bound, "layout"), (as_size, "layout"), (as_fill, "needs a host int")):
        gm = _dynamo_graph(fn, x, [3, 5])
        rewritten, found = read_scalars_from_device(gm)
        assert rewritten is gm and found.inputs == ()
        ((name, reason),) = found.kept
        assert why in reason, (fn.__name__, reason)


def mixed(x, n):
    return (x + n).sum() + x[:n].sum()  # a value here, a slice bound there


def zero_dim_int32(x, n):
    # A 0-d int32 tensor and a Python int stay int32; with a 0-d int64 tensor they would not.
    return x.to(torch.int32).amax() + n  # amax keeps int32 (a sum would be int64)


def test_mixed_uses_and_a_changed_dtype_leave_the_symbol_alone():
    x = torch.arange(16.0)
    for fn, why in ((mixed, "layout"), (zero_dim_int32, "needs a host int")):
        gm = _dynamo_graph(fn, x, [3, 5])
        rewritten, found = read_scalars_from_device(gm)
        assert rewritten is gm and found.inputs == () and why in found.kept[0][1]


def returned_only(x, n):
    # generate()'s decode graph: the cache length only goes back to the host (n + 1).
    return x * 2, n + 1


def test_a_symbol_only_returned_is_left_out_of_the_key_with_nothing_read_on_the_device():
    x = torch.randn(8)
    gm = _dynamo_graph(returned_only, x, [3, 12])
    rewritten, found = read_scalars_from_device(gm)
    assert len(found.inputs) == 1 and found.host_outputs == (1,)
    # No device read and no device copy of the host arithmetic: only the buffer's input.
    assert not [n for n in rewritten.graph.nodes if n.op == "call_function" and n.args and n.args[0] is
                _inputs(rewritten)[-1]]
    assert [n.target for n in rewritten.graph.nodes if n.op == "call_function"] == \
        [n.target for n in gm.graph.nodes if n.op == "call_function"]
    for n in (0, 7, 30):
        buffer, args, got = _run(rewritten, found, x, n)
        torch.testing.assert_close(got[0], x * 2)
        assert buffer.host_outputs(args, (None, -1)) == (None, n + 1)
