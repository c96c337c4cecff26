"""The all-reduce fused with the residual add and RMS norm after it: which chains of Inductor's
post-grad graph the rewrite takes (those of torch's, transformers' and cgcompile's RMS norms)
and which it leaves, the rewritten graph against the original (a stand-in all-reduce on CPU),
which groups get it, how the pass keys Inductor's cache, the fused kernel under Triton's
interpreter on forked ranks, and on 2 GPUs the kernel eager and in graphs against NCCL plus
the unfused ops."""

import copy
import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cgcompile
from cgcompile.build.compiler import PieceCompiler
from cgcompile.parallel.all_reduce_choice import GroupFacts, choose_for_group
from cgcompile.parallel.all_reduce_norm import FUSED_OP, add_rms_norm, fuse_compiled_all_reduce_norms, why_not_fused
from cgcompile.parallel.inductor_all_reduce import RouteCompiledAllReduces
from cgcompile.parallel.symm_all_reduce import ALL_REDUCE_OP, FastGroup, GroupRegistry
from cgcompile.passes.all_reduce_norm import find_all_reduce_norms, fuse_all_reduce_norms
from parallel_launch import ROOT, interpreted_ranks, torchrun, two_gpus

EPS = 1e-6


def all_reduce(x):
    return torch.ops.cgcompile.all_reduce(x, "sum", "tp")


def transformers_norm(x, residual, weight):  # LlamaRMSNorm after the residual add
    h = all_reduce(x) + residual
    hs = h.to(torch.float32)
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)
    return h * 3, weight * hs.to(h.dtype)


def cgcompile_norm(x, residual, weight):  # cgcompile.testing.decode_model.RMSNorm, operands swapped
    h = residual + all_reduce(x)
    xf = h.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return h, xf.to(h.dtype) * weight


def float_model_norm(x, residual, weight):  # float32: no casts
    h = all_reduce(x) + residual
    return h, weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS))


def two_layers(x, residual, weight):  # the second chain's residual is the first one's sum
    h, y = cgcompile_norm(x, residual, weight)
    h2, y2 = cgcompile_norm(y * 2, h, weight)
    return h2, y2 + y


def norm_read_in_float(x, residual, weight):  # the float norm is read again: nothing to fuse
    h = all_reduce(x) + residual
    hs = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)
    return hs, weight * hs.to(h.dtype)


def sum_read_twice(x, residual, weight):  # the all-reduce's own result is an output
    s = all_reduce(x)
    h = s + residual
    hs = h.float()
    return s, weight * (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def norm_over_rows(x, residual, weight):  # not the last dimension
    h = all_reduce(x) + residual
    hs = h.float()
    return h, weight[0] * (hs * torch.rsqrt(hs.pow(2).mean(0, keepdim=True) + EPS)).to(h.dtype)


def weight_scaled_in_float(x, residual, weight):  # Gemma's form: scaled before the cast
    h = all_reduce(x) + residual
    hs = h.float()
    return h, (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + weight.float())).to(h.dtype)


class _Stop(Exception):
    pass


def post_grad_graph(fn, dtype=torch.bfloat16, rows=3, hidden=64, dynamic=False):
    """fn's aten graph as Inductor's post-grad passes see it (the compile stops there), and
    inputs: a copy of the graph, which is traced once per arguments (the rewrites change it)."""
    gm, inputs = _traced(fn, dtype, rows, hidden, dynamic)
    return copy.deepcopy(gm), inputs


@functools.cache
def _traced(fn, dtype, rows, hidden, dynamic):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Keep(CustomGraphPass):
        def __call__(self, graph):
            seen.append(graph.owning_module)
            raise _Stop

        def uuid(self):
            return None

    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, hidden, generator=generator).to(dtype) for _ in range(2)]
    inputs.append(torch.rand(hidden, generator=generator).to(dtype))
    with pytest.raises(Exception) as raised:
        if dynamic:  # the rows: a compile for several batch sizes
            for x in inputs[:2]:
                torch._dynamo.mark_dynamic(x, 0)
        torch.compile(fn, backend="inductor", options={"post_grad_custom_post_pass": Keep()}, fullgraph=True)(*inputs)
    assert seen, raised.value
    return seen[0], inputs


def stand_in_all_reduce(x, reduce_op, group_name):  # one rank's view of a sum over two equal ranks
    return x * 2


