"""build.dependent_launch: Inductor's programmatic dependent launch with every kernel waiting
before its first memory access. On CPU: when the compile is changed and how; on the GPU
(marked `cuda`): every generated Triton kernel waits before its first load or store, and the
program that read stale memory under Inductor's own waits equals eager."""

import logging
import re

import pytest
import torch
import torch.compiler.config as compiler_config
import torch._inductor.config as inductor_config
from torch._inductor.codegen.triton import TritonKernel
from torch._inductor.virtualized import V

import cgcompile
from cgcompile.build import dependent_launch
from cgcompile.build.dependent_launch import KEY_TAG, PDL_OPTION, kept_in_order, pdl_requested


def test_pdl_is_requested_by_the_compile_patches_else_by_inductors_config():
    with inductor_config.patch({PDL_OPTION: False}):
        assert not pdl_requested(None) and not pdl_requested({"combo_kernels": True})
        assert pdl_requested({PDL_OPTION: True})
    with inductor_config.patch({PDL_OPTION: True}):  # as TORCHINDUCTOR_ENABLE_PDL=1 sets it
        assert pdl_requested({}) and not pdl_requested({PDL_OPTION: False})


@inductor_config.patch({PDL_OPTION: False})
def test_a_compile_without_pdl_is_left_alone():
    decide, tag = TritonKernel._handle_pdl_before_access, compiler_config.cache_key_tag
    with kept_in_order({"combo_kernels": True}) as options:
        assert options == {"combo_kernels": True}
        assert TritonKernel._handle_pdl_before_access is decide and compiler_config.cache_key_tag == tag


def test_a_compile_with_pdl_waits_always_and_is_keyed_so_until_it_ends():
    decide, tag = TritonKernel._handle_pdl_before_access, compiler_config.cache_key_tag
    with pytest.raises(RuntimeError, match="compile failed"):
        with kept_in_order({PDL_OPTION: True}) as options:
            assert options == {PDL_OPTION: True}
            assert TritonKernel._handle_pdl_before_access.__wrapped__ is decide
            assert KEY_TAG in compiler_config.cache_key_tag
            raise RuntimeError("compile failed")
    assert TritonKernel._handle_pdl_before_access is decide and compiler_config.cache_key_tag == tag


def test_the_wait_is_decided_as_if_no_kernel_came_before():
    class Scheduler:
        previous_node = "the kernel before"

    class Graph:
        scheduler = Scheduler()

    seen = []

    def decide(kernel, wait_buffer, *dependencies, consider_reads=False):
        seen.append((V.graph.scheduler.previous_node, wait_buffer, dependencies, consider_reads))

    with V.set_graph_handler(Graph()):
        dependent_launch._waiting_always(decide)("kernel", "stores", "buf0", consider_reads=True)
        assert Graph.scheduler.previous_node == "the kernel before"  # put back
    assert seen == [(None, "stores", ("buf0",), True)]


def test_a_torch_without_the_hooks_compiles_without_pdl_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(dependent_launch, "_hooks", lambda: "Inductor's Triton kernels have no hook")
    monkeypatch.setattr(dependent_launch, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="cgcompile.build.dependent_launch"):
        with kept_in_order({PDL_OPTION: True, "combo_kernels": True}) as options:
            assert options == {PDL_OPTION: False, "combo_kernels": True}
    assert "no hook" in caplog.text and "stale memory" in caplog.text


def test_this_torch_has_the_hooks():
    assert not isinstance(dependent_launch._hooks(), str), dependent_launch._hooks()


@torch.no_grad()
def test_a_cpu_compile_asked_for_pdl_equals_eager_and_leaves_the_key_tag():
    tag = compiler_config.cache_key_tag
    config = cgcompile.Config(compiler="inductor", inductor_options={PDL_OPTION: True})
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend=cgcompile.Backend(config))
    x = torch.randn(4, 8)
    torch.testing.assert_close(fn(x), torch.relu(x) * 2)
    assert compiler_config.cache_key_tag == tag


