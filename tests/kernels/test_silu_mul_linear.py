"""cgcompile::silu_mul_linear: the post-grad rewrite that hands a gated MLP's silu(gate) * up to
the one-row down projection reading it (CPU, on aten graphs traced with fake CUDA tensors, for
each form SiLU takes there), the op's choice between its kernel and eager ops, the kernel under
Triton's interpreter, and on the GPU the kernel and a compiled model against eager."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cgcompile
from cgcompile.kernels.silu_mul_linear import gated_problem, silu_mul_linear  # noqa: F401 (registers the op)
from cgcompile.kernels.skinny_linear import MAX_FEATURES, skinny_linear  # noqa: F401
from cgcompile.passes.silu_mul_linear import find_silu_mul_linears, rewrite_silu_mul_linears
from cgcompile.passes.skinny_linear import rewrite_skinny_linears

SINGLE = torch.ops.cgcompile.skinny_linear.default
GATED = torch.ops.cgcompile.silu_mul_linear.default
BF16 = torch.bfloat16
aten = torch.ops.aten


def _inductor_silu():
    from torch._inductor.decomposition import select_decomp_table

    return {aten.silu.default: select_decomp_table()[aten.silu.default]}


def _core_silu():
    from torch._decomp import decompositions

    return {aten.silu.default: decompositions.silu}


SILU_FORMS = {"op": lambda: None, "inductor": _inductor_silu, "core": _core_silu}


def _mlp(x, w_gate_up, w_down):
    """A fused gate/up projection, its halves gated, and the down projection, as transformers'
    Llama runs with its sibling linears fused."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def _separate(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


MLP_SHAPES = [(1, 1, 16), (96, 16), (16, 48)]
SEPARATE_SHAPES = [(1, 16), (48, 16), (48, 16), (16, 48)]


