"""cgcompile::grouped_skinny_linear: the post-grad rewrite that groups one-row products of the same
input (CPU, on aten graphs traced with fake CUDA tensors), the op's choice between its kernel and
F.linear, the kernel under Triton's interpreter, and on the GPU the kernel and a compiled model
with separate q/k/v and gate/up linears against eager."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cgcompile
from cgcompile.build.post_grad import PostGradPass
from cgcompile.kernels.grouped_skinny_linear import (  # noqa: F401 (grouped_skinny_linear registers the op)
    MAX_MEMBERS, group_problem, grouped_kernel_call, grouped_launch, grouped_skinny_linear)
from cgcompile.kernels.skinny_linear import MAX_FEATURES, Launch, choose_launch, skinny_linear  # noqa: F401
from cgcompile.passes.skinny_groups import find_skinny_groups, rewrite_skinny_groups
from cgcompile.passes.skinny_linear import find_skinny_linears
from cgcompile.testing.models import RMSNorm

GROUPED = torch.ops.cgcompile.grouped_skinny_linear.default
SINGLE = torch.ops.cgcompile.skinny_linear.default
GATED = torch.ops.cgcompile.silu_mul_linear.default
MM = torch.ops.aten.mm.default
BF16 = torch.bfloat16


def _aten_graph(fn, *shapes, dtype=BF16, device="cuda"):
    """fn traced to an aten graph (linears as mm/addmm of a transpose, as in Inductor's
    post-grad graph) on fake tensors of `device`."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        return make_fx(fn, tracing_mode="fake")(*args)


def _copy(gm):
    return torch.fx.GraphModule(gm, gm.graph.__deepcopy__())


def _count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def _members(gm) -> list[list[str]]:
    """The weights each grouped call reads, by placeholder name."""
    return [[w.name for w in n.args[1]] for n in gm.graph.nodes if n.target is GROUPED]


def _assert_in_order(gm):
    """Every node after what it reads (graph.lint() checks the same; this says which node)."""
    gm.graph.lint()
    seen = set()
    for node in gm.graph.nodes:
        assert all(arg in seen for arg in node.all_input_nodes), f"{node.name} before its inputs"
        seen.add(node)


def _assert_same_results(gm, original, shapes, dtype=BF16):
    # On the CPU the ops run F.linear: the same kernels as the original's mm and addmm.
    torch.manual_seed(0)
    args = [torch.randn(shape, dtype=dtype) for shape in shapes]
    torch.testing.assert_close(gm(*args), original(*args), rtol=0, atol=0)


# q [32], k and v [16] of a [16] hidden state; gate and up [48]; down back to [16]
BLOCK_SHAPES = [(1, 16), (32, 16), (16, 16), (16, 16), (48, 16), (48, 16), (16, 48)]


def _block(x, wq, wk, wv, wg, wu, wd):
    q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
    h = x + q.view(-1, 2, 16).sum(1) + k * v
    return F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def test_q_k_v_and_gate_up_become_one_call_each():
    gm = _aten_graph(_block, *BLOCK_SHAPES)
    original = _copy(gm)
    groups = find_skinny_groups(gm, MAX_FEATURES, MAX_MEMBERS)
    assert [[m.weight.name for m in g.members] for g in groups] == [["wq_1", "wk_1", "wv_1"], ["wg_1", "wu_1"]]
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 5
    assert _members(gm) == [["wq_1", "wk_1", "wv_1"], ["wg_1", "wu_1"]]
    assert _count(gm, MM) == 1  # down: alone on its input, left to the single op
    _assert_in_order(gm)
    _assert_same_results(gm, original, BLOCK_SHAPES)


def test_the_slices_carry_the_values_they_compute():
    gm = _aten_graph(_block, *BLOCK_SHAPES)
    rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS)
    call = next(n for n in gm.graph.nodes if n.target is GROUPED)
    assert tuple(call.meta["val"].shape) == (1, 64) and "eager_input_vals" not in call.meta
    slices = [u for u in call.users]
    assert [tuple(s.meta["val"].shape) for s in slices] == [(1, 32), (1, 16), (1, 16)]
    assert [s.args[2:] for s in slices] == [(0, 32), (32, 48), (48, 64)]
    assert all(s.meta["val"].stride() == (64, 1) and s.meta["val"].is_contiguous() for s in slices)
    assert all(s.meta["val"].device.type == "cuda" and s.meta["val"].dtype == BF16 for s in slices)


