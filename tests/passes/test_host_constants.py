"""passes.host_constants: literal host data a graph copies to the device at every call is made
once, where sharing it between calls cannot be seen."""

import torch

from cgcompile.passes import classify_nodes, hoist_host_constants
from cgcompile.passes.host_constants import ATTRIBUTE_PREFIX


def _dynamo_graph(fn, *args):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(fn, backend=record)(*args)
    (gm,) = graphs
    return gm


def _build(fn, args, kwargs):
    return fn(*args, **kwargs)


def _constants(gm) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(ATTRIBUTE_PREFIX)]


def _device_copies(gm) -> list[str]:
    eager = classify_nodes(gm, op_reason=lambda target: None, capture_symbol=None, on_accelerator=True,
                           mutable_inputs=frozenset())
    return [str(r) for r in eager.values() if r.rule == "device_copy"]


def roll_and_write(cache, new):
    # transformers' sliding-window cache: a literal index built at every step.
    index = torch.tensor([-1], dtype=torch.long, device=cache.device)
    rolled = cache.roll(-1, dims=1)
    rolled[:, index] = new
    return rolled * 2


def test_a_literal_tensor_is_made_once_and_the_results_stay():
    cache, new = torch.randn(2, 5), torch.randn(2, 1)
    gm = _dynamo_graph(roll_and_write, cache, new)
    assert _device_copies(gm)
    assert hoist_host_constants(gm, _build) == 1
    assert len(_constants(gm)) == 1 and not _device_copies(gm)
    torch.testing.assert_close(gm(cache, new)[0], roll_and_write(cache, new))
    torch.testing.assert_close(gm(cache, new)[0], roll_and_write(cache, new))  # the constant is unchanged


def select_rows(x):
    return x[..., [-2], :] + x[:, [0, 2]].sum()


def test_list_indices_become_constant_index_tensors():
    x = torch.randn(3, 4, 5)
    gm = _dynamo_graph(select_rows, x)
    assert hoist_host_constants(gm, _build) == 2
    assert len(_constants(gm)) == 2
    torch.testing.assert_close(gm(x)[0], select_rows(x))


def written_or_returned(x):
    written = torch.tensor([1.0, 2.0], device=x.device)
    written.add_(x.sum())  # written in place: a fresh tensor every call is what the graph relies on
    returned = torch.tensor([3.0], device=x.device)
    computed = torch.tensor([4.0], device=x.device)
    return written * 2, returned, computed * x


def test_tensors_written_or_returned_are_left_alone():
    x = torch.randn(2)
    gm = _dynamo_graph(written_or_returned, x)
    assert hoist_host_constants(gm, _build) == 1  # only `computed`
    for got, want in zip(gm(x), written_or_returned(x)):
        torch.testing.assert_close(got, want)
    for got, want in zip(gm(x), written_or_returned(x)):  # again: `written` starts fresh each call
        torch.testing.assert_close(got, want)


def test_data_holding_a_graph_value_is_left_alone():
    # torch.tensor([n, 1]) with n a graph input: the data differs between calls.
    graph = torch.fx.Graph()
    x, n = graph.placeholder("x"), graph.placeholder("n")
    built = graph.call_function(torch.tensor, ([n, 1],))
    built.meta["val"] = torch.tensor([3, 1])
    graph.output(graph.call_function(torch.mul, (x, built)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert hoist_host_constants(gm, _build) == 0
    torch.testing.assert_close(gm(torch.ones(2), 5), torch.tensor([5.0, 1.0]))
