"""Full graphs beside piecewise, chosen per call: the declaration, the plan, the choice.

Without CUDA the full path runs the whole graph as one function, and the same choice
logic decides per call which path runs: these tests check its decisions and reasons,
and that both paths give eager's answers exactly. The CUDA tests (marked `cuda`, at the end)
replay real graphs: the whole step, split ops included, must give eager's results, and a
call whose host-side value changed must not replay.
"""

import copy
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgcompile
from cgcompile.build import phases
from cgcompile.run.capture import CaptureSession
from cgcompile.build.compiler import EagerPieceCompiles, PieceCompiler
from cgcompile.run.recovery import UncapturableOps
from cgcompile.run.weights import ParameterAddresses
from cgcompile.testing.models import ACCUMULATE_OP, HOST_SCALE_OP, SILLY_OP, StaticCacheDecoder, ToyLlama

FULL = cgcompile.Config(compiler="eager", capturable_split_ops=("attention",))
HOST_REASON = "a host-side input differs from the captured one"


def decode_steps(model, steps: int, prompt: int = 4):
    """Prefill `prompt` tokens, then decode one token per call: the logits of every call."""
    out = [model(torch.arange(1, prompt + 1), torch.arange(prompt))]
    for s in range(steps):
        out.append(model(torch.tensor([s % 7]), torch.tensor([prompt + s])))
    return out


@torch.no_grad()
def test_static_cache_decodes_from_the_full_path_after_one_piecewise_call_per_graph():
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    eager = decode_steps(copy.deepcopy(model), 8)
    backend = cgcompile.Backend(FULL)
    got = decode_steps(torch.compile(model, backend=backend), 8)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    stats = backend.stats
    # Prefill (one call) and decode (8 calls) are two Dynamo graphs; each runs its first
    # call piecewise, then replays its full graph while the host-side inputs stay.
    assert (stats.graphs_seen, stats.piecewise_calls, stats.full_graph_calls) == (2, 2, 7)
    assert stats.piecewise_reasons == {"first call of its size": 2}


@torch.no_grad()
def test_no_full_graph_is_added_after_a_capture_under_a_memory_budget():
    """A budgeted capture plans the pieces' graphs only: a full graph made afterwards would
    go past the budget, so calls stay piecewise (and full graphs held before replay)."""
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    eager = decode_steps(copy.deepcopy(model), 6)
    backend = cgcompile.Backend(FULL)
    backend.session.lazy_capture = False  # what Backend.capture(..., memory_budget=...) leaves
    got = decode_steps(torch.compile(model, backend=backend), 6)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert backend.stats.full_graph_calls == 0
    assert backend.stats.piecewise_reasons["no graph may be added after a capture under a memory budget"] == 7  # every call


@torch.no_grad()
def test_without_the_declaration_nothing_changes():
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    decode_steps(torch.compile(model, backend=backend), 3)
    assert (backend.stats.full_graph_calls, backend.stats.piecewise_calls) == (0, 0)
    assert all(rt.full is None for rt in backend.runtimes)


# ---- the automatic default: a full graph for every graph that has CUDA graphs ----

