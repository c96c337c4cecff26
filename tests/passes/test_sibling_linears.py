"""Config.fuse_sibling_linears: sibling linears as one matmul, and the weight copies kept fresh.
With CUDA graphs (marked `cuda`): piecewise and full graphs read the fused copies, and a
parameter update reaches graphs already captured."""

import logging

import pytest
import torch
import torch.nn.functional as F

import cgcompile
from cgcompile.passes import fuse_sibling_linears
from cgcompile.passes.sibling_linears import LINEAR_FUNCTIONS
from cgcompile.run.fused_weights import FusedWeightStore
from cgcompile.testing.hf_models import ARCHS, compile_and_match_eager, fixed_length_generate, tiny_model


@pytest.fixture(autouse=True)
def no_grad():
    """Inference, as the option is meant for (parameters that need gradients are not fused)."""
    with torch.no_grad():
        yield


class Projections(torch.nn.Module):
    """q, k, v with biases and gate, up without, on one input: two groups (bias or not)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 32), torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
        self.gate, self.up = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.out = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x):  # x: [T, 16]
        q = self.q(x).view(x.shape[0], 4, 8)  # a view the fused slice must allow
        mixed = q.sum(-1) + self.k(x)[:, :4] * self.v(x)[:, 4:]
        return mixed, self.out(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def compiled(model, **config):
    config = {"compiler": "eager", "fuse_sibling_linears": True, **config}
    backend = cgcompile.Backend(cgcompile.Config(**config))
    return torch.compile(model, backend=backend), backend


def assert_matches_eager(compiled_model, model, x):
    for got, expected in zip(compiled_model(x), model(x)):
        torch.testing.assert_close(got, expected)


def test_the_default_leaves_models_off_cuda_alone():
    model = Projections()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    assert backend.config.rewrites.fuse_sibling_linears is None
    torch.compile(model, backend=backend)(torch.randn(3, 16))
    assert backend.stats.fused_linears == 0 and backend.stats.fused_weight_bytes == 0


def test_off_when_asked():
    model = Projections()
    compiled_model, backend = compiled(model, fuse_sibling_linears=False)
    assert_matches_eager(compiled_model, model, torch.randn(3, 16))
    assert backend.stats.fused_linears == 0 and backend.stats.shared_fused_weights == 0


def test_fuses_each_group_and_matches_eager():
    torch.manual_seed(0)
    model = Projections()
    compiled_model, backend = compiled(model)
    for rows in (3, 5, 1):
        assert_matches_eager(compiled_model, model, torch.randn(rows, 16))
    graphs = backend.stats.graphs_seen  # 3 rows, then dynamic rows, then 1 row (specialised)
    assert backend.stats.fused_linears == 5 * graphs  # q, k, v and gate, up; not out
    # One fused weight for all graphs each: q/k/v weights, their biases, gate/up weights,
    # each in the memory of the parameters, which are now views of its rows.
    assert backend.stats.shared_fused_weights == 3 and backend.stats.fused_weight_bytes == 0
    assert rows_of_one_tensor(model.q.weight, model.k.weight, model.v.weight)
    assert rows_of_one_tensor(model.q.bias, model.k.bias, model.v.bias)
    assert rows_of_one_tensor(model.gate.weight, model.up.weight)
    linears = [n for p in backend.pieces for n in p.graph.graph.nodes if getattr(n.target, "__name__", "") == "linear"]
    assert len(linears) == 3 * graphs  # fused q/k/v, fused gate/up, out


def rows_of_one_tensor(*parameters) -> bool:
    """Whether the parameters lie one after another in one memory, as rows of a fused weight."""
    first = parameters[0]
    offset = first.storage_offset()
    for p in parameters:
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def called_once(shared: bool = True):
    """A compiled Projections after its first call (fused weights made), that call's input,
    and with shared=False a kept `param.data` of every parameter, so that the fused weights
    must be copies."""
    torch.manual_seed(0)
    model = Projections()
    kept = [] if shared else [p.data for p in model.parameters()]
    compiled_model, backend = compiled(model)
    x = torch.randn(4, 16)
    compiled_model(x)
    assert backend.stats.shared_fused_weights == (3 if shared else 0), kept
    return model, compiled_model, backend, x


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_parameter_updates_reach_the_fused_weights(shared):
    model, compiled_model, backend, x = called_once(shared)
    with torch.no_grad():
        model.k.weight.mul_(2)  # in place through the parameter: its version counter moves
    assert_matches_eager(compiled_model, model, x)
    model.load_state_dict({name: torch.randn_like(p) for name, p in model.state_dict().items()})
    assert_matches_eager(compiled_model, model, x)
    model.v.bias.data = torch.randn(8)  # a new tensor: its address moves
    assert_matches_eager(compiled_model, model, x)
    # Writes through a shared parameter land in the fused weight: only the move refreshes.
    assert backend.stats.fused_weight_refreshes == (1 if shared else 3)
    with torch.no_grad():
        model.v.bias.mul_(3)  # v's bias moved out of the fused bias: now a copy, watched as one
    assert_matches_eager(compiled_model, model, x)
    assert backend.stats.fused_weight_refreshes == (2 if shared else 4)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_a_graph_compiled_after_an_update_shares_the_refreshed_copy(shared):
    model, compiled_model, backend, x = called_once(shared)
    copies = backend.stats.fused_weight_bytes
    with torch.no_grad():
        model.k.weight.mul_(2)
    for rows in (7, 1):  # new Dynamo graphs (dynamic rows, then 1), compiled after the update
        assert_matches_eager(compiled_model, model, torch.randn(rows, 16))
    assert_matches_eager(compiled_model, model, x)  # and the first graph, which refreshes itself
    assert backend.stats.graphs_seen == 3
    assert backend.stats.fused_weight_bytes == copies  # no second copy of the same weights
    assert backend.stats.shared_fused_weights == (3 if shared else 0)


def test_a_write_through_data_reaches_a_shared_fused_weight():
    model, compiled_model, backend, x = called_once()
    model.q.weight.data.mul_(3)  # the parameter is its rows of the fused weight
    assert_matches_eager(compiled_model, model, x)


def test_a_write_through_data_needs_a_refresh_of_a_copy():
    """The documented blind spot of copies: `param.data` has its own version counter."""
    model, compiled_model, backend, x = called_once(shared=False)
    model.q.weight.data.mul_(3)
    stale, expected = compiled_model(x)[0], model(x)[0]
    assert not torch.allclose(stale, expected)
    backend.refresh_fused_weights()
    assert_matches_eager(compiled_model, model, x)


def test_computed_weights_and_mixed_dtypes_are_left_alone():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).double()
            self.c = torch.nn.Linear(8, 8)

        def forward(self, x):
            scaled = torch.nn.functional.linear(x, self.c.weight * 2)  # a weight computed in the graph
            return self.a(x) + self.b(x.double()).float() + scaled

    model = Odd()
    compiled_model, backend = compiled(model)
    x = torch.randn(2, 8)
    torch.testing.assert_close(compiled_model(x), model(x))
    assert backend.stats.fused_linears == 0


def test_the_dynamo_graph_keeps_its_placeholders():
    """Dynamo reads its graph's placeholders after the backend returns: the pass copies."""
    model = Projections()
    seen = {}

    def backend(gm, example_inputs):
        before = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        params = {n.name: x for n, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs)
                  if isinstance(x, torch.nn.Parameter)}
        fused_gm, added = fuse_sibling_linears(gm, params)
        seen["added"] = [f.name for f in added]
        seen["kept"] = before == [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        seen["new"] = [n.name for n in fused_gm.graph.nodes if n.op == "placeholder"][len(before):]
        return gm.forward

    torch.compile(model, backend=backend)(torch.randn(2, 16))
    assert seen["kept"] and seen["new"] == seen["added"] == ["fused_weight_0", "fused_bias_1", "fused_weight_2"]


# Slow (--run-slow): mistral. Its attention and MLP are llama's modules (q/k/v/o and gate/up/down
# projections without bias), so the llama case fuses the same groups; its sliding window
# changes the mask only, which test_hf_generate.py's mistral cases run through generate().
GENERATE_ARCHS = [pytest.param(arch, marks=[pytest.mark.slow] if arch == "mistral" else []) for arch in ARCHS]


@pytest.mark.parametrize("arch", GENERATE_ARCHS)
def test_hf_generate_with_fused_linears(arch):
    """Greedy tokens equal eager's (three Dynamo graphs: see tests/test_hf_generate.py); the
    graphs share one copy of each fused weight."""
    model = tiny_model(arch)
    backend = compile_and_match_eager(model, 2, fuse_sibling_linears=True)
    if arch == "gpt2":  # its q/k/v are one Conv1D already (addmm, not linear)
        assert backend.stats.fused_linears == 0
        return
    layers, graphs = model.config.num_hidden_layers, backend.stats.graphs_seen
    assert backend.stats.fused_linears == 5 * layers * graphs  # q, k, v and gate, up per layer
    assert backend.stats.fused_weight_bytes == 0  # every fused weight shares its parameters' memory
    attention = model.model.layers[0].self_attn
    assert rows_of_one_tensor(attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)


def test_gptj_parallel_block():
    """GPT-J projects one input with q, k, v (no bias) and fc_in (bias): one group of three,
    and its uses follow each projection in turn (the rewrite must keep the graph ordered)."""
    model = tiny_model("gptj")
    ids = torch.randint(0, 128, (2, 5))
    expected = model(ids).logits
    compiled_model, backend = compiled(model)
    torch.testing.assert_close(compiled_model(ids).logits, expected)
    assert backend.stats.fused_linears == 3 * 2  # q, k, v per layer


def test_parameters_that_need_gradients_are_not_fused():
    """With grad on, the copies would take the gradients of the parameters they came from."""
    torch.manual_seed(0)
    model, reference = Projections(), Projections()
    reference.load_state_dict(model.state_dict())
    compiled_model, backend = compiled(model)
    x = torch.randn(4, 16)
    with torch.enable_grad():
        sum(o.sum() for o in compiled_model(x)).backward()
        sum(o.sum() for o in reference(x)).backward()
    assert backend.stats.fused_linears == 0
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    compiled_model(x)  # grad off (the fixture): Dynamo compiles again, and this graph fuses
    assert backend.stats.fused_linears == 5


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("arch, batch", [("llama", 1), ("qwen2", 3)])
def test_fp32_greedy_tokens_equal_eager(arch, batch, compiler):
    model = tiny_model(arch, device="cuda")
    stats = compile_and_match_eager(model, batch, fuse_sibling_linears=True, compiler=compiler).stats
    assert stats.fused_linears == 5 * model.config.num_hidden_layers * stats.graphs_seen
    assert stats.graphs_captured == stats.capturable_pieces > 0


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "copies"])
def test_full_graph_sees_a_weight_update_after_capture(shared):
    """Static cache: decode replays one full graph; an in-place update of a fused
    parameter between generate() calls lands in the fused weight (shared) or is copied
    into it before the replay (copies: a kept `param.data` of every parameter)."""
    model = tiny_model("llama", device="cuda")
    eager = tiny_model("llama", device="cuda")
    kept = [] if shared else [p.data for p in model.parameters()]
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), fuse_sibling_linears=True))
    model.forward = torch.compile(model.forward, backend=backend)
    before = fixed_length_generate(eager, 2, cache_implementation="static")
    assert torch.equal(fixed_length_generate(model, 2, cache_implementation="static"), before)
    with torch.no_grad():
        for m in (model, eager):
            m.model.layers[0].self_attn.k_proj.weight.mul_(-1.5)
            m.model.layers[1].mlp.up_proj.weight.add_(0.1)
    after = fixed_length_generate(eager, 2, cache_implementation="static")
    assert not torch.equal(after, before)  # the update matters to the tokens
    assert torch.equal(fixed_length_generate(model, 2, cache_implementation="static"), after)
    stats = backend.stats
    assert stats.full_graph_calls > 0 and (stats.shared_fused_weights > 0) == shared, kept
    assert (stats.fused_weight_refreshes == 0) if shared else (stats.fused_weight_refreshes >= 1)



