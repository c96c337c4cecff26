"""Hugging Face generate() with full graphs where the cache allows them (CPU).

With transformers' static cache (`cache_implementation="static"`) one decode step is
one Dynamo graph whose host-side inputs stay put from step to step: the cache tensors
live at fixed addresses and its length is a device tensor (`cumulative_length`), so
every step after the first of each generate() replays the full graph. With the default
DynamicCache the cache grows (new tensors, a new length symbol every step), so every
step runs piecewise. The CUDA tests (marked `cuda`, at the end) check the same with CUDA graphs.
"""

import pytest
import torch

import cgcompile
from cgcompile.kernels.decode_attention import grouped_attention_with_kernel
from cgcompile.testing.hf_models import FIXED_NEW_TOKENS, fixed_length_generate, tiny_llama


def check_decode_graph_calls(backend) -> None:
    """Two generate() calls of FIXED_NEW_TOKENS: the decode graph (the last Dynamo graph) runs
    piecewise on the first step of the first call (nothing captured yet) and on the first
    step of the second, whose new cache lies at a new address; every other step replays
    the full graph."""
    decode = backend.runtimes[-1].full
    assert decode is not None
    assert decode.calls["full"] + decode.calls["piecewise"] == 2 * (FIXED_NEW_TOKENS - 1)
    assert decode.calls["piecewise"] <= 2, dict(decode.calls)


def compiled_llama(**fields):
    model = tiny_llama()
    fields = {"compiler": "eager", **fields}
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), **fields))
    model.forward = torch.compile(model.forward, backend=backend)
    return model, backend


@pytest.mark.parametrize("batch", [1, 3])
def test_static_cache_decodes_from_the_full_path(batch):
    expected = fixed_length_generate(tiny_llama(), batch, cache_implementation="static")
    model, backend = compiled_llama()
    for _ in range(2):  # the second generate() reuses the cache generate() keeps
        got = fixed_length_generate(model, batch, cache_implementation="static")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert backend.stats.graphs_seen == 2  # prefill, decode
    check_decode_graph_calls(backend)
    assert set(backend.stats.piecewise_reasons) <= {"first call of its size",
                                                    "a host-side input differs from the captured one"}


@pytest.mark.parametrize("whole, small_query, compiler", [(True, False, "inductor"), (True, True, "inductor"),
                                                         (False, True, "inductor"), (True, True, "eager")])
def test_static_cache_decodes_from_compiled_full_graphs(whole, small_query, compiler):
    """whole: the whole graph compiled as one (with compiler="eager", the only compile);
    small_query alone: the eager attention pieces compiled for the full graph, lowered
    (one compile shared by the layers)."""
    expected = fixed_length_generate(tiny_llama(), 2, cache_implementation="static")
    model, backend = compiled_llama(compiler=compiler, full_graph_compile=whole, small_query_attention=small_query)
    for _ in range(2):
        got = fixed_length_generate(model, 2, cache_implementation="static")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    check_decode_graph_calls(backend)
    # One compile of the decode graph; the second generate()'s new cache address recaptures
    # the same size and symbol values, so it reuses that compile.
    assert backend.stats.full_graph_compilations == 1
    if small_query and whole:  # each layer's attention, folded by grouped_query, then lowered
        # to the decode attention kernel's form (Config.decode_attention_kernel), which runs
        # the matmuls on the CPU
        lowered = [n for n in backend.runtimes[-1].full.code.gm.graph.nodes
                   if n.target is grouped_attention_with_kernel]
        assert len(lowered) == model.config.num_hidden_layers


def test_dynamic_cache_stays_piecewise():
    expected = fixed_length_generate(tiny_llama(), 1)
    model, backend = compiled_llama()
    torch.testing.assert_close(fixed_length_generate(model, 1), expected, rtol=0, atol=0)
    stats = backend.stats
    assert stats.full_graph_calls == 0
    assert stats.piecewise_calls == FIXED_NEW_TOKENS


def test_generate_compiles_its_decode_step_with_cgcompile():
    """transformers' own compile of a static cache's decode step (generate()'s
    compile_config) with a cgcompile Backend: the prefill runs eagerly, so only the decode
    graph is compiled. generate() deep-copies its config at every call; the Backend is
    shared, not copied, so both calls land in one backend."""
    from transformers import CompileConfig

    expected = fixed_length_generate(tiny_llama(), 2, cache_implementation="static")
    model = tiny_llama()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=("attention",)))
    compile_config = CompileConfig(backend=backend, mode=None)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told (its testing flag)
    prompt = (torch.arange(10).view(2, 5) * 7 + 1) % 128
    for _ in range(2):
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=FIXED_NEW_TOKENS,
                             min_new_tokens=FIXED_NEW_TOKENS, do_sample=False, cache_implementation="static",
                             compile_config=compile_config)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert backend.stats.graphs_seen == 1  # the decode step; the prefill is not compiled
    check_decode_graph_calls(backend)


