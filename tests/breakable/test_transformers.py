"""Hugging Face generate() on breakable graphs: on the CPU (segments="op_replay"), and on CUDA.

The integration (cgcompile/breakable/transformers.py) gives each decoder layer a
breakable graph with the cache update and attention as eager steps. With op_replay the
layers replay their recorded ops at the tensors they were recorded with, as CUDA graphs
would, so tokens equal to eager's here mean the breaks, the live inputs (mask, position
ids, the cache object) and the signature rule are right. The CUDA tests (marked `cuda`, at the
end) check the same with CUDA graphs: each decoder layer replays two graph segments around the
eager cache update and attention, in fp32 with TF32 off, so replays and eager run the same kernels.
"""

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import DynamicCache, cache_utils, modeling_utils

import cgcompile
from cgcompile.breakable.record import EagerStep
from cgcompile.breakable.integrations import integration_for
from cgcompile.testing.models import ToyLlama
from cgcompile.testing.hf_models import ARCHS, tiny_model

NEW_TOKENS = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def breakable(model, **kw):
    return cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True), segments="op_replay", **kw)


def generate(model, ids, mask, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=seed is not None, **kw)


def batch_prompt(batch: int):
    """Random ids [B, 7] and their mask, left-padded: row i has min(i, 3) pad tokens."""
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (batch, 7))
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :min(row, 3)] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_eager(arch, batch):
    model = tiny_model(arch)
    ids, mask = batch_prompt(batch)
    expected = generate(model, ids, mask)
    manager = breakable(model)
    with manager.install():
        first, second = generate(model, ids, mask), generate(model, ids, mask)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    runners = manager.breakable.runners
    assert len(runners) == model.config.num_hidden_layers == 2
    assert all(runner.graph_count() == 1 for runner in runners)  # one decode graph per layer; prefill eager
    for runner in runners:  # two segments around the cache update and attention
        ((entry,),) = runner.graphs.values()
        assert [type(s).__name__ for s in entry.steps] == ["SegmentStep", "EagerStep", "EagerStep", "SegmentStep"]
        assert [s.label for s in entry.steps if isinstance(s, EagerStep)] == ["DynamicCache.update",
                                                                              "attention (sdpa)"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("batch", [1, 8])
def test_sampled_tokens_equal_eager(arch, batch):
    model = tiny_model(arch)
    ids, mask = batch_prompt(batch)
    expected = [generate(model, ids, mask, seed=s) for s in (1, 2)]
    with breakable(model).install():
        got = [generate(model, ids, mask, seed=s) for s in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def snapshot(model) -> dict:
    """What must be as it was after the manager: transformers' hooks and the model's forwards."""
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    return {
        "local attention overrides": dict(interface._local_mapping),
        "global attention functions": dict(type(interface)._global_mapping),
        "Cache functions": {k: v for k, v in vars(cache_utils.Cache).items() if callable(v)},
        "DynamicCache functions": {k: v for k, v in vars(DynamicCache).items() if callable(v)},
        "instance forwards": [name for name, m in model.named_modules() if "forward" in vars(m)],
    }


def test_hooks_are_installed_only_while_recording_and_leave_everything_as_it_was():
    model = tiny_model("llama")
    ids, mask = batch_prompt(2)
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    mine = interface["sdpa"]
    interface["sdpa"] = mine  # a local override someone else made: it must survive
    try:
        before = snapshot(model)
        manager = breakable(model)
        manager.install()
        installed = snapshot(model)
        generate(model, ids, mask)
        generate(model, ids, mask)
        manager.uninstall()
        after = snapshot(model)
    finally:
        del interface["sdpa"]
    assert installed["instance forwards"] == [f"model.layers.{i}" for i in range(2)]
    assert {k: v for k, v in installed.items() if k != "instance forwards"} == \
        {k: v for k, v in before.items() if k != "instance forwards"}  # hooks only while recording
    assert after == before
    assert interface["sdpa"] is interface._global_mapping["sdpa"]


def test_a_hook_observing_a_layer_gets_a_copy_of_its_output():
    model = tiny_model("llama")
    ids, mask = batch_prompt(2)
    kw = dict(output_hidden_states=True, return_dict_in_generate=True)
    expected = generate(model, ids, mask, **kw).hidden_states
    with breakable(model).install():
        got = generate(model, ids, mask, **kw).hidden_states
    assert len(got) == len(expected) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(got, expected)):  # every step's states survive the steps after it
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step


def decode_through_the_manager(model, manager, steps: int, before_step=lambda step: None) -> None:
    """Prefill and greedy decode through run_pw_graph with a DynamicCache, each call's
    logits compared with the eager model's on a cache of its own."""
    ids = torch.randint(3, 128, (1, 6))
    cache, reference_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for step in range(steps):
        before_step(step)
        out = manager.run_pw_graph(model, {"input_ids": ids, "past_key_values": cache, "use_cache": True})
        ref = model(input_ids=ids, past_key_values=reference_cache, use_cache=True)
        assert torch.equal(out.logits, ref.logits), f"step {step}"
        ids = ref.logits[:, -1:].argmax(-1)


def test_the_issue_loop_run_pw_graph_with_a_dynamic_cache():
    # The call that failed in issue 15: decode after prefill, through run_pw_graph, no install.
    model = tiny_model("llama")
    manager = breakable(model)
    decode_through_the_manager(model, manager, 6)
    assert "forward" not in vars(model.model.layers[0])  # installed for each call only
    assert manager.breakable.graph_count() == 2


def test_a_layer_captured_after_the_next_one_still_feeds_it_fresh_values():
    # Layer 1 copies layer 0's output into its own buffer when layer 0's graph is newer than
    # its own; each later replay must copy again (a replay rewrites the output in place).
    model = tiny_model("llama")
    manager = breakable(model)

    def drop_layer_0(step):
        if step == 4:
            manager.breakable.runners[0].clear()  # layer 0 captures again; layer 1 keeps its graph

    decode_through_the_manager(model, manager, 9, drop_layer_0)
    assert [runner.graph_count() for runner in manager.breakable.runners] == [1, 1]  # decode


def test_a_new_state_dict_in_new_tensors_is_never_replayed_stale():
    # One runner per decoder layer: the first that notices moved weights drops the graphs of all.
    model, donor = tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(torch.randn_like(p))
    manager = breakable(model)
    ids, mask = batch_prompt(2)
    with manager:
        generate(model, ids, mask)
        assert manager.breakable.graph_count() > 0
        model.load_state_dict(donor.state_dict(), assign=True)  # new tensors, new addresses
        tokens = [generate(model, ids, mask) for _ in range(2)]
    expected = generate(donor, ids, mask)
    assert all(torch.equal(t, expected) for t in tokens)
    assert manager.breakable.graph_count() > 0  # captured again
    assert sum(r.addresses.recaptures for r in manager.breakable.runners) >= 1


def test_describe_shows_the_layers_once_with_their_eager_steps():
    model = tiny_model("llama")
    manager = breakable(model)
    ids, mask = batch_prompt(1)
    with manager:
        generate(model, ids, mask)
    text = manager.breakable.describe()
    layers = len(model.model.layers)
    assert text.startswith(f"runners 0-{layers - 1} ({layers}): LlamaDecoderLayer x{layers}: 1 graph")
    assert "eager step: DynamicCache.update" in text and "eager step: attention (sdpa)" in text


def test_capturing_the_whole_stack_finds_decode_uncapturable_and_stays_correct(caplog):
    # The stack's forward reads the cache length to build positions and masks: a graph
    # would freeze them. The integration's guard sees the read and keeps those calls eager.
    model = tiny_model("llama")
    ids, mask = batch_prompt(1)
    expected = generate(model, ids, mask)
    manager = breakable(model, boundary=None)
    with caplog.at_level(logging.WARNING, logger="cgcompile"), manager.install():
        assert torch.equal(generate(model, ids, mask), expected)
        assert torch.equal(generate(model, ids, mask), expected)
    assert manager.breakable.graph_count() == 0
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "no list of layers" in warnings and "host code read DynamicCache.get_seq_length()" in warnings


def test_eager_attention_is_not_hookable_decode_runs_eagerly(caplog):
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    ids, mask = batch_prompt(2)
    expected = generate(model, ids, mask)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        manager = breakable(model)
        with manager.install():
            assert torch.equal(generate(model, ids, mask), expected)
    assert manager.breakable.graph_count() == 0
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "attn_implementation='sdpa'" in warnings and "whose shape changes from call to call" in warnings


def test_the_manager_routes_generate_through_the_chosen_path(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv("CGCOMPILE_USE_BREAKABLE", "1")
    manager = cgcompile.GraphManager(model, segments="op_replay")  # the environment chose breakable graphs
    assert manager.use_breakable and manager.install() is manager and manager.installed
    assert all("forward" in vars(layer) for layer in model.model.layers)
    manager.uninstall()
    assert not any("forward" in vars(m) for m in model.modules())
    monkeypatch.setenv("CGCOMPILE_USE_BREAKABLE", "0")
    compiled = cgcompile.GraphManager(model)  # compiled pieces; on the CPU graphs are off: install changes nothing
    assert not compiled.use_breakable and not compiled.graphs_enabled
    with compiled.install():
        assert not any("forward" in vars(m) for m in model.modules())


def test_integrations_import_nothing_and_only_match_their_framework():
    assert integration_for(ToyLlama(1)) is None
    assert integration_for(tiny_model("gpt2")).__name__ == "cgcompile.breakable.transformers"
    code = ("import sys, cgcompile\nimport torch\nfrom cgcompile.testing.models import ToyLlama\n"
            "m = cgcompile.GraphManager(ToyLlama(1), cgcompile.Config(use_breakable=True), segments='op_replay')\n"
            "m.run_pw_graph(m.model, (torch.zeros(3, dtype=torch.long),))\n"
            "print('transformers' in sys.modules, 'cgcompile.breakable.transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr[-2000:]


# ---- CUDA: breakable CUDA graphs, no compilation ----

def cuda_prompt(batch: int):
    ids, mask = batch_prompt(batch)
    return ids.cuda(), mask.cuda()


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_equal_eager_with_breakable_graphs(arch, batch):
    model = tiny_model(arch, device="cuda")
    ids, mask = cuda_prompt(batch)
    expected = generate(model, ids, mask)
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True))
    assert manager.graphs_enabled and manager.use_breakable
    with manager.install():
        first, second = generate(model, ids, mask), generate(model, ids, mask)  # capture, then replays only
    assert torch.equal(first, expected), (first, expected)
    assert torch.equal(second, expected), (second, expected)
    runners = manager.breakable.runners
    assert len(runners) == 2 and all(runner.graph_count() == 1 for runner in runners)
    for runner in runners:  # two graph segments around the cache update and attention
        ((entry,),) = runner.graphs.values()
        assert [type(s).__name__ for s in entry.steps] == ["SegmentStep", "EagerStep", "EagerStep", "SegmentStep"]
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp32_sampled_tokens_equal_eager_with_breakable_graphs(arch):
    model = tiny_model(arch, device="cuda")
    ids, mask = cuda_prompt(3)
    expected = [generate(model, ids, mask, seed=s) for s in (1, 2)]
    with cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True)).install():
        got = [generate(model, ids, mask, seed=s) for s in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_long_generation_stays_equal_to_eager():
    # 200 decode steps replay the same graphs while the cache grows past every capture-time length.
    model = tiny_model("llama", device="cuda")
    ids, mask = cuda_prompt(2)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False)
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True))
    with manager.install():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False)
    assert torch.equal(got, expected)
    assert manager.breakable.graph_count() == 2


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_a_new_state_dict_in_new_tensors_is_never_replayed_stale_on_cuda():
    model, donor = tiny_model("llama", device="cuda"), tiny_model("llama", device="cuda")
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(torch.randn_like(p))
    ids, mask = cuda_prompt(2)
    expected = generate(donor, ids, mask)
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True))
    with manager.install():
        generate(model, ids, mask)
        model.load_state_dict(donor.state_dict(), assign=True)  # new tensors, new addresses
        got = [generate(model, ids, mask) for _ in range(2)]
    assert all(torch.equal(g, expected) for g in got)
    assert manager.breakable.graph_count() > 0
    assert sum(runner.addresses.recaptures for runner in manager.breakable.runners) >= 1


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_a_hook_observing_a_layer_gets_a_copy_of_its_output_on_cuda():
    model = tiny_model("qwen2", device="cuda")
    ids, mask = cuda_prompt(2)
    kw = dict(output_hidden_states=True, return_dict_in_generate=True)
    expected = generate(model, ids, mask, **kw).hidden_states
    with cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True)).install():
        got = generate(model, ids, mask, **kw).hidden_states
    assert len(got) == NEW_TOKENS
    for a, b in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class State:
    k = None


@cgcompile.eager_break
def grow(x, state):
    state.k = x if state.k is None else torch.cat([state.k, x], 1)
    return state.k  # [B, L]: the cache itself, which a captured op then reads


class Growing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 1)
        self.state = State()

    def forward(self, x):  # x: [B, 16]
        return x * grow(self.a(x), self.state).mean(1, keepdim=True)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_a_captured_op_whose_input_shape_changed_raises():
    model = Growing().cuda()
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True, capture_sizes=(4,)), boundary=None)
    for _ in range(2):  # observe, capture
        manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),))
    with pytest.raises(cgcompile.CaptureError, match=r"eager step grow: expected a result of shape \(4, 2\), as at "
                                                     r"capture \(a captured op reads it.*got \(4, 3\)"):
        manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),))

