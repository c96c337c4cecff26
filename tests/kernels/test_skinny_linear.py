"""cgcompile::skinny_linear: the post-grad rewrite that finds one-row products (CPU, on aten
graphs traced with fake CUDA tensors), the op's choice between its kernel and F.linear, the
kernel under Triton's interpreter, and on the GPU the kernel and a compiled model against eager."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cgcompile
from cgcompile.build.post_grad import PostGradPass, post_grad_pass
from cgcompile.kernels.skinny_linear import MAX_FEATURES, kernel_problem, skinny_linear  # noqa: F401 (registers the op)
from cgcompile.passes.skinny_linear import find_skinny_linears, rewrite_skinny_linears
from cgcompile.testing.models import ToyLlama

OP = torch.ops.cgcompile.skinny_linear.default
BF16 = torch.bfloat16


def _aten_graph(fn, *shapes_dtypes, device="cuda"):
    """fn traced to an aten graph (linears as mm/addmm of a transpose, as Inductor's
    post-grad graph has them) on fake tensors of `device`."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes_dtypes]
        return make_fx(fn, tracing_mode="fake")(*args)


def _two_linears(x, w1, b1, w2):
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2)


def _count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def test_the_products_of_one_row_in_half_precision_on_cuda_are_found():
    gm = _aten_graph(_two_linears, ((1, 64), BF16), ((32, 64), BF16), ((32,), BF16), ((16, 32), BF16))
    found = find_skinny_linears(gm, max_features=MAX_FEATURES)
    assert [m.bias is not None for m in found] == [True, False]  # addmm with its bias, then mm
    assert [m.weight.name for m in found] == ["w1_1", "w2_1"]


@pytest.mark.parametrize("shapes, device, max_features, why", [
    ([((2, 64), BF16), ((32, 64), BF16), ((32,), BF16), ((16, 32), BF16)], "cuda", 4096, "two rows"),
    ([((1, 64), torch.float32), ((32, 64), torch.float32), ((32,), torch.float32), ((16, 32), torch.float32)],
     "cuda", 4096, "float32"),
    ([((1, 64), BF16), ((32, 64), BF16), ((32,), BF16), ((16, 32), BF16)], "cpu", 4096, "on the CPU"),
    ([((1, 64), BF16), ((32, 64), BF16), ((32,), BF16), ((16, 32), BF16)], "cuda", 8, "more features than the limit"),
])
def test_other_products_are_left_alone(shapes, device, max_features, why):
    gm = _aten_graph(_two_linears, *shapes, device=device)
    assert find_skinny_linears(gm, max_features) == [], why


def test_a_transposed_weight_without_unit_stride_along_k_is_left_alone():
    # x @ w with w stored [K, N] (GPT-2's Conv1D): the op would need w.T, which has stride N along K.
    gm = _aten_graph(lambda x, w: x @ w, ((1, 64), BF16), ((64, 32), BF16))
    assert find_skinny_linears(gm, 4096) == []


def test_a_bias_that_addmm_would_broadcast_is_left_alone():
    gm = _aten_graph(lambda x, w, b: torch.addmm(b, x, w.t()), ((1, 64), BF16), ((32, 64), BF16), ((1,), BF16))
    assert find_skinny_linears(gm, 4096) == []


def test_a_three_dimensional_input_of_one_row_is_found():
    gm = _aten_graph(lambda x, w: F.linear(x, w), ((1, 1, 64), BF16), ((32, 64), BF16))
    assert len(find_skinny_linears(gm, 4096)) == 1