def test_the_post_grad_pass_counts_grouped_and_single_products():
    gm = _aten_graph(_block, *BLOCK_SHAPES)
    original = _copy(gm)
    rewrites = PostGradPass(skinny_linears=True)
    rewrites(gm)
    assert (rewrites.grouped_linears, rewrites.rewritten_linears, rewrites.gated_linears) == (5, 6, 1)
    # the single product, down, reads silu(gate) * up: it makes that product itself
    assert _count(gm, GROUPED) == 2 and _count(gm, GATED) == 1 and _count(gm, SINGLE) == 0 and _count(gm, MM) == 0
    _assert_same_results(gm, original, BLOCK_SHAPES)


def test_products_of_different_inputs_are_not_grouped():
    def fn(x, y, w1, w2):
        return F.linear(x, w1) + F.linear(y, w2)

    gm = _aten_graph(fn, (1, 16), (1, 16), (8, 16), (8, 16))
    assert find_skinny_groups(gm, MAX_FEATURES, MAX_MEMBERS) == []
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 0


def test_a_member_over_the_feature_limit_stays_a_product_while_its_siblings_group():
    gm = _aten_graph(_block, *BLOCK_SHAPES)
    original = _copy(gm)
    # 20 features at most: q (32), gate and up (48) are left alone, k and v still group.
    assert rewrite_skinny_groups(gm, GROUPED, 20, MAX_MEMBERS) == 2
    assert _members(gm) == [["wk_1", "wv_1"]]
    assert _count(gm, MM) == 4
    _assert_in_order(gm)
    _assert_same_results(gm, original, BLOCK_SHAPES)


def test_rows_other_than_one_dtypes_and_devices_are_left_alone():
    two_rows = [(2, 16), *BLOCK_SHAPES[1:]]
    assert find_skinny_groups(_aten_graph(_block, *two_rows), MAX_FEATURES, MAX_MEMBERS) == []
    assert find_skinny_groups(_aten_graph(_block, *BLOCK_SHAPES, device="cpu"), MAX_FEATURES, MAX_MEMBERS) == []
    gm = _aten_graph(_block, *BLOCK_SHAPES, dtype=torch.float32)
    assert find_skinny_groups(gm, MAX_FEATURES, MAX_MEMBERS) == []


def test_groups_hold_at_most_max_members():
    def fn(x, *ws):
        return sum(F.linear(x, w).sum() for w in ws)

    gm = _aten_graph(fn, (1, 16), *[(8, 16)] * 6)
    original = _copy(gm)
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 6
    assert [len(m) for m in _members(gm)] == [4, 2]
    _assert_same_results(gm, original, [(1, 16), *[(8, 16)] * 6])


def _interleaved(x, wq, wk_flat, wv):
    q = F.linear(x, wq)
    used = q * 2  # a user of q before k is computed: the call must come before it
    k = F.linear(x, wk_flat.view(16, 16))  # k's weight: a view made after that user
    v = F.linear(x, wv)
    return used.sum() + k * v


INTERLEAVED_SHAPES = [(1, 16), (16, 16), (256,), (16, 16)]


def test_a_member_used_between_members_gets_the_call_before_its_first_use():
    gm = _aten_graph(_interleaved, *INTERLEAVED_SHAPES)
    original = _copy(gm)
    [group] = find_skinny_groups(gm, MAX_FEATURES, MAX_MEMBERS)
    assert group.point.target is torch.ops.aten.mul.Tensor and [n.name for n in group.moved] == ["view"]
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 3
    _assert_in_order(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    call = next(n for n in gm.graph.nodes if n.target is GROUPED)
    first_use = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert order[call] < order[first_use]
    _assert_same_results(gm, original, INTERLEAVED_SHAPES)


def test_a_weight_computed_after_a_members_use_keeps_that_member_out():
    def fn(x, wq, wk, wv):
        q = F.linear(x, wq)
        used = q * 2
        k = F.linear(x, wk * 2)  # not a view: cannot move before `used`
        return used.sum() + k * F.linear(x, wv)

    shapes = [(1, 16), (16, 16), (16, 16), (16, 16)]
    gm = _aten_graph(fn, *shapes)
    original = _copy(gm)
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 2
    assert _members(gm) == [["mul_1", "wv_1"]]  # k and v; q stays a product
    _assert_in_order(gm)
    _assert_same_results(gm, original, shapes)


def test_a_group_never_spans_a_write():
    def fn(x, wq, wk, cache):
        q = F.linear(x, wq)
        cache.add_(1)  # a write between the members: their order against it must stay
        return q + F.linear(x, wk) + cache

    gm = _aten_graph(fn, (1, 16), (16, 16), (16, 16), (1, 16))
    assert find_skinny_groups(gm, MAX_FEATURES, MAX_MEMBERS) == []


def test_products_with_biases_group_apart_from_those_without():
    def fn(x, wq, bq, wk, bk, wv, wo):
        q, k, v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv)
        return q + k + v + F.linear(x, wo)

    shapes = [(1, 16), (16, 16), (16,), (16, 16), (16,), (16, 16), (16, 16)]
    gm = _aten_graph(fn, *shapes)
    original = _copy(gm)
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 4
    calls = [n for n in gm.graph.nodes if n.target is GROUPED]
    assert [[b.name for b in c.args[2]] for c in calls] == [["bq_1", "bk_1"], []]
    _assert_in_order(gm)
    _assert_same_results(gm, original, shapes)


