"""Hugging Face generate() on breakable CUDA graphs, no compilation. GPU machine only.

The models, prompts and checks of test_breakable_hf.py (CPU, segments="op_replay"), here
with CUDA graphs: each decoder layer replays two graph segments around the eager cache
update and attention. fp32 with TF32 off, so replays and eager run the same kernels.
"""

import pytest
import torch
from torch import nn

import cgcompile

from test_breakable_hf import NEW_TOKENS, batch_prompt, generate
from test_hf_generate import ARCHS, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("exact_fp32_matmuls"),
]




def cuda_model(arch: str):
    return tiny_model(arch).to("cuda", torch.float32)


def cuda_prompt(batch: int):
    ids, mask = batch_prompt(batch)
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_tokens_equal_eager_with_breakable_graphs(arch, batch):
    model = cuda_model(arch)
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


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp32_sampled_tokens_equal_eager_with_breakable_graphs(arch):
    model = cuda_model(arch)
    ids, mask = cuda_prompt(3)
    expected = [generate(model, ids, mask, seed=s) for s in (1, 2)]
    with cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True)).install():
        got = [generate(model, ids, mask, seed=s) for s in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_long_generation_stays_equal_to_eager():
    # 200 decode steps replay the same graphs while the cache grows past every capture-time length.
    model = cuda_model("llama")
    ids, mask = cuda_prompt(2)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False)
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True))
    with manager.install():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False)
    assert torch.equal(got, expected)
    assert manager.breakable.graph_count() == 2


def test_a_new_state_dict_in_new_tensors_is_never_replayed_stale():
    model, donor = cuda_model("llama"), cuda_model("llama")
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


def test_a_hook_observing_a_layer_gets_a_copy_of_its_output():
    model = cuda_model("qwen2")
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


def test_a_captured_op_whose_input_shape_changed_raises():
    model = Growing().cuda()
    manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True, capture_sizes=(4,)), boundary=None)
    for _ in range(2):  # observe, capture
        manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),))
    with pytest.raises(cgcompile.CaptureError, match=r"eager step grow: expected a result of shape \(4, 2\), as at "
                                                     r"capture \(a captured op reads it.*got \(4, 3\)"):
        manager.run_pw_graph(model, (torch.randn(4, 16, device="cuda"),))