def test_the_rewritten_graph_computes_what_the_original_did():
    gm = _aten_graph(_two_linears, ((1, 64), BF16), ((32, 64), BF16), ((32,), BF16), ((16, 32), BF16))
    original = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    assert rewrite_skinny_linears(gm, OP, 4096) == 2
    assert _count(gm, OP) == 2 and _count(gm, torch.ops.aten.mm.default) == 0
    assert _count(gm, torch.ops.aten.addmm.default) == 0 and _count(gm, torch.ops.aten.permute.default) == 0
    torch.manual_seed(0)
    args = [torch.randn(1, 64, dtype=BF16), torch.randn(32, 64, dtype=BF16), torch.randn(32, dtype=BF16),
            torch.randn(16, 32, dtype=BF16)]
    # On the CPU the op runs F.linear: the same kernel as the original's addmm and mm.
    torch.testing.assert_close(gm(*args), original(*args), rtol=0, atol=0)


def test_a_product_that_reads_a_rewritten_one_is_rewritten_onto_it():
    # The second product's input is the first one's output: it must read the op's result,
    # not the product the op replaced (a stale operand makes the graph invalid).
    gm = _aten_graph(lambda x, w1, w2: F.linear(F.linear(x, w1), w2), ((1, 64), BF16), ((32, 64), BF16),
                     ((16, 32), BF16))
    original = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    assert rewrite_skinny_linears(gm, OP, 4096) == 2
    first, second = [n for n in gm.graph.nodes if n.target is OP]
    assert second.args[0] is first
    assert "eager_input_vals" not in first.meta and first.meta["val"].shape == (1, 32)
    torch.manual_seed(0)
    args = [torch.randn(1, 64, dtype=BF16), torch.randn(32, 64, dtype=BF16), torch.randn(16, 32, dtype=BF16)]
    torch.testing.assert_close(gm(*args), original(*args), rtol=0, atol=0)


def test_the_op_says_why_it_runs_cublas():
    x, w = torch.randn(1, 64, dtype=BF16), torch.randn(32, 64, dtype=BF16)
    assert "on cpu" in kernel_problem(x, w, None)
    with FakeTensorMode():
        x, w = torch.empty(1, 64, dtype=BF16, device="cuda"), torch.empty(32, 64, dtype=BF16, device="cuda")
        assert "2 rows" in kernel_problem(torch.empty(2, 64, dtype=BF16, device="cuda"), w, None)
        assert "float32" in kernel_problem(x.float(), w.float(), None)
        big = torch.empty(MAX_FEATURES + 1, 64, dtype=BF16, device="cuda")
        assert f"up to {MAX_FEATURES} output features" in kernel_problem(x, big, None)
        assert "unit stride" in kernel_problem(x, torch.empty(64, 32, dtype=BF16, device="cuda").t(), None)
        assert "of 64 features" in kernel_problem(x, torch.empty(32, 48, dtype=BF16, device="cuda"), None)
        assert "a bias of shape (1,)" in kernel_problem(x, w, torch.empty(1, dtype=BF16, device="cuda"))