def stand_in_fused(x, residual, weight, eps, group_name):
    return add_rms_norm(stand_in_all_reduce(x, "sum", group_name), residual, weight, eps)


def run(gm, inputs):
    for node in gm.graph.nodes:
        if node.target is ALL_REDUCE_OP:
            node.target = stand_in_all_reduce
    gm.recompile()
    return gm(*inputs)


@pytest.mark.parametrize("fn, dtype, chains", [(transformers_norm, torch.bfloat16, 1), (cgcompile_norm, torch.bfloat16, 1),
                                               (float_model_norm, torch.float32, 1), (two_layers, torch.bfloat16, 2)])
def test_the_chain_is_fused_into_one_call_that_computes_the_same(fn, dtype, chains):
    gm, inputs = post_grad_graph(fn, dtype)
    found = find_all_reduce_norms(gm, ALL_REDUCE_OP)
    assert len(found) == chains and found[0].eps == EPS and found[0].group_name == "tp", gm.code
    before = run(gm, inputs)
    gm, _ = post_grad_graph(fn, dtype)
    assert fuse_all_reduce_norms(gm, find_all_reduce_norms(gm, ALL_REDUCE_OP), stand_in_fused) == chains
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.rsqrt.default not in targets and ALL_REDUCE_OP not in targets, gm.code
    after = gm(*inputs)
    for got, want in zip(after, before):
        assert torch.equal(got, want)  # the same torch ops, in the same order


@pytest.mark.parametrize("fn", [norm_read_in_float, sum_read_twice, norm_over_rows, weight_scaled_in_float])
def test_chains_whose_parts_are_read_elsewhere_or_differ_are_left(fn):
    gm, _ = post_grad_graph(fn)
    assert find_all_reduce_norms(gm, ALL_REDUCE_OP) == []


def test_a_weight_of_another_dtype_is_left():
    def mixed(x, residual, weight):
        h = all_reduce(x) + residual
        hs = h.float()
        return h, weight.float() * (hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)

    gm, _ = post_grad_graph(mixed)
    assert find_all_reduce_norms(gm, ALL_REDUCE_OP) == []


GOOD = GroupFacts("cuda", "nccl", 2, 1, True, None)


def registry_with(choice):
    registry = GroupRegistry()
    registry.add(FastGroup(choice, {}))
    return registry


def test_only_groups_with_the_lamport_kernel_get_the_fused_op():
    lamport = choose_for_group("tp", GOOD)
    assert lamport.lamport
    for choice, fused in [(lamport, 1), (choose_for_group("tp", GOOD, configured="symm_mem"), 0),
                          (choose_for_group("tp", GOOD, configured="nccl"), 0)]:
        gm, _ = post_grad_graph(transformers_norm)
        assert fuse_compiled_all_reduce_norms(gm, registry_with(choice).choice_of) == fused
        assert sum(n.target is FUSED_OP for n in gm.graph.nodes) == fused, choice
    gm, _ = post_grad_graph(transformers_norm)
    assert fuse_compiled_all_reduce_norms(gm, GroupRegistry().choice_of) == 0  # never set up


@pytest.mark.parametrize("rows, hidden, dynamic, why", [
    (3, 64, True, "not fixed by this compile"),  # a compile for several sizes
    (9, 64, False, "up to 8 rows"),
    (1, 16384, False, "hidden size up to 8192"),
    (8, 8192, False, "65536 bytes"),  # 128 KiB of bf16: over the Lamport limit
])
def test_only_fixed_shapes_the_kernel_takes_are_fused(rows, hidden, dynamic, why):
    gm, _ = post_grad_graph(transformers_norm, rows=rows, hidden=hidden, dynamic=dynamic)
    assert len(find_all_reduce_norms(gm, ALL_REDUCE_OP)) == 1  # the chain is there
    choice = choose_for_group("tp", GOOD)
    chain = find_all_reduce_norms(gm, ALL_REDUCE_OP)[0]
    assert why in why_not_fused(choice, chain.dtype, chain.shape)
    assert fuse_compiled_all_reduce_norms(gm, registry_with(choice).choice_of) == 0
    assert why_not_fused(choice, torch.bfloat16, (8, 4096)) is None  # 64 KiB: the limit itself