class Tied(torch.nn.Module):
    """Siblings whose weights cannot move: k and v are one parameter, and q's weight is a
    view of a larger tensor."""

    def __init__(self):
        super().__init__()
        self.storage = torch.randn(40, 16)
        self.q, self.k = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
        self.q.weight = torch.nn.Parameter(self.storage[:8])
        self.v = torch.nn.Linear(16, 8)
        self.v.weight = self.k.weight

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


def test_weights_that_cannot_move_are_fused_into_copies(caplog):
    torch.manual_seed(0)
    model = Tied()
    compiled_model, backend = compiled(model)
    x = torch.randn(3, 16)
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        torch.testing.assert_close(compiled_model(x), model(x))
    # The weights are a copy; the biases, three parameters of their own, share.
    assert backend.stats.fused_linears == 3 and backend.stats.shared_fused_weights == 1
    assert backend.stats.fused_weight_bytes == 24 * 16 * 4
    assert rows_of_one_tensor(model.q.bias, model.k.bias, model.v.bias)
    assert model.q.weight.data_ptr() == model.storage.data_ptr()  # left where it was
    reasons = " ".join(r.getMessage() for r in caplog.records if "is a copy" in r.getMessage())
    assert "a view of larger memory" in reasons or "one tensor is the weight of two" in reasons
    with torch.no_grad():
        model.storage[:8].mul_(2)  # a write the fused copy cannot see: refreshed on request
    backend.refresh_fused_weights()
    torch.testing.assert_close(compiled_model(x), model(x))


