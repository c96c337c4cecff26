"""The one-row product folded into the fused all-reduce + residual add + RMS norm after it:
which products of Inductor's post-grad graph the fold takes (a layer's output and gated down
projections) and which it leaves, the folded graph against the original (stand-ins on CPU),
the Config switch, and the publishing product with its gather under Triton's interpreter on
forked ranks (bit for bit the fused kernel's results). On 2 GPUs,
`test_all_reduce_norm.py`'s CUDA test compiles a block with the fold on and off."""

import copy
import importlib.util
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cgcompile
from cgcompile.build.compiler import PieceCompiler
from cgcompile.build.post_grad import PostGradPass
from cgcompile.parallel.all_reduce_norm import FUSED_OP, LINEAR_FUSED_OP, fold_compiled_linears
from cgcompile.parallel.inductor_all_reduce import RouteCompiledAllReduces
from cgcompile.parallel.symm_all_reduce import ALL_REDUCE_OP, GroupRegistry
from cgcompile.passes.all_reduce_norm import find_all_reduce_norms, fuse_all_reduce_norms
from cgcompile.passes.linear_all_reduce_norm import find_linear_all_reduce_norms
from parallel_launch import interpreted_ranks
from test_all_reduce_norm import TP_LAYER_SHAPES, cgcompile_norm, run, stand_in_fused, tp_layer

SKINNY = torch.ops.cgcompile.skinny_linear.default
GATED = torch.ops.cgcompile.silu_mul_linear.default


def stand_in_folded(x, up, matrix, bias, residual, weight, eps, group_name):
    product = F.linear(x if up is None else F.silu(x) * up, matrix, bias)
    return stand_in_fused(product.view(residual.shape), residual, weight, eps, group_name)


def tp_layer_sum_read_twice(x, residual, norm_weight, wq, wk, wv, wo, wg, wu, wd):
    """tp_layer whose output projection's row is also returned: the fold must leave it."""
    h, y = cgcompile_norm(x, residual, norm_weight)
    o = F.linear(F.linear(y, wq), wo)
    h, y = cgcompile_norm(o, h, norm_weight)
    return h, y, o


def tp_two_layers(x, residual, norm_weight, wq, wk, wv, wo, wg, wu, wd):
    """tp_layer's blocks with the down projection's sum all-reduced too: both row-parallel
    products feed a fused chain."""
    h, y = cgcompile_norm(x, residual, norm_weight)
    h, y = cgcompile_norm(F.linear(F.linear(y, wq), wo), h, norm_weight)
    return cgcompile_norm(F.linear(F.silu(F.linear(y, wg)) * F.linear(y, wu), wd), h, norm_weight)


def rewritten(fn):
    """fn's post-grad graph (fake CUDA bf16 operands of TP_LAYER_SHAPES, Inductor's
    decompositions), its chains fused and its one-row products on the skinny ops, as the
    post-grad pass leaves it before the fold; and the original graph."""
    from torch._inductor.decomposition import select_decomp_table

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for shape in TP_LAYER_SHAPES]
        gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*fake)
    original = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    fuse_all_reduce_norms(gm, find_all_reduce_norms(gm, ALL_REDUCE_OP), FUSED_OP)
    PostGradPass(skinny_linears=True)(gm)
    return gm, original


def stand_in_gated(gate, up, matrix, bias):
    return F.linear(F.silu(gate) * up, matrix, bias)


def run_with_stand_ins(gm, inputs):
    stand_ins = {FUSED_OP: stand_in_fused, LINEAR_FUSED_OP: stand_in_folded, GATED: stand_in_gated}
    for node in gm.graph.nodes:
        node.target = stand_ins.get(node.target, node.target)
    gm.recompile()
    return gm(*inputs)


def inputs_of(shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for shape in shapes]


