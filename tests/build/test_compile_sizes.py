"""Config.compile_sizes (specialised compiles for hot sizes) and Config.inductor_options, on CPU;
under CUDA graphs (marked `cuda`), graphs of a listed size replay the specialised code."""

import pytest
import torch

import cgcompile
import cgcompile.build.compiler
from cgcompile.build.compiler import SizeSpecialised
from cgcompile.testing.models import SILLY_OP, ToyLlama
from cgcompile.testing.gpu import compiled_toy_llama, dynamic_ids


def _compile(compiler: str, **fields):
    torch.manual_seed(0)
    model = ToyLlama(3)
    config = cgcompile.Config(compiler=compiler, splitting_ops=[SILLY_OP], capture_sizes=(1, 2, 4, 8), **fields)
    backend = cgcompile.Backend(config)
    return model, backend, torch.compile(model, backend=backend)


def _call(model, compiled, n: int):
    ids = torch.randint(0, 64, (n,))
    torch._dynamo.mark_dynamic(ids, 0)
    torch.testing.assert_close(compiled(ids), model(ids))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compile_sizes_specialise_each_distinct_piece_once_per_size(compiler):
    model, backend, compiled = _compile(compiler, compile_sizes=(2, 8), padding=True)
    _call(model, compiled, 3)  # padded to 4: the general compile only
    assert backend.stats.specialised_compilations == 0
    _call(model, compiled, 6)  # padded to 8: 3 distinct pieces of 4 get their size-8 code
    assert backend.stats.specialised_compilations == 3
    _call(model, compiled, 5)  # 8 again: compiled already
    _call(model, compiled, 2)
    assert backend.stats.specialised_compilations == 6
    assert backend.stats.compilations == (3 if compiler == "inductor" else 0)
    assert backend.stats.specialise_s > 0


def test_specialised_code_has_the_size_fixed():
    model, backend, compiled = _compile("eager", compile_sizes=(4,), padding=True)
    _call(model, compiled, 3)
    specialised = [r.fn for r in backend.runtimes[0].runners if isinstance(r.fn, cgcompile.build.compiler.SizeSpecialised)]
    assert len(specialised) == 4
    for fn in specialised:
        (gm,) = fn.specialised.values()
        shapes = [n.meta["val"].shape for n in gm.graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor)]
        assert all(type(s) is int for shape in shapes for s in shape), shapes
        assert 4 in {shape[0] for shape in shapes if shape}


def test_compile_sizes_at_exact_sizes():
    model, backend, compiled = _compile("inductor", compile_sizes=(2,), padding=False)
    _call(model, compiled, 3)
    _call(model, compiled, 2)
    assert backend.stats.specialised_compilations == 3
    _call(model, compiled, 1)
    assert backend.stats.specialised_compilations == 3


def test_inductor_options_reach_every_compile(monkeypatch):
    seen = []
    real = cgcompile.build.compiler.inductor_compile

    def spy(gm, example_inputs, options=None):
        seen.append((all(type(s) is int for x in example_inputs if isinstance(x, torch.Tensor) for s in x.shape),
                     dict(options or {})))
        return real(gm, example_inputs, options)

    monkeypatch.setattr(cgcompile.build.compiler, "inductor_compile", spy)
    model, backend, compiled = _compile(
        "inductor", compile_sizes=(4,), padding=True,
        inductor_options={"epilogue_fusion": False}, size_inductor_options={"coordinate_descent_tuning": True},
    )
    _call(model, compiled, 3)
    general = [opts for static, opts in seen if not static]
    at_size = [opts for static, opts in seen if static]
    # the config's own patches (combo kernels) under the user's options
    patches = backend.config.compile.inductor_patches()
    assert patches["epilogue_fusion"] is False and "combo_kernels" in patches
    assert general == [patches] * 3
    assert at_size == [{**patches, "coordinate_descent_tuning": True}] * 3


def test_options_are_stored_as_sorted_pairs():
    config = cgcompile.Config(inductor_options={"max_autotune_gemm": True, "coordinate_descent_tuning": True})
    assert config.compile.inductor_options == (("coordinate_descent_tuning", True), ("max_autotune_gemm", True))
    hash(config)
    assert cgcompile.Config.from_options({"compile_sizes": [1, 8]}).compile.compile_sizes == (1, 8)