def test_a_second_backend_reads_weights_another_one_shared():
    """Parameters a first backend made views of its fused weights lie one after another
    already: a second backend over the same model reads them there (no copy)."""
    model, compiled_model, backend, x = called_once()
    torch._dynamo.reset()
    second_model, second = compiled(model)
    assert_matches_eager(second_model, model, x)
    assert second.stats.shared_fused_weights == 3 and second.stats.fused_weight_bytes == 0
    with torch.no_grad():
        model.up.weight.mul_(-1)  # one memory: both backends see it
    assert_matches_eager(second_model, model, x)
    assert_matches_eager(compiled_model, model, x)


def test_a_store_without_copies_declines_weights_that_cannot_move():
    """The default's store (Config.fuse_sibling_linears=None) fuses only weights that can
    share the parameters' memory: for the rest it hands back None and nothing moves."""
    model = Tied()
    store = FusedWeightStore(copies=False)
    before = model.q.weight.data_ptr()
    assert store([model.q.weight, model.k.weight, model.v.weight]) is None
    assert model.q.weight.data_ptr() == before and store.bytes == 0 and store.shared == 0
    shared = store([model.q.bias, model.k.bias, model.v.bias])  # three parameters of their own
    assert shared is not None and store.shared == 1 and rows_of_one_tensor(model.q.bias, model.k.bias, model.v.bias)