def dynamo_graph(model, *args):
    """(gm, example_inputs): the one graph Dynamo captures for model(*args)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return seen[0]


def full_graph_choice(config, cudagraphs: bool, model, *args):
    """(phases.full_graph's choice, stats.full_graph_choices) for the graph of model(*args),
    its analysis saying `cudagraphs` (True: as on CUDA; the full path is built, never run)."""
    gm, inputs = dynamo_graph(model, *args)
    analysis = phases.analyse(gm, inputs, config)
    split = phases.split_pieces(gm, analysis, config, UncapturableOps())
    sizing = phases.choose_sizing(split, analysis, config)
    build = phases.GraphBuild(0, analysis, sizing, PieceCompiler("eager"), config)
    session = CaptureSession.for_config(config)
    runners = phases.build_runners(build, split, session)  # CPU runners: only the full path is looked at
    build = dataclasses.replace(build, analysis=dataclasses.replace(analysis, cudagraphs=cudagraphs))
    choice = phases.full_graph(build, gm, split, runners, session, EagerPieceCompiles({}, False))
    return choice, {choice.choice: 1}  # the Backend counts each graph's choice once


DECODE_STEP = (torch.tensor([3]), torch.tensor([4]))  # StaticCacheDecoder's ids, pos


@torch.no_grad()
@pytest.mark.parametrize("compiler, small_query", [("inductor", True), ("eager", False)])
def test_the_automatic_default_gives_a_graph_with_cuda_graphs_a_full_graph(compiler, small_query):
    config = cgcompile.Config(compiler=compiler)
    choice, choices = full_graph_choice(config, True, StaticCacheDecoder().eval(), *DECODE_STEP)
    assert choices == {phases.CHOSEN_AUTOMATICALLY: 1}
    assert choice.graph is not None
    assert choice.summary.startswith("full graph per call where these match the capture")
    assert choice.summary.endswith('(chosen automatically: full_graph="auto", the default with CUDA graphs; '
                                   'full_graph=None for piecewise only)')
    assert ("attention of few query rows compiled as batched matmuls" in choice.summary) is small_query


@torch.no_grad()
@pytest.mark.parametrize("config, cudagraphs, choice", [
    (cgcompile.Config(compiler="eager"), False, phases.OFF_WITHOUT_GRAPHS),  # CPU: piecewise, as before
    (cgcompile.Config(compiler="eager", full_graph=None), True, phases.OFF_BY_CONFIG),
    (cgcompile.Config(compiler="eager", capturable_split_ops=()), True, phases.OFF_BY_CONFIG),
])
def test_the_automatic_default_stays_piecewise_without_cuda_graphs_or_when_turned_off(config, cudagraphs, choice):
    got, choices = full_graph_choice(config, cudagraphs, StaticCacheDecoder().eval(), *DECODE_STEP)
    assert (got.graph, got.summary, choices) == (None, None, {choice: 1})


@torch.no_grad()
def test_the_automatic_default_leaves_out_a_graph_without_eager_pieces():
    """Its piecewise run is one CUDA graph already; a written-out full graph still gets one."""
    mlp, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8)
    got, choices = full_graph_choice(cgcompile.Config(compiler="eager"), True, mlp, x)
    assert got.graph is None and choices == {phases.OFF_ONE_PIECE: 1}
    got, choices = full_graph_choice(FULL, True, mlp, x)
    assert got.graph is not None and choices == {phases.CHOSEN_BY_CONFIG: 1}
    assert not got.summary.endswith("piecewise only)")  # written out: no note on the automatic choice


@torch.no_grad()
def test_the_backend_counts_how_each_graph_chose_its_path():
    model = StaticCacheDecoder().eval()
    for config, choice in [(cgcompile.Config(compiler="eager"), phases.OFF_WITHOUT_GRAPHS),
                           (FULL, phases.CHOSEN_BY_CONFIG)]:
        torch._dynamo.reset()
        backend = cgcompile.Backend(config)
        decode_steps(torch.compile(copy.deepcopy(model), backend=backend), 3)
        assert backend.stats.full_graph_choices == {choice: 2}  # prefill and decode


class HostScaled(nn.Module):
    """x [T, 8] -> [T, 8]; the split op multiplies by the host int k."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, k: int):
        return self.b(torch.ops.cgcompile_testing.host_scale(self.a(x), k))


@torch.no_grad()
def test_a_changed_host_value_takes_the_piecewise_path(caplog):
    """k is a symbol the split op reads: a full graph captured at k=3 would return 3x for
    k=5. The call with k=5 runs piecewise (right answer, reason logged) and the full
    graph comes back when k repeats."""
    torch.manual_seed(0)
    model = HostScaled()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(HOST_SCALE_OP,)))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 8)
    caplog.set_level(logging.INFO, logger="cgcompile")
    for k in (3, 3, 3, 5, 3):
        torch.testing.assert_close(compiled(x, k), model(x, k), rtol=0, atol=0)
    stats = backend.stats
    assert stats.graphs_seen == 1
    # k=3 first (piecewise), k=3 (full: captured), k=3 (full), k=5 (piecewise), k=3 (full)
    assert (stats.piecewise_calls, stats.full_graph_calls) == (2, 3)
    assert stats.piecewise_reasons == {"first call of its size": 1, HOST_REASON: 1}
    assert any("host value of input" in r.getMessage() and "is 5, captured with 3" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@torch.no_grad()
def test_a_host_value_that_settles_on_a_new_value_gets_its_graph_again():
    model = HostScaled()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(HOST_SCALE_OP,)))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 8)
    for k in (3, 3, 4, 4, 4):
        torch.testing.assert_close(compiled(x, k), model(x, k), rtol=0, atol=0)
    # 3 piecewise (first), 3 full, 4 piecewise (differs), 4 full (recaptured), 4 full
    assert (backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (2, 3)


class Accumulating(nn.Module):
    """acc (a plain tensor argument, not a buffer) += sin(W x), written by the split op."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, acc):
        torch.ops.cgcompile_testing.silly_accumulate(acc, self.a(x))
        return acc * 2


@torch.no_grad()
def test_an_input_the_split_op_writes_is_checked_by_address():
    """The full graph writes into the tensor it was captured with: a call that passes
    another one must run piecewise, and each call updates its own tensor exactly once."""
    torch.manual_seed(0)
    model = Accumulating()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(ACCUMULATE_OP,)))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 8)
    first, other = torch.zeros(2, 8), torch.zeros(2, 8)
    expected_first, expected_other = torch.zeros(2, 8), torch.zeros(2, 8)
    for acc, expected in ((first, expected_first), (first, expected_first), (other, expected_other),
                          (first, expected_first)):
        out = compiled(x, acc)
        model(x, expected)
        torch.testing.assert_close(acc, expected, rtol=0, atol=0)
        torch.testing.assert_close(out, expected * 2, rtol=0, atol=0)
    assert (backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (2, 2)
    assert backend.stats.piecewise_reasons[HOST_REASON] == 1
    plan = backend.runtimes[0].full.plan
    assert [plan.names[i] for i in plan.by_address] == ["l_acc_"]


@torch.no_grad()
def test_padded_calls_run_piecewise():
    """A full graph would run the split op on the padding rows: only calls whose size is a
    capture size itself take the full path."""
    torch.manual_seed(0)
    model = ToyLlama()
    config = cgcompile.Config(compiler="eager", capturable_split_ops=(SILLY_OP,), splitting_ops=(SILLY_OP,),
                              padding=True, capture_sizes=(2, 4))
    backend = cgcompile.Backend(config)
    compiled = torch.compile(model, backend=backend)
    for n in (4, 4, 3, 4, 2):
        ids = torch.arange(n)
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids))  # padded rows change a matmul's rounding
    assert backend.stats.graphs_seen == 1
    # 4 first, 4 full, 3 padded to 4, 4 full, 2 first of its size
    assert (backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (3, 2)
    assert "padded" in " ".join(backend.stats.piecewise_reasons)


class HostSync(nn.Module):
    def forward(self, x):
        y = F.scaled_dot_product_attention(x, x, x)
        return y * x.sum().item()


@torch._dynamo.config.patch(capture_scalar_outputs=True)  # .item() stays in the graph
def test_a_graph_with_an_uncapturable_node_has_no_full_path(caplog, tmp_path):
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=("attention",),
                                                 dump_dir=str(tmp_path)))
    caplog.set_level(logging.INFO, logger="cgcompile")
    x = torch.randn(1, 2, 4, 8)
    torch.testing.assert_close(torch.compile(HostSync(), backend=backend)(x), HostSync()(x))
    assert all(rt.full is None for rt in backend.runtimes)
    assert any("has no full graph" in r.getMessage() and "host_sync" in r.getMessage() for r in caplog.records)
    summary = (tmp_path / "graph_0" / "summary.txt").read_text()
    assert "piecewise only" in summary and "[host_sync]" in summary


def test_a_split_op_not_declared_keeps_the_graph_piecewise(caplog):
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(HOST_SCALE_OP,)))
    caplog.set_level(logging.INFO, logger="cgcompile")
    x = torch.randn(1, 2, 4, 8)
    compiled = torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x) + 1, backend=backend)
    compiled(x)
    compiled(x)
    assert backend.stats.full_graph_calls == 0
    assert any("not in Config.capturable_split_ops" in r.getMessage() for r in caplog.records)


def test_the_dump_names_what_each_call_is_checked_against(tmp_path):
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(ACCUMULATE_OP,),
                                                 dump_dir=str(tmp_path)))
    torch.compile(Accumulating(), backend=backend)(torch.randn(2, 8), torch.zeros(2, 8))
    summary = (tmp_path / "graph_0" / "summary.txt").read_text()
    assert "full graph per call where these match the capture: ['l_acc_']; it runs the pieces' code" in summary


@pytest.mark.parametrize("entry", ["attention", F.scaled_dot_product_attention, SILLY_OP,
                                   torch.ops.cgcompile_testing.silly_attention])
def test_declaration_accepts_attention_and_ops(entry):
    ops = cgcompile.Config(capturable_split_ops=[entry]).full_graph.capturable_ops
    assert ops.covers(torch.ops.cgcompile_testing.silly_attention.default) == (entry not in ("attention", F.scaled_dot_product_attention))
    assert ops.covers(F.scaled_dot_product_attention) == (entry in ("attention", F.scaled_dot_product_attention))


@pytest.mark.parametrize("entry", ["flash", "nope::nothing", 3])
def test_declaration_refuses_what_is_not_an_op(entry):
    with pytest.raises(cgcompile.ConfigError, match="capturable_split_ops: expected") as error:
        cgcompile.Config(capturable_split_ops=(entry,))
    assert "splitting_ops" not in str(error.value).replace("capturable_split_ops", "")


def interleaved_calls(rounds: int, device: str = "cpu"):
    """(ids, pos) calls that interleave a 4-token prefill, a 1-token and a 3-token decode:
    three static Dynamo graphs, each replayed between the others."""
    calls, position = [], 0
    for r in range(rounds):
        for t in (4, 1, 3):
            ids = (torch.arange(t) * 5 + r) % 64
            calls.append((ids.to(device), torch.arange(position, position + t, device=device)))
            position += t
    return calls


def run_calls(model, calls) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(ids, pos).clone() for ids, pos in calls]


def test_prefill_and_decode_graphs_in_any_order():
    torch.manual_seed(0)
    model = StaticCacheDecoder(max_len=64).eval()
    calls = interleaved_calls(5)
    expected = run_calls(copy.deepcopy(model), calls)
    backend = cgcompile.Backend(FULL)
    got = run_calls(torch.compile(model, backend=backend, dynamic=False), calls)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # Three graphs; each runs its first call piecewise, then the full path.
    assert (backend.stats.graphs_seen, backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (3, 3, 12)


@torch.no_grad()
def test_an_expanded_input_is_checked_by_address_not_copied():
    """A buffer of an expanded input's own layout would share memory between elements,
    so the plan checks such an input by address (here one only capturable code reads)."""
    def step(q, bias):  # q: [1, 2, 4, 8], bias: [1, 2, 4, 8] expanded from [8]
        k = q * 2
        return F.scaled_dot_product_attention(k, k, k) + bias

    backend = cgcompile.Backend(FULL)
    compiled = torch.compile(step, backend=backend)
    q, bias = torch.randn(1, 2, 4, 8), torch.randn(8).expand(1, 2, 4, 8)
    for _ in range(3):
        torch.testing.assert_close(compiled(q, bias), step(q, bias), rtol=0, atol=0)
    plan = backend.runtimes[0].full.plan
    assert [plan.names[i] for i in plan.by_address] == ["l_bias_"]
    assert [plan.names[i] for i in plan.copied] == ["l_q_"]
    assert backend.stats.full_graph_calls == 2


class ReadsFreshInput(nn.Module):
    """The split op reads v, a new tensor every call: the full graph reads a copy of it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, v):
        q = self.a(x)
        return self.a(torch.ops.cgcompile_testing.silly_attention(q, q, v))