def _skinny_graph(fn, shapes, silu="op", dtype=BF16, device="cuda"):
    """fn traced to an aten graph on fake tensors of `device`, SiLU in the given form, and its
    one-row products made skinny linear calls, as Inductor's post-grad pass has them."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        gm = make_fx(fn, decomposition_table=SILU_FORMS[silu](), tracing_mode="fake")(*args)
    rewrite_skinny_linears(gm, SINGLE, MAX_FEATURES)
    return gm


def _count(gm, *targets) -> int:
    return sum(n.target in targets for n in gm.graph.nodes)


def _copy(gm):
    return torch.fx.GraphModule(gm, gm.graph.__deepcopy__())


def _run(gm, shapes, seed=0):
    # On the CPU both ops run eager ops: the rewritten graph must match the original exactly.
    torch.manual_seed(seed)
    return gm(*[torch.randn(shape, dtype=BF16) for shape in shapes])


@pytest.mark.parametrize("silu", sorted(SILU_FORMS))
@pytest.mark.parametrize("fn, shapes", [(_mlp, MLP_SHAPES), (_separate, SEPARATE_SHAPES)], ids=["fused", "separate"])
def test_the_gated_down_projection_takes_its_gating(silu, fn, shapes):
    gm = _skinny_graph(fn, shapes, silu)
    original = _copy(gm)
    assert _count(gm, aten.silu.default, aten.sigmoid.default, aten.exp.default) == 1
    [match] = find_silu_mul_linears(gm, SINGLE)
    assert rewrite_silu_mul_linears(gm, SINGLE, GATED) == 1
    assert _count(gm, GATED) == 1 and _count(gm, SINGLE) == (1 if fn is _mlp else 2)
    # the product and every node of its SiLU are gone
    assert _count(gm, aten.silu.default, aten.sigmoid.default, aten.exp.default, aten.neg.default,
                  aten.mul.Tensor, aten.div.Tensor) == 0
    gm.graph.lint()
    tol = {"rtol": 0, "atol": 0} if silu != "core" else {}  # core's x * sigmoid(x) rounds apart from eager's silu
    torch.testing.assert_close(_run(gm, shapes), _run(original, shapes), **tol)


def test_the_result_keeps_the_shape_of_the_call_it_replaces():
    gm = _skinny_graph(_mlp, MLP_SHAPES)
    rewrite_silu_mul_linears(gm, SINGLE, GATED)
    [gated] = [n for n in gm.graph.nodes if n.target is GATED]
    # the halves are [1, 1, 48] and the down projection read them as [1, 48]: its [1, 16] is a view
    assert tuple(gated.meta["val"].shape) == (1, 1, 16)
    [view] = gated.users
    assert view.target is aten.view.default and tuple(view.meta["val"].shape) == (1, 16)


def _read_twice(x, w_gate, w_up, w_down):
    prod = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
    return F.linear(prod, w_down), prod.sum()


def _silu_read_twice(x, w_gate, w_up, w_down):
    act = F.silu(F.linear(x, w_gate))
    return F.linear(act * F.linear(x, w_up), w_down), act


def _not_silu(x, w_gate, w_up, w_down):
    return F.linear(torch.sigmoid(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def _broadcast(x, w_gate, w_up, w_down):  # up's one value scales every gate value
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up).sum(-1, keepdim=True), w_down)


def _written_between(x, w_gate, w_up, w_down):
    up = F.linear(x, w_up)
    prod = F.silu(F.linear(x, w_gate)) * up
    up.add_(1)  # written after the product read it, before the down projection reads the product
    return F.linear(prod, w_down), up


@pytest.mark.parametrize("fn", [_read_twice, _silu_read_twice, _not_silu, _broadcast, _written_between])
def test_a_product_read_elsewhere_or_not_a_gating_is_left_alone(fn):
    assert find_silu_mul_linears(_skinny_graph(fn, SEPARATE_SHAPES), SINGLE) == []


def test_more_than_one_row_or_the_cpu_is_left_alone():
    two_rows = [(2, 16), *SEPARATE_SHAPES[1:]]
    # two rows: no skinny call to begin with; the pass looks for nothing else
    assert find_silu_mul_linears(_skinny_graph(_separate, two_rows), SINGLE) == []
    assert find_silu_mul_linears(_skinny_graph(_separate, SEPARATE_SHAPES, device="cpu"), SINGLE) == []


def test_the_op_says_why_it_runs_eager_ops(monkeypatch):
    from cgcompile.kernels import skinny_linear as op_module

    monkeypatch.setattr(op_module, "triton_available", lambda: True)  # CI has no Triton: its reason is another test's
    gate, w = torch.randn(1, 64, dtype=BF16), torch.randn(32, 64, dtype=BF16)
    assert "on cpu" in gated_problem(gate, gate, w, None)
    assert "two alike" in gated_problem(gate, torch.randn(1, 1, dtype=BF16), w, None)
    with FakeTensorMode():
        gate = torch.empty(1, 64, dtype=BF16, device="cuda")
        w = torch.empty(32, 64, dtype=BF16, device="cuda")
        assert gated_problem(gate, gate.clone(), w, None) is None
        assert "2 rows" in gated_problem(torch.empty(2, 64, dtype=BF16, device="cuda"),
                                         torch.empty(2, 64, dtype=BF16, device="cuda"), w, None)


def test_the_op_equals_eager_where_it_falls_back():
    torch.manual_seed(0)
    gate, up, w, b = torch.randn(3, 64), torch.randn(3, 64), torch.randn(32, 64), torch.randn(32)
    torch.testing.assert_close(GATED(gate, up, w, b), F.linear(F.silu(gate) * up, w, b), rtol=0, atol=0)


def test_the_kernel_under_the_triton_interpreter(run_interpreted):
    assert "silu_mul_linear interpreted: ok" in run_interpreted("silu_mul_linear_interpret_worker.py")


# -- GPU --------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_against_eager(dtype):
    torch.manual_seed(0)
    for n, k in ((7, 100), (2048, 8192), (4096, 14336), (3584, 2048)):
        gate_up = torch.randn(1, 1, 2 * k, dtype=dtype, device="cuda") * 3
        gate, up = gate_up[..., :k], gate_up[..., k:]
        w = torch.randn(n, k, dtype=dtype, device="cuda") / k ** 0.5
        b = torch.randn(n, dtype=dtype, device="cuda")
        for bias in (None, b):
            assert gated_problem(gate, up, w, bias) is None
            got = GATED(gate, up, w, bias)
            want = F.linear((F.silu(gate) * up).float(), w.float(), None if bias is None else bias.float())
            assert got.shape == want.shape and got.dtype == dtype
            # the output's own rounding: an ulp of its largest values
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


class _GatedModel(nn.Module):
    """Embedding, then per layer an RMS-normed gated MLP added to the residual, then a head."""

    def __init__(self, layers: int = 2, hidden: int = 64, vocab: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(layers))
        self.gates = nn.ModuleList(nn.Linear(hidden, 3 * hidden, bias=False) for _ in range(layers))
        self.ups = nn.ModuleList(nn.Linear(hidden, 3 * hidden, bias=False) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(3 * hidden, hidden, bias=False) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # ids: [T]
        x = self.embed(ids)
        for norm, gate, up, down in zip(self.norms, self.gates, self.ups, self.downs):
            h = norm(x)
            x = x + down(F.silu(gate(h)) * up(h)) * 0.5
        return self.head(x)


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [True, False], ids=["fused-gate-up", "separate"])
def test_a_compiled_gated_model_at_batch_1_3_1_equals_eager(fuse):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _GatedModel().to("cuda", BF16).requires_grad_(False)
    # Inductor's cache off: a compile it served from disk would run no post-grad pass to count.
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", inductor_options={"fx_graph_cache": False},
                                                 fuse_sibling_linears=fuse))
    compiled = torch.compile(model, backend=backend)
    for n in (1, 3, 1):
        ids = torch.randint(0, 128, (n,), device="cuda")
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-2, atol=2e-2)
    assert backend.stats.gated_skinny_linears == 2  # each layer's down projection of the batch-1 graph