def test_the_op_equals_linear_where_it_falls_back():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 64), torch.randn(32, 64), torch.randn(32)
    torch.testing.assert_close(OP(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


def test_the_pass_is_keyed_by_the_rewrites_it_makes():
    on, off = PostGradPass(skinny_linears=True), PostGradPass(skinny_linears=False)
    assert on.uuid() != off.uuid() and repr(on) != repr(off)
    assert post_grad_pass({}, "nccl", skinny_linears=False) is None


def test_the_rewrite_needs_triton(monkeypatch):
    from cgcompile.kernels import skinny_linear as op_module

    monkeypatch.setattr(op_module, "triton_available", lambda: True)
    made = post_grad_pass({}, "nccl", skinny_linears=True)
    assert made.skinny_linears and made.all_reduces is None
    monkeypatch.setattr(op_module, "triton_available", lambda: False)
    assert post_grad_pass({}, "nccl", skinny_linears=True) is None  # nothing left to rewrite
    assert not post_grad_pass({}, "auto", skinny_linears=True).skinny_linears


def test_the_config_turns_the_rewrite_on_by_default():
    assert cgcompile.Config().compile.skinny_linears
    assert not cgcompile.Config(skinny_linears=False).compile.skinny_linears


def test_the_launch_grows_taller_and_steps_shorter_from_4096_features():
    from cgcompile.kernels.skinny_linear import Launch, choose_launch

    assert choose_launch(256, 100) == Launch(block_n=1, block_k=128)
    assert choose_launch(4096, 14336) == Launch(block_n=8, block_k=512, num_warps=8)
    assert choose_launch(6144, 4096) == Launch(block_n=16, block_k=512, num_warps=4)
    assert choose_launch(16384, 2048) == Launch(block_n=32, block_k=256, num_warps=4)
    assert choose_launch(16384, 100) == Launch(block_n=32, block_k=128, num_warps=4)  # no step past K


def test_under_4096_features_a_long_k_takes_long_steps_and_the_gated_kernel_taller_blocks():
    from cgcompile.kernels.skinny_linear import Launch, choose_launch

    # 64 weight elements a thread a step where K allows a 2048-long step
    assert choose_launch(2048, 2048) == Launch(block_n=4, block_k=2048)
    assert choose_launch(3072, 4096) == Launch(block_n=4, block_k=2048)
    assert choose_launch(256, 8192) == Launch(block_n=4, block_k=2048)
    # shorter K: the short steps, n / 512 features a program
    assert choose_launch(2048, 1024) == Launch(block_n=4, block_k=1024)
    assert choose_launch(896, 896) == Launch(block_n=1, block_k=1024)
    # the gated kernel: 8 features over 8 warps up to 2048 features, short steps past them
    assert choose_launch(2048, 8192, gated=True) == Launch(block_n=8, block_k=2048, num_warps=8)
    assert choose_launch(896, 4864, gated=True) == Launch(block_n=8, block_k=2048, num_warps=8)
    assert choose_launch(3072, 8192, gated=True) == Launch(block_n=4, block_k=1024)
    assert choose_launch(2048, 1024, gated=True) == Launch(block_n=4, block_k=1024)
    # from 4096 features the gated kernel takes the plain one's launch
    assert choose_launch(4096, 14336, gated=True) == choose_launch(4096, 14336)


def test_the_kernel_under_the_triton_interpreter(run_interpreted):
    assert "skinny_linear interpreted: ok" in run_interpreted("skinny_linear_interpret_worker.py")


# -- GPU --------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_against_a_float32_product(dtype):
    torch.manual_seed(0)
    for n, k in ((1, 64), (7, 100), (256, 2048), (1000, 5632), (4096, 4096), (3072, 1024), (6200, 2048),
                 (16384, 2048), (32000, 2048)):
        x = torch.randn(1, 1, k, dtype=dtype, device="cuda")
        w = torch.randn(n, k, dtype=dtype, device="cuda") / k ** 0.5
        b = torch.randn(n, dtype=dtype, device="cuda")
        for bias in (None, b):
            assert kernel_problem(x, w, bias) is None
            got = OP(x, w, bias)
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.shape == want.shape and got.dtype == dtype
            # one rounding of a float32 sum: within an ulp of the output's dtype
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_a_compiled_model_at_batch_1_3_1_equals_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=64, vocab=128).to("cuda", torch.bfloat16).requires_grad_(False)
    # Inductor's cache off: a compile it served from disk would run no post-grad pass to count.
    options = {"fx_graph_cache": False}
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", inductor_options=options))
    compiled = torch.compile(model, backend=backend)
    for n in (1, 3, 1):
        ids = torch.randint(0, 128, (n,), device="cuda")
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-2, atol=2e-2)
    assert backend.stats.skinny_linears > 0  # the batch-1 graph's linears took the kernel
    off = cgcompile.Backend(cgcompile.Config(compiler="inductor", skinny_linears=False, inductor_options=options))
    torch._dynamo.reset()
    torch.compile(model, backend=off)(torch.randint(0, 128, (1,), device="cuda"))
    assert off.stats.skinny_linears == 0