def check_fresh_inputs(device: str) -> cgcompile.Backend:
    torch.manual_seed(0)
    model = ReadsFreshInput().to(device)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(SILLY_OP,),
                                                 splitting_ops=(SILLY_OP,)))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        for step in range(5):
            v = torch.full((2, 8), float(step), device=device)  # new values at a new address
            torch.testing.assert_close(compiled(x, v), model(x, v), rtol=0, atol=0)
    plan = backend.runtimes[0].full.plan
    assert [plan.names[i] for i in plan.copied] == ["l_x_", "l_v_"] and not plan.by_address
    assert (backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (1, 4)
    return backend


def test_an_input_the_split_op_only_reads_is_copied():
    check_fresh_inputs("cpu")


@torch.no_grad()
def test_alternating_host_values_do_not_recapture_every_other_call():
    model = HostScaled()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(HOST_SCALE_OP,)))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 8)
    for k in (3, 3, 5, 3, 5, 3, 5):
        torch.testing.assert_close(compiled(x, k), model(x, k), rtol=0, atol=0)
    # 3 first, 3 captured; then every 3 replays and every 5 runs piecewise
    assert (backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (4, 3)


@torch.no_grad()
def test_after_parameters_move_and_settle_the_full_graph_is_captured_at_once():
    """A parameter replaced for good (as the tensors of a new static cache are, at every
    generate() through its own compile): the first call with it runs without graphs, and
    the next, where the watch finds it settled, captures the full graph directly, not the
    pieces first. The parameter watch is set up by hand here: without CUDA the backend
    makes none."""
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    reference = copy.deepcopy(model)
    backend = cgcompile.Backend(FULL)
    compiled = torch.compile(model, backend=backend)
    for m in (compiled, reference):  # prefill and two decode steps: the same cache writes in both
        decode_steps(m, 2)
    runtime = backend.runtimes[-1]  # the decode graph's
    names = list(runtime.full.plan.names)
    index = next(i for i, name in enumerate(names) if "lm_head" in name)
    runtime.addresses = ParameterAddresses("graph1", [index], [names[index]], runtime._recapture)

    def step(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([s % 7]), torch.tensor([4 + s])  # after decode_steps' prompt of 4

    for m in (compiled, reference):  # the watch takes the addresses
        m(*step(0))
    reasons_before, full_before = dict(runtime.full.reasons), runtime.full.calls["full"]
    for m in (model, reference):
        m.lm_head.weight = nn.Parameter(m.lm_head.weight.detach().clone() * 2)
    for s in range(1, 5):
        torch.testing.assert_close(compiled(*step(s)), reference(*step(s)), rtol=0, atol=0)
    new_reasons = {k: v - reasons_before.get(k, 0) for k, v in runtime.full.reasons.items()}
    assert {k: v for k, v in new_reasons.items() if v} == {"its parameters are not where its graphs read them": 1}
    assert runtime.full.calls["full"] - full_before == 3  # captured at the settled call, then replayed
    assert runtime.addresses.recaptures == 1


@torch.no_grad()
def test_an_input_with_a_dynamic_length_is_copied_not_checked_by_address():
    """A mask whose length is a dynamic size has a symbolic row stride: still one element
    per address, so it is copied like any input (it used to be checked by address, and a
    mask made anew each step then kept every call piecewise). Its length is a host value."""
    def step(q, mask):  # q: [1, 2, 4, 8], mask: [1, L]
        k = q * 2
        return F.scaled_dot_product_attention(k, k, k) + mask.float().sum()

    backend = cgcompile.Backend(FULL)
    compiled = torch.compile(step, backend=backend)
    q = torch.randn(1, 2, 4, 8)
    for length in (6, 7, 7, 7, 8):
        mask = torch.ones(1, length, dtype=torch.long)  # new at every call
        torch._dynamo.mark_dynamic(mask, 1)
        torch.testing.assert_close(compiled(q, mask), step(q, mask), rtol=0, atol=0)
    plan = backend.runtimes[-1].full.plan
    assert "l_mask_" in [plan.names[i] for i in plan.copied] and not plan.by_address
    # 7, 7, 7: the second call captures, the third replays; each new length runs piecewise
    assert backend.stats.full_graph_calls == 2
    assert backend.stats.piecewise_reasons[HOST_REASON] == 2


# -- Config.full_graph_compile: the whole Dynamo graph compiled as one for full graphs ------

WHOLE = cgcompile.Config(compiler="inductor", capturable_split_ops=("attention",), full_graph_compile=True)


@torch.no_grad()
def test_full_graph_compile_runs_the_whole_graph_compiled_once_per_size():
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    eager = decode_steps(copy.deepcopy(model), 6)
    backend = cgcompile.Backend(WHOLE)
    got = decode_steps(torch.compile(model, backend=backend, dynamic=False), 6)
    for step, (g, e) in enumerate(zip(got, eager)):  # the cache writes happen once per call, in both
        torch.testing.assert_close(g, e, msg=lambda m: f"call {step}: {m}")
    stats = backend.stats
    assert (stats.piecewise_calls, stats.full_graph_calls) == (2, 5)
    # Only the decode graph captured (the prefill ran once): one whole-graph compile.
    assert stats.full_graph_compilations == 1 and stats.full_graph_compile_s > 0
    full = backend.runtimes[-1].full
    (entry,) = full.graphs.values()
    assert entry.code is not full.code.pieces


def _counting_compile(monkeypatch) -> list:
    """Replace Inductor in the whole-graph compile with the graph's own FX code, counted."""
    compiled = []

    def compile_as_fx(gm, args, options, cudnn_attention):
        compiled.append([a for a in args if not isinstance(a, torch.Tensor)])
        return lambda *a: gm(*a)

    monkeypatch.setattr("cgcompile.build.compiler.compile_at_shapes", compile_as_fx)
    return compiled


@torch.no_grad()
def test_full_graph_compile_is_keyed_on_the_host_values_and_bounded(monkeypatch):
    """k is a symbol: a compile at k=3 bakes 3 in, so k=4 gets its own compile; after
    `limit` compiles, a further k captures the pieces' code (still right)."""
    compiled = _counting_compile(monkeypatch)
    model = HostScaled()
    config = cgcompile.Config(compiler="inductor", capturable_split_ops=(HOST_SCALE_OP,), full_graph_compile=True)
    backend = cgcompile.Backend(config)
    compiled_model = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 8)
    for k in (3, 3, 4, 4, 3, 3, 5, 5, 6, 6, 7, 7):
        torch.testing.assert_close(compiled_model(x, k), model(x, k))
    # Each compile's int inputs end with k: 3 again reuses its compile; 7 is over the limit of 4.
    assert [ints[-1] for ints in compiled] == [3, 4, 5, 6]
    full = backend.runtimes[0].full
    assert full.graphs[2].code is full.code.pieces and full.graphs[2].key[2] == [7]
    assert backend.stats.full_graph_compilations == 4


@torch.no_grad()
def test_a_failed_whole_graph_compile_captures_the_pieces_code(monkeypatch, caplog):
    def fail(gm, args, options, cudnn_attention):
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr("cgcompile.build.compiler.compile_at_shapes", fail)  # the pieces' compiles still work
    caplog.set_level(logging.WARNING, logger="cgcompile")
    torch.manual_seed(0)
    model = StaticCacheDecoder().eval()
    eager = decode_steps(copy.deepcopy(model), 4)
    backend = cgcompile.Backend(WHOLE)
    got = decode_steps(torch.compile(model, backend=backend, dynamic=False), 4)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e)
    assert backend.stats.full_graph_calls == 3 and backend.stats.full_graph_compilations == 0
    assert any("compiling graph1 as one graph failed (RuntimeError: no lowering for this op)" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@torch.no_grad()
def test_full_graph_compile_beside_eager_pieces_is_the_only_compile(monkeypatch):
    """compiler="eager": the pieces stay FX code and the whole-graph compile is the one
    compile made, at the first capture of the decode size."""
    compiled = []  # every Inductor compile of the backend: pieces, sizes and whole graphs

    def compile_as_fx(gm, args, options):
        compiled.append(gm)
        return lambda *a: gm(*a)

    monkeypatch.setattr("cgcompile.build.compiler.inductor_compile", compile_as_fx)
    model = StaticCacheDecoder().eval()
    eager = decode_steps(copy.deepcopy(model), 4)
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=("attention",),
                                                 full_graph_compile=True))
    got = decode_steps(torch.compile(model, backend=backend, dynamic=False), 4)
    for step, (g, e) in enumerate(zip(got, eager)):
        torch.testing.assert_close(g, e, msg=lambda m: f"call {step}: {m}")
    full = backend.runtimes[-1].full
    assert backend.stats.full_graph_calls == 3 and len(compiled) == 1 and compiled[0] is full.code.gm
    (entry,) = full.graphs.values()
    assert entry.code is not full.code.pieces


