"""Config.fuse_sibling_linears with CUDA graphs: piecewise and full graphs read the fused
copies, and a parameter update reaches graphs already captured. GPU machine only."""

import pytest
import torch

import cgcompile

from test_hf_full_graph import generate as static_generate
from test_hf_generate import compile_and_match_eager, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("exact_fp32_matmuls"),
]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("arch, batch", [("llama", 1), ("qwen2", 3)])
def test_fp32_greedy_tokens_equal_eager(arch, batch, compiler):
    model = tiny_model(arch).cuda()
    stats = compile_and_match_eager(model, batch, fuse_sibling_linears=True, compiler=compiler).stats
    assert stats.fused_linears == 5 * model.config.num_hidden_layers * stats.graphs_seen
    assert stats.graphs_captured == stats.capturable_pieces > 0


def test_full_graph_sees_a_weight_update_after_capture():
    """Static cache: decode replays one full graph; an in-place update of a fused
    parameter between generate() calls is copied into the fused weight before the replay."""
    model = tiny_model("llama").cuda()
    eager = tiny_model("llama").cuda()
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), fuse_sibling_linears=True))
    model.forward = torch.compile(model.forward, backend=backend)
    before = static_generate(eager, 2, cache_implementation="static")
    assert torch.equal(static_generate(model, 2, cache_implementation="static"), before)
    with torch.no_grad():
        for m in (model, eager):
            m.model.layers[0].self_attn.k_proj.weight.mul_(-1.5)
            m.model.layers[1].mlp.up_proj.weight.add_(0.1)
    after = static_generate(eager, 2, cache_implementation="static")
    assert not torch.equal(after, before)  # the update matters to the tokens
    assert torch.equal(static_generate(model, 2, cache_implementation="static"), after)
    stats = backend.stats
    assert stats.full_graph_calls > 0 and stats.fused_weight_refreshes >= 1