def test_the_post_grad_pass_fuses_unless_told_not_to_and_keys_the_cache_by_it():
    registry = registry_with(choose_for_group("tp", GOOD))
    on, off = RouteCompiledAllReduces(registry), RouteCompiledAllReduces(registry, fuse_norm=False)
    assert on.uuid() != off.uuid() and repr(on) != repr(off)
    for route, fused in [(on, 1), (off, 0)]:
        gm, _ = post_grad_graph(transformers_norm)
        route(gm.graph)
        assert sum(n.target is FUSED_OP for n in gm.graph.nodes) == fused


def test_config_turns_the_fusion_off_for_piece_compiles():
    assert cgcompile.Config().rewrites.fuse_all_reduce_norm
    assert PieceCompiler("inductor", all_reduce="auto").post_grad_pass.all_reduces.fuse_norm
    off = PieceCompiler("inductor", all_reduce="auto", fuse_all_reduce_norm=False)
    assert not off.post_grad_pass.all_reduces.fuse_norm


has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")


@has_triton
@pytest.mark.parametrize("world, dtype", [(2, "bf16"), (4, "fp32")])
def test_the_fused_kernel_on_interpreted_ranks_equals_the_unfused_ops(world, dtype):
    assert f"fused lamport kernel on {world} interpreted ranks" in interpreted_ranks(world, dtype, "norm")


@pytest.mark.cuda
@two_gpus
def test_cuda_fused_all_reduce_norm_equals_nccl_and_the_unfused_ops():
    out = torchrun(ROOT / "tests" / "parallel" / "all_reduce_norm_cuda_worker.py", timeout=400)
    for rank in (0, 1):
        for check in ("fused eager calls equal the unfused ops", "fused calls in graphs replayed in any order",
                      "compiled layers fuse and equal the unfused compile"):
            assert f"rank {rank}: {check}: ok" in out, out


def tp_layer(x, residual, norm_weight, wq, wk, wv, wo, wg, wu, wd):
    """A tensor-parallel decoder layer of one row: separate q/k/v and gate/up shards, each
    all-reduce followed by the residual add and RMS norm."""
    h, y = cgcompile_norm(x, residual, norm_weight)
    q, k, v = F.linear(y, wq), F.linear(y, wk), F.linear(y, wv)
    h, y = cgcompile_norm(F.linear(q + k.repeat(1, 2) * v.repeat(1, 2), wo), h, norm_weight)
    return h, F.linear(F.silu(F.linear(y, wg)) * F.linear(y, wu), wd)


TP_LAYER_SHAPES = [(1, 64), (1, 64), (64,), (32, 64), (16, 64), (16, 64), (64, 32), (96, 64), (96, 64), (64, 96)]


def test_a_layers_fused_chains_feed_its_grouped_and_single_skinny_products():
    """The post-grad pass's rewrites in their order on one graph: the all-reduce chains
    fused first, then the one-row products that read their normed outputs grouped (q/k/v,
    gate/up) or single (o, down). Traced with Inductor's decompositions on fake CUDA
    tensors; run on the CPU, where the skinny ops are F.linear."""
    from torch._inductor.decomposition import select_decomp_table

    from cgcompile.build.post_grad import PostGradPass

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for shape in TP_LAYER_SHAPES]
        gm = make_fx(tp_layer, decomposition_table=select_decomp_table(), tracing_mode="fake")(*fake)
    original = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    assert fuse_all_reduce_norms(gm, find_all_reduce_norms(gm, ALL_REDUCE_OP), FUSED_OP) == 2
    rewrites = PostGradPass(skinny_linears=True)
    rewrites(gm)
    assert (rewrites.grouped_linears, rewrites.rewritten_linears) == (5, 7)
    gm.graph.lint()  # every node after its inputs
    fused = [n for n in gm.graph.nodes if n.target is FUSED_OP]
    grouped = [n for n in gm.graph.nodes if n.target is torch.ops.cgcompile.grouped_skinny_linear.default]
    assert [g.args[0].args[0] for g in grouped] == fused  # each group reads a fused chain's normed row
    for node in gm.graph.nodes:
        if node.target is FUSED_OP:
            node.target = stand_in_fused
    gm.recompile()
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator).to(torch.bfloat16) for shape in TP_LAYER_SHAPES]
    for got, want in zip(gm(*inputs), run(original, inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