# ---- CUDA: the full graphs are real CUDA graphs ----

def decode_calls(tokens_per_step: int, steps: int):
    """A 4-token prefill, then `steps` steps of `tokens_per_step` tokens each (on CUDA)."""
    calls = [(torch.arange(4, device="cuda") + 1, torch.arange(4, device="cuda"))]
    for s in range(steps):
        start = 4 + s * tokens_per_step
        ids = (torch.arange(tokens_per_step, device="cuda") * 3 + s) % 64
        calls.append((ids, torch.arange(start, start + tokens_per_step, device="cuda")))
    return calls


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("compiler", ["eager", "inductor", "inductor-whole", "inductor-small-query",
                                      "inductor-whole-small-query", "eager-whole-small-query"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_full_graph_decode_equals_eager_over_64_steps(compiler, tokens):
    torch.manual_seed(0)
    model = StaticCacheDecoder(max_len=4 + 64 * tokens).cuda().eval()
    calls = decode_calls(tokens, 64)
    expected = run_calls(copy.deepcopy(model), calls)
    whole = "-whole" in compiler  # the full graph is the whole step compiled as one
    small_query = compiler.endswith("small-query")  # its attention compiled as batched matmuls
    config = cgcompile.Config(compiler=compiler.split("-")[0], capturable_split_ops=("attention",),
                              full_graph_compile=whole, small_query_attention=small_query)
    backend = cgcompile.Backend(config)
    got = run_calls(torch.compile(model, backend=backend, dynamic=False), calls)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"call {step}: {m}")
    stats = backend.stats
    # The prefill once and the first decode step run piecewise; the second decode step
    # captures the full graph and every later one replays it.
    assert (stats.piecewise_calls, stats.full_graph_calls) == (2, 63), stats
    assert any(rt.full is not None and rt.full.graphs for rt in backend.runtimes)
    assert stats.full_graph_compilations == (1 if whole or small_query else 0)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_the_default_backend_decodes_a_static_cache_from_full_graphs():
    """backend="cgcompile" with no options: full graphs chosen automatically, attention
    lowered by Inductor, every call equal to eager's."""
    torch.manual_seed(0)
    model = StaticCacheDecoder(max_len=4 + 64).cuda().eval()
    calls = decode_calls(1, 64)
    expected = run_calls(copy.deepcopy(model), calls)
    compiled = torch.compile(model, backend="cgcompile", dynamic=False)
    got = run_calls(compiled, calls)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"call {step}: {m}")
    stats = cgcompile.backend_of(compiled).stats
    assert stats.full_graph_choices == {phases.CHOSEN_AUTOMATICALLY: 2}  # prefill and decode
    assert (stats.piecewise_calls, stats.full_graph_calls) == (2, 63), stats
    assert stats.full_graph_compilations == 1  # the decode attention piece, lowered (one compile for the layers)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_prefill_and_decode_full_graphs_in_any_order_on_cuda():
    torch.manual_seed(0)
    model = StaticCacheDecoder(max_len=128).cuda().eval()
    calls = interleaved_calls(12, "cuda")
    expected = run_calls(copy.deepcopy(model), calls)
    backend = cgcompile.Backend(FULL)
    got = run_calls(torch.compile(model, backend=backend, dynamic=False), calls)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"call {step}: {m}")
    assert (backend.stats.piecewise_calls, backend.stats.full_graph_calls) == (3, 33)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@torch.no_grad()
