"""The split rule finds non-capturable nodes on its own and says why, in words."""

import logging

import torch

import cgcompile
from cgcompile.passes import example_value
from cgcompile.testing.models import ACCUMULATE_OP, SILLY_OP

silly = torch.ops.cgcompile_testing.silly_attention


def compile_eager(fn, **fields):
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", **fields))
    return torch.compile(fn, backend=backend), backend


def rules(piece) -> list[str]:
    """The rule names in a piece's reason, e.g. ["dynamic_shape", "split_op"]."""
    return [part.rsplit("[", 1)[1].rstrip("]") for part in piece.reason.split("; ")]


def test_kv_cache_concatenation_is_dynamic_shape():
    def step(x, cache):  # x: [T, 8] new tokens, cache: [L, 8] past keys
        keys = torch.cat([cache, x * 2], dim=0)  # [L + T, 8]
        scores = (x @ keys.T).softmax(-1)  # [T, L + T]
        return (scores @ keys).relu(), keys  # [T, 8]

    compiled, backend = compile_eager(step)
    for past in (6, 9, 13):
        x, cache = torch.randn(4, 8), torch.randn(past, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(cache, 0)
        for got, want in zip(compiled(x, cache), step(x, cache)):
            assert torch.equal(got, want)
    assert backend.stats.graphs_seen == 1
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    eager = backend.pieces[1]
    assert set(rules(eager)) == {"dynamic_shape"}
    # The concatenation, the scores and the matmul that reads them all depend on L.
    assert eager.reason.startswith("keys: output shape (")
    assert "not on the capture dimension" in eager.reason
    assert "matmul_1: input shape" in eager.reason
    # The capturable pieces see only the capture dimension (T), never the cache length.
    for piece in backend.pieces[0::2]:
        assert all(s.startswith("float32[s") and "+" not in s for s in piece.input_shapes), piece.input_shapes


def test_item_is_host_sync_and_its_value_dynamic_scalar():
    def f(x, counts):
        n = counts.sum().item()  # an unbacked SymInt, a value read on the host
        return (x * n).relu()

    x, counts = torch.randn(4, 8), torch.tensor([1, 2])
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled, backend = compile_eager(f)
        assert torch.equal(compiled(x, counts), f(x, counts))
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    assert rules(backend.pieces[1]) == ["host_sync", "dynamic_scalar"]
    assert "Tensor.item() copies device data to the host" in backend.pieces[1].reason
    assert "a CUDA graph would replay the value it was captured with" in backend.pieces[1].reason


def test_device_copy_and_cpu_tensor():
    # CPU has no accelerator, so the meta device stands in for one: the graph's tensors
    # end up on meta, which makes the CPU ops non-capturable and the .to() a device copy.
    def f(x):
        y = (x * 2).to("meta")
        return x + 1, (y * 3).sin()

    x = torch.randn(4, 8)
    compiled, backend = compile_eager(f)
    got, want = compiled(x), f(x)
    assert torch.equal(got[0], want[0])
    assert (got[1].device.type, got[1].shape) == ("meta", want[1].shape)
    assert [p.capturable for p in backend.pieces] == [False, True]
    assert rules(backend.pieces[0]) == ["cpu_tensor", "device_copy", "cpu_tensor"]
    assert "copies from ['cpu'] to meta" in backend.pieces[0].reason


def test_input_mutation():
    def f(x, w):
        x.add_(1)
        return x @ w

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    x_eager = x.clone()
    compiled, backend = compile_eager(f)
    assert torch.equal(compiled(x, w), f(x_eager, w))
    assert torch.equal(x, x_eager)
    assert [p.capturable for p in backend.pieces] == [False, True]
    assert rules(backend.pieces[0]) == ["input_mutation"]
    assert "writes in place into graph input" in backend.pieces[0].reason


def test_a_view_of_an_input_that_a_split_op_writes_through_is_eager():
    """Made in a captured piece, `out[:, 1:]` would view the graph's static copy of out,
    and the eager split op's write would land in the copy, not in the caller's out."""
    def f(x, out):  # x: [2, 8], out: [2, 8]; static sizes
        view = out[:, 1:]
        t = x * 2.0  # a capturable stretch after the view, so no view-only fold makes it eager
        torch.ops.cgcompile_testing.silly_accumulate(view, t[:, :7])

    x, out = torch.randn(2, 8), torch.randn(2, 8)
    want = out.clone()
    f(x, want)
    compiled, backend = compile_eager(f, splitting_ops=[ACCUMULATE_OP])
    compiled(x, out)
    assert torch.equal(out, want)
    assert [p.capturable for p in backend.pieces] == [False, True, False]
    assert rules(backend.pieces[0]) == ["input_mutation"]
    assert "a view of graph input l_out_, which an op writes into" in backend.pieces[0].reason


def test_no_capturable_piece_warns_once_and_runs(caplog):
    def only_attention(q, k, v):
        return silly(q, k, v)

    q, k, v = torch.randn(3, 4, 8).unbind(0)
    compiled, backend = compile_eager(only_attention, splitting_ops=[SILLY_OP])
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for _ in range(3):
            assert torch.equal(compiled(q, k, v), q + k * v)
    warnings = [r for r in caplog.records if r.name.startswith("cgcompile") and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "graph 0 has no capturable piece; it runs eagerly" in warnings[0].getMessage()
    assert SILLY_OP in warnings[0].getMessage()
    assert (backend.stats.pieces, backend.stats.capturable_pieces) == (1, 0)


def test_view_only_stretch_folds_into_eager_piece():
    def f(x):
        y = silly(x, x, x).transpose(0, 1).unsqueeze(0)  # views only, between two split ops
        return silly(y, y, y).sin()

    x = torch.randn(4, 8)
    compiled, backend = compile_eager(f, splitting_ops=[SILLY_OP])
    assert torch.equal(compiled(x), f(x))
    assert [p.capturable for p in backend.pieces] == [False, True]
    assert "view_only" in rules(backend.pieces[0])


def test_tensor_from_a_python_list_is_a_host_to_device_copy():
    # On an accelerator, torch.tensor(list, device=...) copies host memory each call: a
    # graph would replay a copy from a host buffer it does not own. Checked with the pure
    # pass on a graph traced on CPU, told that the graph runs on an accelerator.
    from cgcompile.passes import classify_nodes

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x):
        idx = torch.tensor([0, 2], device=x.device)
        empty = torch.tensor([], device=x.device)  # nothing to copy: capturable
        return torch.cat([empty, (x[idx] * 2).relu().flatten()])

    torch.compile(f, backend=record)(torch.randn(4, 2))
    eager = classify_nodes(
        graphs[0], op_reason=lambda target: None, capture_symbol=None,
        on_accelerator=True, mutable_inputs=frozenset(),
    )
    reasons = {str(r) for r in eager.values()}
    assert "idx: tensor(...) copies host data to the device on every call [device_copy]" in reasons
    assert not any(r.startswith("empty:") and "device_copy" in r for r in reasons)
    off_accelerator = classify_nodes(
        graphs[0], op_reason=lambda target: None, capture_symbol=None,
        on_accelerator=False, mutable_inputs=frozenset(),
    )
    assert off_accelerator == {}  # on CPU nothing is copied, and nothing is captured anyway


def test_written_inputs_names_the_buffers_a_piece_updates():
    # A capturable piece may write into a buffer (captured by address); its warm-up before
    # capture must then be undone, and `written_inputs` is how the runtime knows.
    from cgcompile.passes import written_inputs

    def f(x, stats, other):
        stats[:4].mul_(0.9)  # through a view
        stats.add_(x.mean(0))
        y = x * other
        y.add_(1)  # an intermediate: not an input
        other.reshape(-1).mul_(2)  # reshape returns a view when it can
        return y

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(f, backend=keep, fullgraph=True)(torch.randn(4, 8), torch.zeros(8), torch.ones(8))
    placeholders = [n.name for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert sorted(placeholders[i] for i in written_inputs(graphs[0])) == ["l_other_", "l_stats_"]


@torch.library.custom_op("cgcompile_tests::write_two", mutates_args=("keys", "values"))
def _write_two(keys: torch.Tensor, values: torch.Tensor, new: torch.Tensor) -> None:
    keys.copy_(new)
    values.copy_(new * 2)


@_write_two.register_fake
def _(keys, values, new):
    return None


def test_an_op_that_writes_two_arguments_writes_both():
    # A cache update writes keys and values: both count, not only the first.
    from cgcompile.passes import written_inputs

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x, keys, values):
        torch.ops.cgcompile_tests.write_two(keys, values, x)
        return x + 1

    torch.compile(f, backend=keep, fullgraph=True)(torch.randn(8), torch.zeros(8), torch.zeros(8))
    placeholders = [n.name for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert sorted(placeholders[i] for i in written_inputs(graphs[0])) == ["l_keys_", "l_values_"]


def test_an_out_argument_is_written_for_the_split_rule_and_the_full_graph_plan():
    # torch.add(x, 1, out=buf) writes into buf: a graph would write into its own copy of it.
    from cgcompile.passes import classify_nodes, written_inputs

    def f(x, buf):
        torch.add(x, 1, out=buf)
        return buf * 2

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(f, backend=keep, fullgraph=True)(torch.randn(8), torch.zeros(8))
    (gm,) = graphs
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert [placeholders[i] for i in written_inputs(gm)] == ["l_buf_"]
    eager = classify_nodes(gm, op_reason=lambda target: None, capture_symbol=None, on_accelerator=False,
                           mutable_inputs=frozenset(placeholders))
    assert [(reason.rule, reason.detail) for reason in eager.values()] == [
        ("input_mutation", "writes in place into graph input l_buf_")]


# -- CPU tensors in a graph that runs on an accelerator ---------------------------------
# Traced with fake CUDA tensors (FakeTensorMode needs no GPU), so the rule sees the devices
# a GPU run has: a CPU tensor among CUDA ones.


def _on_fake_cuda(module: torch.nn.Module, inputs: dict[str, str], cpu_after: tuple[str, ...] = ()):
    """`module` traced with fake inputs of the given shapes ("cuda:8,4", "cpu:", "cuda:4:long"),
    its nodes' `val` metadata set by fake propagation; then `cpu_after` placeholders are made
    CPU tensors (a CUDA op indexed with CPU indices cannot be propagated without a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.symbolic_trace(module)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants stay real CPU tensors

    def make(spec, device=None):
        where, shape, *dtype = spec.split(":")
        dims = [int(d) for d in shape.split(",") if d]
        return torch.zeros(dims, device=device or where, dtype=torch.long if dtype else torch.float32)

    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*(make(s) for s in inputs.values()))
        for name in cpu_after:
            gm.graph.find_nodes(op="placeholder", target=name)[0].meta["val"] = make(inputs[name], "cpu")
    return gm


def _classify(gm, on_accelerator=True):
    from cgcompile.passes import classify_nodes

    return classify_nodes(gm, op_reason=lambda target: None, capture_symbol=None,
                          on_accelerator=on_accelerator, mutable_inputs=frozenset())


class _ReadsHostTensors(torch.nn.Module):
    def forward(self, x, s, idx, t):  # x: [8, 4] cuda; s: [] cpu; idx: [4] cpu; t: [2] cpu
        y = x.sin() * s  # a 0-dim CPU tensor as a scalar operand
        z = y.index_select(0, idx) + torch.tensor(0.5)  # CPU indices; a CPU constant (get_attr)
        w = z.view(t.size(0), -1)  # only t's size, but the split would hand t to the piece
        return w.cos()


def test_an_op_reading_a_cpu_tensor_is_cpu_tensor():
    gm = _on_fake_cuda(_ReadsHostTensors(), {"x": "cuda:8,4", "s": "cpu:", "idx": "cuda:4:long", "t": "cpu:2"},
                       cpu_after=("idx",))
    eager = {node.name: str(reason) for node, reason in _classify(gm).items()}
    replays = "and a CUDA graph would replay the value it was captured with [cpu_tensor]"
    assert eager == {
        "mul": f"mul: reads a CPU tensor s, {replays}",
        "index_select": f"index_select: reads a CPU tensor idx, {replays}",
        "add": f"add: reads a CPU tensor _tensor_constant0, {replays}",
        "view": f"view: reads a CPU tensor t through the size computation size, which hands it to the piece, {replays}",
    }
    assert _classify(gm, on_accelerator=False) == {}  # on CPU nothing is captured


def test_an_all_cuda_graph_has_no_cpu_tensor_reason():
    # The same ops with every tensor on CUDA: nothing runs eagerly (the rule reads devices,
    # not op names). The constant is a CUDA tensor here.
    class AllCuda(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("shift", torch.zeros(()))

        def forward(self, x, s, idx, t):
            y = x.sin() * s
            z = y.index_select(0, idx) + self.shift
            return z.view(t.size(0), -1).cos()

    module = AllCuda()
    gm = _on_fake_cuda(module, {"x": "cuda:8,4", "s": "cuda:", "idx": "cuda:4:long", "t": "cuda:2"})
    gm.graph.find_nodes(op="get_attr")[0].meta["val"] = None  # read the constant itself instead
    gm.shift = torch.empty((), device="meta")  # not CPU: stands in for a CUDA buffer
    assert _classify(gm) == {}
    gm.shift = torch.zeros(())  # a constant left on the CPU (a plain tensor attribute) is read
    assert [str(r) for r in _classify(gm).values()] == [
        "add: reads a CPU tensor shift, and a CUDA graph would replay the value it was captured with [cpu_tensor]"]


def test_no_capturable_piece_of_the_split_holds_a_cpu_tensor():
    from cgcompile.passes import example_value, split_graph, tensors_in

    gm = _on_fake_cuda(_ReadsHostTensors(), {"x": "cuda:8,4", "s": "cpu:", "idx": "cuda:4:long", "t": "cpu:2"},
                       cpu_after=("idx",))
    split = split_graph(gm, _classify(gm))
    assert [p.capturable for p in split.pieces] == [True, False, True]
    for piece in split.pieces:
        if not piece.capturable:
            continue
        crossing = [*piece.inputs, *piece.outputs, *piece.graph.graph.find_nodes(op="get_attr")]
        devices = {t.device.type for node in crossing for t in tensors_in(example_value(node))}
        assert devices == {"cuda"}, (piece.name, devices)


def test_a_cpu_scalar_in_an_accelerator_graph_runs_eagerly_end_to_end():
    # The meta device stands in for an accelerator (see test_device_copy_and_cpu_tensor):
    # Dynamo's graph holds meta tensors, a CPU graph input and a CPU tensor made inside.
    def f(x, s):
        y = x.sin() * s
        return (y + torch.tensor(0.5)).cos()

    compiled, backend = compile_eager(f)
    out = compiled(torch.randn(4, 8, device="meta"), torch.tensor(2.0))
    assert (out.device.type, out.shape) == ("meta", (4, 8))
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    eager = backend.pieces[1]
    assert rules(eager) == ["cpu_tensor", "device_copy", "cpu_tensor"]
    assert eager.reason.startswith("y: reads a CPU tensor l_s_, and a CUDA graph would replay")
    assert "add: reads a CPU tensor tensor," in eager.reason
    for piece in backend.pieces[0::2]:  # the capturable pieces: no CPU tensor in or out
        values = [example_value(n) for n in piece.graph.graph.nodes if n.op in ("placeholder", "get_attr")]
        assert all(v.device.type == "meta" for v in values if isinstance(v, torch.Tensor))


def test_a_function_called_with_inplace_true_writes_its_first_argument():
    # Dynamo keeps nn.ReLU(inplace=True) as `F.relu(x, inplace=True)`, and a positional
    # `F.hardswish(x, True)` as it is: both write into x, a graph input here.
    import torch.nn.functional as F

    def f(x, y, z, w):
        F.hardswish(x, True)
        F.relu(y, inplace=True)
        F.relu(z)  # not in place
        return (x + y + z) @ w

    args = [torch.randn(4, 8) for _ in range(3)] + [torch.randn(8, 8)]
    eager_args = [a.clone() for a in args]
    compiled, backend = compile_eager(f)
    assert torch.equal(compiled(*args), f(*eager_args))
    for got, expected in zip(args, eager_args):
        assert torch.equal(got, expected)
    assert rules(backend.pieces[0]) == ["input_mutation", "input_mutation"]