def test_a_backward_compiled_after_the_forward_waits_too(monkeypatch):
    # AOTAutograd compiles a backward at the first backward call, after the compile that
    # kept_in_order wraps has returned: each graph's own compile forces the waits again.
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    inner = compile_fx_module._compile_fx_inner  # what compile_fx_inner calls for each graph

    def spy(*args, **kwargs):
        decide = TritonKernel._handle_pdl_before_access
        seen.append((bool(kwargs.get("is_backward")), hasattr(decide, "__wrapped__"),
                     KEY_TAG in compiler_config.cache_key_tag))
        return inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "_compile_fx_inner", spy)
    config = cgcompile.Config(compiler="inductor", inductor_options={PDL_OPTION: True})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    compiled = torch.compile(model, backend=cgcompile.Backend(config))
    x = torch.randn(5, 8)
    with inductor_config.patch(force_disable_caches=True):  # a compile served from a cache makes no graph
        compiled(x).sum().backward()
    assert not hasattr(TritonKernel._handle_pdl_before_access, "__wrapped__")  # put back after
    assert (True, True, True) in seen, seen  # the backward's compile, with the waits forced
    assert all(forced and keyed for _, forced, keyed in seen), seen
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for grad, p in zip(grads, model.parameters()):
        torch.testing.assert_close(grad, p.grad)


def test_a_graph_that_draws_random_numbers_compiles_without_pdl(monkeypatch):
    # Inductor's kernels load their random seed without waiting: such a graph gets no PDL.
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    inner = compile_fx_module._compile_fx_inner

    def spy(*args, **kwargs):
        seen.append(inductor_config.triton.enable_pdl)
        return inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "_compile_fx_inner", spy)
    config = cgcompile.Config(compiler="inductor", inductor_options={PDL_OPTION: True})
    noisy = torch.compile(lambda x: x + torch.rand_like(x), backend=cgcompile.Backend(config))
    plain = torch.compile(lambda x: x * 3, backend=cgcompile.Backend(config))
    x = torch.randn(4, 8)
    with inductor_config.patch(force_disable_caches=True):
        noisy(x)
        assert seen == [False]
        torch.testing.assert_close(plain(x), x * 3)
        assert seen == [False, True]


def test_a_graph_compiled_with_pdl_off_is_left_alone(monkeypatch):
    seen = []

    def inner(*args, **kwargs):
        seen.append(hasattr(TritonKernel._handle_pdl_before_access, "__wrapped__"))

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with inductor_config.patch({PDL_OPTION: False}):
        dependent_launch.waiting_first(inner)(gm, [])
    with inductor_config.patch({PDL_OPTION: True}):
        dependent_launch.waiting_first(inner)(gm, [])
    assert seen == [False, True]


class _WrittenThenRead(torch.nn.Module):
    """The fuzzer's seed 2039 (benchmarks/RESULTS.md): a buffer written in place, then read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b2", torch.zeros(16, 32))

    def forward(self, x):
        t1 = torch.cumsum(x + x, dim=0)
        self.b2.index_copy_(0, torch.arange(t1.shape[0], device=t1.device), t1)
        return self.b2 * 1.0, torch.sort(t1, dim=-1, stable=True, descending=True)


@pytest.mark.cuda
@torch.no_grad()
def test_every_kernel_waits_before_its_first_access_and_the_written_buffer_is_read_fresh():
    from torch._inductor.utils import run_and_get_code

    config = cgcompile.Config(compiler="inductor", capture_sizes=(1, 2, 4, 8), padding=True,
                              inductor_options={PDL_OPTION: True})
    model, reference = _WrittenThenRead().cuda(), _WrittenThenRead().cuda()
    compiled = torch.compile(model, backend=cgcompile.Backend(config), fullgraph=True)
    sizes = (8, 3, 8, 1, 5, 8)
    x = [torch.randn(n, 32, device="cuda") for n in sizes]
    for t in x[1:]:
        torch._dynamo.mark_dynamic(t, 0)
    with inductor_config.patch(force_disable_caches=True):  # code served from a cache is not shown
        _, sources = run_and_get_code(lambda: [(compiled(t), reference(t)) for t in x])
    kernels = [k for source in sources for k in re.split(r"\n@triton\.jit\n", source)[1:]]
    assert kernels, "no Triton kernel was generated"
    for kernel in kernels:
        first_access = re.search(r"tl\.(load|store|atomic_\w+)\(", kernel)
        if first_access is not None:
            wait = kernel.find("gdc_wait()")
            assert 0 <= wait < first_access.start(), kernel
    for n, t in zip(sizes, x):
        for _ in range(20):  # a race need not show every time
            torch.testing.assert_close(compiled(t), reference(t), msg=lambda m: f"n={n}: {m}")