@pytest.mark.parametrize("fn, folded", [(tp_layer, 1), (tp_two_layers, 2)])
def test_the_products_only_a_fused_chain_reads_are_folded_into_it(fn, folded):
    gm, original = rewritten(fn)
    found = find_linear_all_reduce_norms(gm, FUSED_OP, SKINNY, GATED)
    assert len(found) == folded, gm.code
    assert fold_compiled_linears(gm) == folded
    calls = [n for n in gm.graph.nodes if n.target is LINEAR_FUSED_OP]
    assert len(calls) == folded
    # the first chain's input is the layer's input, no product: it stays a plain fused call
    assert sum(n.target is FUSED_OP for n in gm.graph.nodes) == 2 + (fn is tp_two_layers) - folded
    gm.graph.lint()
    inputs = inputs_of(TP_LAYER_SHAPES)
    for got, want in zip(run_with_stand_ins(gm, inputs), run(original, inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same torch ops, in the same order


def test_a_gated_product_viewed_before_the_chain_is_folded_with_its_up_operand():
    graph = torch.fx.Graph()
    gate, up, matrix, residual, weight = (graph.placeholder(n) for n in ("gate", "up", "matrix", "residual", "weight"))
    product = graph.call_function(GATED, (gate, up, matrix, None))
    viewed = graph.call_function(torch.ops.aten.view.default, (product, [1, 1, 64]))
    fused = graph.call_function(FUSED_OP, (viewed, residual, weight, 1e-6, "tp"))
    graph.output((graph.call_function(operator.getitem, (fused, 0)), graph.call_function(operator.getitem, (fused, 1))))
    gm = torch.fx.GraphModule({}, graph)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator).to(torch.bfloat16)
              for shape in ((1, 32), (1, 32), (64, 32), (1, 1, 64), (64,))]
    want = [t.clone() for t in run_with_stand_ins(copy.deepcopy(gm), inputs)]
    (match,) = find_linear_all_reduce_norms(gm, FUSED_OP, SKINNY, GATED)
    assert (match.x, match.up, match.views) == (gate, up, (viewed,))
    assert fold_compiled_linears(gm) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is LINEAR_FUSED_OP
    for got, expected in zip(run_with_stand_ins(gm, inputs), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_product_read_elsewhere_is_left():
    gm, _ = rewritten(tp_layer_sum_read_twice)
    assert any(n.target is SKINNY for n in gm.graph.nodes), gm.code  # there is a product to leave
    assert find_linear_all_reduce_norms(gm, FUSED_OP, SKINNY, GATED) == []


def test_a_product_is_not_moved_past_a_write():
    gm, _ = rewritten(tp_layer)
    (match,) = find_linear_all_reduce_norms(gm, FUSED_OP, SKINNY, GATED)
    with gm.graph.inserting_after(match.product):  # a write between the product and its reader
        gm.graph.call_function(torch.ops.aten.add_.Tensor, (match.x, 1.0))
    assert find_linear_all_reduce_norms(gm, FUSED_OP, SKINNY, GATED) == []


def test_the_post_grad_pass_folds_after_its_other_rewrites_and_config_turns_it_on(monkeypatch):
    from cgcompile.kernels import skinny_linear

    monkeypatch.setattr(skinny_linear, "triton_available", lambda: True)  # CI has no Triton: no skinny ops
    gm, _ = rewritten(tp_layer)
    rewrites = PostGradPass(RouteCompiledAllReduces(GroupRegistry()), skinny_linears=True, fold_linears=True)
    rewrites(gm)  # no group recorded: nothing routed or fused again; the product folded
    assert rewrites.folded_linears == 1 and sum(n.target is LINEAR_FUSED_OP for n in gm.graph.nodes) == 1
    assert not cgcompile.Config().rewrites.fuse_linear_all_reduce  # off by default (docs/config.md says why)
    on = PieceCompiler("inductor", all_reduce="auto", skinny_linears=True, fuse_linear_all_reduce=True).post_grad_pass
    off = PieceCompiler("inductor", all_reduce="auto", skinny_linears=True).post_grad_pass
    unfused = PieceCompiler("inductor", all_reduce="auto", skinny_linears=True, fuse_linear_all_reduce=True,
                            fuse_all_reduce_norm=False).post_grad_pass
    assert on.fold_linears and not off.fold_linears and not unfused.fold_linears  # the fold reads fused calls
    assert on.uuid() != off.uuid() and repr(on) != repr(off)  # Inductor's cache keeps them apart


has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")


@has_triton
@pytest.mark.parametrize("world, dtype", [(2, "bf16"), (4, "fp32")])
def test_the_publishing_product_on_interpreted_ranks_equals_the_fused_kernel(world, dtype):
    assert f"publishing product and gather on {world} interpreted ranks" in interpreted_ranks(world, dtype, "linear")