def test_a_grouped_product_that_feeds_the_next_group_is_read_from_the_slice():
    def fn(x, w1, w2, w3, w4):
        a = F.linear(x, w1)
        b = F.linear(x, w2)
        return F.linear(a, w3) + F.linear(a, w4) + b.sum()

    shapes = [(1, 16), (16, 16), (16, 16), (16, 16), (16, 16)]
    gm = _aten_graph(fn, *shapes)
    original = _copy(gm)
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 4
    first, second = [n for n in gm.graph.nodes if n.target is GROUPED]
    assert second.args[0].target is torch.ops.aten.slice.Tensor and second.args[0].args[0] is first
    _assert_in_order(gm)
    _assert_same_results(gm, original, shapes)


def test_siblings_that_reshape_a_three_dimensional_input_each_group():
    # Traced without CSE, each F.linear reshapes x [1, 1, K] to [1, K] itself: equal views of x.
    def fn(x, wq, wk, wv):
        return F.linear(x, wq) * 2 + F.linear(x, wk) + F.linear(x, wv)

    shapes = [(1, 1, 16), (16, 16), (16, 16), (16, 16)]
    gm = _aten_graph(fn, *shapes)
    assert len({m.x for m in find_skinny_linears(gm, MAX_FEATURES)}) == 3
    original = _copy(gm)
    assert rewrite_skinny_groups(gm, GROUPED, MAX_FEATURES, MAX_MEMBERS) == 3
    assert _count(gm, torch.ops.aten.view.default) == 1  # the other members' reshapes, unused, are gone
    _assert_in_order(gm)
    _assert_same_results(gm, original, shapes)


def test_inductor_compiles_the_op_and_the_slices_of_its_result():
    def fn(x, wq, wk, wv, bk, bv):
        qkv = GROUPED(x, [wq, wk, wv], [])
        kv = GROUPED(x, [wk, wv], [bk, bv])
        return qkv[:, :32].sum(-1, keepdim=True) + qkv[:, 32:48] * qkv[:, 48:] + kv[:, 16:]

    torch.manual_seed(0)
    args = [torch.randn(shape) for shape in [(1, 16), (32, 16), (16, 16), (16, 16), (16,), (16,)]]
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(*args), fn(*args))


def test_the_op_says_why_it_runs_f_linear(monkeypatch):
    from cgcompile.kernels import skinny_linear as single

    monkeypatch.setattr(single, "triton_available", lambda: True)  # member 0 is fine, with or without Triton here
    with FakeTensorMode():
        x = torch.empty(1, 64, dtype=BF16, device="cuda")
        w = torch.empty(32, 64, dtype=BF16, device="cuda")
        big = torch.empty(MAX_FEATURES + 1, 64, dtype=BF16, device="cuda")
        assert "member 1" in group_problem(x, [w, big], []) and "output features" in group_problem(x, [w, big], [])
        assert f"1 to {MAX_MEMBERS}" in group_problem(x, [w] * (MAX_MEMBERS + 1), [])
    assert "on cpu" in group_problem(torch.randn(1, 64, dtype=BF16), [torch.randn(32, 64, dtype=BF16)], [])


def test_the_op_equals_linear_per_member_where_it_falls_back():
    torch.manual_seed(0)
    x, ws, bs = torch.randn(3, 64), [torch.randn(n, 64) for n in (32, 8, 8)], [torch.randn(n) for n in (32, 8, 8)]
    for biases in (bs, []):
        want = torch.cat([F.linear(x, w, b if biases else None) for w, b in zip(ws, bs)], dim=-1)
        torch.testing.assert_close(GROUPED(x, ws, biases), want, rtol=0, atol=0)