@pytest.mark.parametrize("fields, message", [
    ({"compile_sizes": (3,)}, "compile_sizes: expected sizes from capture_sizes, got [3]"),
    ({"compile_sizes": (0,)}, "compile_sizes: expected positive ints, got [0]"),
    ({"compile_sizes": (1, 1)}, "compile_sizes: expected each size once"),
    ({"compile_sizes": 8}, "compile_sizes: expected a tuple or list of capture sizes, got 8 (int)"),
    ({"inductor_options": {"coordinate_descent_tunning": True}},
     "inductor_options: expected Inductor config options (torch._inductor.config), got unknown "
     "'coordinate_descent_tunning'; did you mean 'coordinate_descent_tuning'?"),
    ({"size_inductor_options": {"triton.cudagraphs": True}},
     "size_inductor_options: expected options that keep pieces capturable, got 'triton.cudagraphs'"),
    ({"inductor_options": {1: True}}, "inductor_options: expected a dict with str keys"),
    ({"inductor_options": "max_autotune"}, "inductor_options: expected a dict of Inductor config options"),
])
def test_bad_compile_sizes_and_options(fields, message):
    with pytest.raises(cgcompile.ConfigError) as info:
        cgcompile.Config(capture_sizes=(1, 2, 4, 8), **fields)
    assert message in str(info.value)


SIZES = (2, 4, 8, 16)


def _compiled(compiler: str, **fields):
    return compiled_toy_llama(compiler, SIZES, **fields)


def _specialised(backend) -> list[SizeSpecialised]:
    return [r.fn for rt in backend.runtimes for r in rt.runners if isinstance(r.fn, SizeSpecialised)]


class _Counting:
    """Wraps a compiled function and counts its calls (replays do not call it)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.cuda
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_graphs_of_a_compile_size_capture_the_specialised_code(compiler):
    model, backend, compiled = _compiled(compiler, compile_sizes=(4,))
    for n in (3, 3, 4, 7, 7, 3):  # size 4: specialised; size 8: general; each captured once
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert backend.stats.specialised_compilations == 3  # three distinct pieces of four
    assert backend.stats.graphs_captured == 2 * 4
    for fn in _specialised(backend):
        assert set(fn.specialised) == {4}


@pytest.mark.cuda
def test_replays_do_not_call_the_specialised_code_again():
    model, backend, compiled = _compiled("inductor", compile_sizes=(4,))
    ids = dynamic_ids(3)
    compiled(ids)  # warm-up, specialised compile, capture, first replay
    counters = []
    for fn in _specialised(backend):
        fn.specialised[4] = _Counting(fn.specialised[4])
        counters.append(fn.specialised[4])
    for _ in range(3):
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert [c.calls for c in counters] == [0] * len(counters)


@pytest.mark.cuda
def test_ahead_of_time_capture_compiles_in_the_warm_up():
    model, backend, compiled = _compiled("inductor", compile_sizes=(2, 16))
    backend.capture(compiled, lambda size, warmup: (dynamic_ids(size),), progress=False)
    assert backend.stats.specialised_compilations == 6
    assert backend.stats.graphs_captured == 4 * len(SIZES)
    for n in (3, 2, 9, 16):
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert backend.stats.specialised_compilations == 6



def _toy_bf16(device: str, **fields):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=64, vocab=128).to(device, torch.bfloat16).requires_grad_(False)
    config = cgcompile.Config(compiler="inductor", splitting_ops=[SILLY_OP], capture_sizes=(1, 2, 4, 8), **fields)
    backend = cgcompile.Backend(config)
    return model, backend, torch.compile(model, backend=backend)


def _linears(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def _check_matvec_as_reduction(device: str):
    # Dynamo compiles a call of one row statically (it specialises sizes of 1): there every
    # linear is a reduction; the graph with a dynamic row count (3, then 2) keeps cuBLAS.
    model, backend, compiled = _toy_bf16(device, matvec_as_reduction=True)
    linears = _linears(model)
    for n, reductions in ((1, linears), (3, linears), (2, linears), (1, linears)):
        ids = torch.randint(0, 128, (n,), device=device)
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-2, atol=2e-2)
        assert backend.stats.matvec_reductions == reductions, n
    assert backend.stats.graphs_seen == 2


def test_matvec_as_reduction_rewrites_the_one_row_linears_of_static_graphs():
    _check_matvec_as_reduction("cpu")


@pytest.mark.cuda
def test_matvec_as_reduction_under_cuda_graphs():
    _check_matvec_as_reduction("cuda")


def test_matvec_as_reduction_needs_inductor():
    with pytest.raises(cgcompile.ConfigError, match='set compiler="inductor"'):
        cgcompile.Config(compiler="eager", matvec_as_reduction=True)