def test_generate_with_one_cache_for_every_call_never_captures_again():
    """The same with a StaticCache passed to every generate() (reset between calls): its
    tensors stay put, so after the first call's first decode step every step replays."""
    from transformers import CompileConfig, StaticCache

    expected = fixed_length_generate(tiny_llama(), 2, cache_implementation="static")
    model = tiny_llama()
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", capturable_split_ops=("attention",)))
    compile_config = CompileConfig(backend=backend, mode=None)
    compile_config._compile_all_devices = True
    cache = StaticCache(config=model.config, max_cache_len=32)
    prompt = (torch.arange(10).view(2, 5) * 7 + 1) % 128
    for _ in range(3):
        cache.reset()
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=FIXED_NEW_TOKENS,
                             min_new_tokens=FIXED_NEW_TOKENS, do_sample=False, past_key_values=cache,
                             compile_config=compile_config)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    stats = backend.stats
    assert (stats.piecewise_calls, stats.full_graph_calls) == (1, 3 * (FIXED_NEW_TOKENS - 1) - 1)
    assert stats.parameter_recaptures == 0 and stats.calls_with_moved_parameters == 0


# ---- CUDA ----

@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_hf_static_cache_generate_from_full_graphs(batch, whole):
    expected = fixed_length_generate(tiny_llama().cuda(), batch, cache_implementation="static")
    model = tiny_llama().cuda()
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",), full_graph_compile=whole))
    model.forward = torch.compile(model.forward, backend=backend)
    for _ in range(2):
        got = fixed_length_generate(model, batch, cache_implementation="static")
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    check_decode_graph_calls(backend)
    assert backend.stats.graphs_captured > 0


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("compiler, whole", [("inductor", False), ("eager", True)])
def test_hf_generate_compiles_its_decode_step_with_cgcompile(compiler, whole):
    """generate()'s own compile (compile_config) with a cgcompile Backend: the prefill runs
    eagerly, the decode step from full graphs. Its static cache marks its tensors static, so
    a cache at a new address (a new generate()) is seen by the parameter check: one call
    without graphs, one piecewise, then a new capture."""
    from transformers import CompileConfig

    expected = fixed_length_generate(tiny_llama().cuda(), 3, cache_implementation="static")
    model = tiny_llama().cuda()
    backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, capturable_split_ops=("attention",),
                                                 full_graph_compile=whole, small_query_attention=whole))
    prompt = (torch.arange(15, device="cuda").view(3, 5) * 7 + 1) % 128
    captured = []
    for _ in range(2):
        got = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=FIXED_NEW_TOKENS,
                             min_new_tokens=FIXED_NEW_TOKENS, do_sample=False, cache_implementation="static",
                             compile_config=CompileConfig(backend=backend, mode=None))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        captured.append(backend.stats.graphs_captured)
    stats = backend.stats
    assert stats.graphs_seen == 1 and stats.graphs_captured > 0
    # A cache at a new address costs the full graph's capture alone, not every piece's too.
    assert captured[1] - captured[0] == stats.parameter_recaptures
    assert stats.full_graph_calls + stats.piecewise_calls == 2 * (FIXED_NEW_TOKENS - 1)
    assert stats.piecewise_calls <= 3, stats.piecewise_reasons
    assert stats.full_graph_compilations == (1 if whole else 0)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("written", [True, False])
def test_hf_dynamic_cache_stays_piecewise_on_cuda(written):
    """written: capturable_split_ops=("attention",); else the default, backend="cgcompile",
    whose automatic full graphs must cost nothing where the cache length changes every step."""
    expected = fixed_length_generate(tiny_llama().cuda(), 1)
    model = tiny_llama().cuda()
    backend = cgcompile.Backend(cgcompile.Config(capturable_split_ops=("attention",))) if written else "cgcompile"
    model.forward = torch.compile(model.forward, backend=backend)
    torch.testing.assert_close(fixed_length_generate(model, 1), expected, rtol=0, atol=0)
    backend = backend if written else cgcompile.backend_of(model)
    # Graphs whose plan allows a full path count their calls; none may take it, or capture one.
    assert backend.stats.full_graph_calls == 0 and backend.stats.piecewise_calls > 0
    assert not any(rt.full.graphs for rt in backend.runtimes if rt.full is not None)
