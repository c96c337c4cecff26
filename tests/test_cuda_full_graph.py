"""Full CUDA graphs beside piecewise ones, chosen per call. GPU machine only.

The CPU tier (test_full_graph.py, test_hf_full_graph.py) checks the choice; here the
full graphs are real CUDA graphs: they replay the whole step, split ops included, and
must give eager's results, and a call whose host-side value changed must not replay.
"""

import copy

import pytest
import torch

import cgcompile
from cgcompile.testing.models import HOST_SCALE_OP, StaticCacheDecoder
from test_full_graph import FULL, HOST_REASON, HostScaled, check_fresh_inputs, interleaved_calls, run_calls
from test_hf_full_graph import NEW_TOKENS, check_decode_graph_calls, generate, tiny_llama

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would make eager and graphs differ in rounding
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def decode_calls(tokens_per_step: int, steps: int):
    """A 4-token prefill, then `steps` steps of `tokens_per_step` tokens each (on CUDA)."""
    calls = [(torch.arange(4, device="cuda") + 1, torch.arange(4, device="cuda"))]
    for s in range(steps):
        start = 4 + s * tokens_per_step
        ids = (torch.arange(tokens_per_step, device="cuda") * 3 + s) % 64
        calls.append((ids, torch.arange(start, start + tokens_per_step, device="cuda")))
    return calls


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


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_hf_static_cache_generate_from_full_graphs(batch, whole):
    expected = generate(tiny_llama().cuda(), batch, cache_implementation="static")
    model = tiny_llama().cuda()
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), full_graph_compile=whole))
    model.forward = torch.compile(model.forward, backend=backend)
    for _ in range(2):
        torch.testing.assert_close(generate(model, batch, cache_implementation="static"), expected, rtol=0, atol=0)
    check_decode_graph_calls(backend)
    assert backend.stats.graphs_captured > 0


@pytest.mark.parametrize("compiler, whole", [("inductor", False), ("eager", True)])
def test_hf_generate_compiles_its_decode_step_with_cgcompile(compiler, whole):
    """generate()'s own compile (compile_config) with a cgcompile Backend: the prefill runs
    eagerly, the decode step from full graphs. Its static cache marks its tensors static, so
    a cache at a new address (a new generate()) is seen by the parameter check: one call
    without graphs, one piecewise, then a new capture."""
    from transformers import CompileConfig

    expected = generate(tiny_llama().cuda(), 3, cache_implementation="static")
    model = tiny_llama().cuda()
    backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, capturable_split_ops=("attention",),
                                                 full_graph_compile=whole, small_query_attention=whole))
    prompt = (torch.arange(15, device="cuda").view(3, 5) * 7 + 1) % 128
    for _ in range(2):
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                             compile_config=CompileConfig(backend=backend, mode=None))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    stats = backend.stats
    assert stats.graphs_seen == 1 and stats.graphs_captured > 0
    assert stats.full_graph_calls + stats.piecewise_calls == 2 * (NEW_TOKENS - 1)
    assert stats.piecewise_calls <= 3, stats.piecewise_reasons
    assert stats.full_graph_compilations == (1 if whole else 0)


def test_hf_dynamic_cache_stays_piecewise_on_cuda():
    expected = generate(tiny_llama().cuda(), 1)
    model = tiny_llama().cuda()
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",)))
    model.forward = torch.compile(model.forward, backend=backend)
    torch.testing.assert_close(generate(model, 1), expected, rtol=0, atol=0)
    # Graphs whose plan allows a full path count their calls; none may take it.
    assert backend.stats.full_graph_calls == 0 and backend.stats.piecewise_calls > 0


def test_an_input_the_split_op_only_reads_is_copied_on_cuda():
    """v is new at every call and read by the captured split op: each replay copies it
    into the graph's buffer first, so every call sees its own values."""
    backend = check_fresh_inputs("cuda")
    assert backend.stats.graphs_captured > 0