def test_the_op_refuses_biases_that_do_not_match_the_weights():
    x, ws = torch.randn(1, 64), [torch.randn(8, 64)] * 2
    with pytest.raises(cgcompile.CGCompileError, match="biases: expected none or one per weight"):
        GROUPED(x, ws, [torch.randn(8)])


def test_the_pass_names_the_groups_in_its_key():
    assert "skinny_groups=4" in repr(PostGradPass(skinny_linears=True))
    assert "skinny_groups=0" in repr(PostGradPass(skinny_linears=False))


def test_the_group_launch_is_chosen_for_its_largest_member():
    assert grouped_launch([4096, 1024, 1024], 4096) == choose_launch(4096, 4096)
    # under 4096 features the short steps stay, where a lone product takes long ones
    assert grouped_launch([2048, 256, 256], 2048) == Launch(block_n=4, block_k=1024) != choose_launch(2048, 2048)
    assert grouped_launch([1536, 256, 256], 1536) == Launch(block_n=2, block_k=1024)
    # gate/up of a TP=4 8B rank: blocks as for one 3584-feature weight, not for 7168 features
    assert grouped_launch([3584, 3584], 4096) == Launch(block_n=4, block_k=1024) != choose_launch(7168, 4096)


def test_the_grouped_kernel_under_the_triton_interpreter(run_interpreted):
    assert "grouped_skinny_linear interpreted: ok" in run_interpreted("grouped_skinny_linear_interpret_worker.py")


# -- GPU --------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("features, k", [((2048, 512, 512), 4096), ((3584, 3584), 4096), ((2048, 256, 256), 2048),
                                         ((1000, 24, 7, 300), 1000)])
def test_the_grouped_kernel_against_a_float32_product(features, k):
    torch.manual_seed(0)
    x = torch.randn(1, 1, k, dtype=BF16, device="cuda")
    ws = [torch.randn(n, k, dtype=BF16, device="cuda") / k ** 0.5 for n in features]
    bs = [torch.randn(n, dtype=BF16, device="cuda") for n in features]
    for biases in (bs, []):
        assert group_problem(x, ws, biases) is None
        out = torch.full((sum(features),), float("nan"), dtype=BF16, device="cuda")  # poisoned
        got = grouped_kernel_call(x, ws, biases, out=out)
        want = torch.cat([F.linear(x.float(), w.float(), b.float() if biases else None) for w, b in zip(ws, bs)], -1)
        assert got.shape == want.shape and got.dtype == BF16
        # one rounding of a float32 sum: within an ulp of bf16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(GROUPED(x, ws, biases), got, rtol=0, atol=0)


class _SeparateProjections(nn.Module):
    """A decoder layer with q/k/v and gate/up as separate linears, as transformers' Llama has them."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q, self.o = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.k, self.v = nn.Linear(hidden, hidden // 2, bias=False), nn.Linear(hidden, hidden // 2, bias=False)
        self.gate, self.up = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, 3 * hidden, bias=False)
        self.down = nn.Linear(3 * hidden, hidden, bias=False)

    def forward(self, x):  # x: [T, H]
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h).repeat(1, 2), self.v(h).repeat(1, 2)
        x = x + self.o(torch.ops.cgcompile_testing.silly_attention(q, k, v))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _SeparateProjectionsModel(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 64, vocab: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_SeparateProjections(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):  # ids: [T]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.cuda
def test_a_compiled_model_with_separate_projections_at_batch_1_3_1_equals_eager():
    torch.manual_seed(0)
    model = _SeparateProjectionsModel().to("cuda", BF16).requires_grad_(False)
    # Inductor's cache off: a compile it served from disk would run no post-grad pass to count.
    # Sibling fusion off: it would make q/k/v and gate/up one weight each, leaving nothing to group.
    backend = cgcompile.Backend(cgcompile.Config(compiler="inductor", inductor_options={"fx_graph_cache": False},
                                                 fuse_sibling_linears=False))
    compiled = torch.compile(model, backend=backend)
    for n in (1, 3, 1):
        ids = torch.randint(0, 128, (n,), device="cuda")
        torch._dynamo.mark_dynamic(ids, 0)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-2, atol=2e-2)
    stats = backend.stats
    # The batch-1 graph: q/k/v and gate/up of each of 2 layers grouped, the head single. o and
    # down may reach the pass as an addmm whose bias is the [1, H] residual (on an H200, torch
    # 2.11, they did: 11 in all), which the op leaves to cuBLAS.
    assert stats.grouped_skinny_linears == 10 and 10 + 1 <= stats.skinny_linears <= 10 + 5