def test_a_changed_host_value_never_replays_the_stale_graph():
    """The full graph captured at k=3 would return 3x for a call with k=5 (shown by
    replaying it by hand); cgcompile runs that call piecewise and returns 5x."""
    torch.manual_seed(0)
    model = HostScaled().cuda()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=(HOST_SCALE_OP,)))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 8, device="cuda")
    for k in (3, 3, 3):
        torch.testing.assert_close(compiled(x, k), model(x, k))
    assert backend.stats.full_graph_calls == 2 and backend.stats.graphs_captured >= 1
    got = compiled(x, 5)
    torch.testing.assert_close(got, model(x, 5))
    assert backend.stats.piecewise_reasons[HOST_REASON] == 1
    full = backend.runtimes[0].full
    (entry,) = full.graphs.values()
    for _, static in entry.inputs:  # the piecewise call may have reused the input buffer's memory
        static.buffer.copy_(x)
    entry.graph.replay()  # what replaying the full graph for k=5 would have returned
    stale = entry.outputs[0].clone()
    torch.testing.assert_close(stale, model(x, 3))
    assert not torch.allclose(stale, got)
    torch.testing.assert_close(compiled(x, 3), model(x, 3))  # k back at 3: the full graph again
    assert backend.stats.full_graph_calls == 3


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_an_input_the_split_op_only_reads_is_copied_on_cuda():
    """v is new at every call and read by the captured split op: each replay copies it
    into the graph's buffer first, so every call sees its own values."""
    backend = check_fresh_inputs("cuda")
    assert backend.stats.graphs_captured > 0