def test_a_declined_group_stays_unfused_in_the_graph():
    def three_projections(x, wq, wk, wv):
        return F.linear(x, wq) + F.linear(x, wk) * F.linear(x, wv)

    gm = torch.fx.symbolic_trace(three_projections)
    params = {name: torch.nn.Parameter(torch.randn(8, 16)) for name in ("wq", "wk", "wv")}
    fused_gm, added = fuse_sibling_linears(gm, params)  # what a store that fuses gets
    assert len(added) == 1 and _linears(fused_gm) == 1
    declined_gm, added = fuse_sibling_linears(gm, params, concat=lambda parts: None)
    assert added == [] and _linears(declined_gm) == 3
    x = torch.randn(2, 16)
    torch.testing.assert_close(declined_gm(x, *params.values()), three_projections(x, *params.values()))


def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target in LINEAR_FUNCTIONS for n in gm.graph.nodes)


@pytest.mark.cuda
def test_the_default_fuses_on_cuda_where_the_weights_can_share():
    torch.manual_seed(0)
    with torch.device("cuda"):  # Tied's storage is a plain attribute: .cuda() would not move it
        model, tied = Projections(), Tied()
    compiled_model, backend = compiled(model, compiler="inductor", fuse_sibling_linears=None)
    for rows in (3, 1):
        assert_matches_eager(compiled_model, model, torch.randn(rows, 16, device="cuda"))
    assert backend.stats.shared_fused_weights == 3 and backend.stats.fused_weight_bytes == 0
    assert rows_of_one_tensor(model.q.weight, model.k.weight, model.v.weight)
    # Tied weights cannot share: their group stays unfused, and no copy is made.
    compiled_tied, tied_backend = compiled(tied, compiler="inductor", fuse_sibling_linears=None)
    x = torch.randn(3, 16, device="cuda")
    torch.testing.assert_close(compiled_tied(x), tied(x))
    assert tied_backend.stats.fused_weight_bytes == 0
    assert tied.q.weight.data_ptr() == tied.storage.data_ptr()
