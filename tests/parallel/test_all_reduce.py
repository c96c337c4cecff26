"""The fast all-reduce: which groups, sizes, dtypes and reductions get symmetric memory and
which NCCL (pure), the rewrite on a Dynamo graph of functional collectives (one gloo rank),
the same rewrite on the aten graph inside Inductor (fake CUDA tensors), everything falling
back on 2 gloo ranks with eager's results (a DTensor layer's all-reduce found inside
Inductor), and on 2 GPUs the fast path inside captured pieces against NCCL."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from cgcompile.parallel.all_reduce_choice import (
    FAST, LAMPORT, LAMPORT_MAX_BYTES, NCCL, ONE_SHOT, ONE_SHOT_MAX_BYTES, TWO_SHOT, TWO_SHOT_MAX_BYTES, GroupFacts,
    choose_for_group, kind_for_call,
)
from cgcompile.build.compiler import PieceCompiler
from cgcompile.parallel.fast_all_reduce import route_compiled_all_reduces, route_graph_all_reduces
from cgcompile.build.post_grad import POST_GRAD_PASS, post_grad_pass
from cgcompile.parallel.inductor_all_reduce import RouteCompiledAllReduces
from cgcompile.parallel.symm_all_reduce import ALL_REDUCE_OP, FastGroup, GroupRegistry
from cgcompile.passes.fast_all_reduce import find_all_reduces, op_name, route_all_reduces
from parallel_launch import ROOT, torchrun, two_gpus

GOOD = GroupFacts("cuda", "nccl", 2, 1, True, None)


# -- the choice per group ------------------------------------------------------------------


@pytest.mark.parametrize("facts, configured, reason", [
    (GOOD, "nccl", "Config.all_reduce='nccl'"),
    (GroupFacts("cpu", "gloo", 2, 1, False, None), "auto", "tensors on cpu"),
    (GroupFacts("cuda", "gloo", 2, 1, True, None), "auto", "backend for cuda is gloo, not nccl"),
    (GroupFacts("cuda", "nccl", 1, 1, True, None), "auto", "a group of one rank"),
    (GroupFacts("cuda", "nccl", 16, 2, True, None), "auto", "ranks on 2 hosts"),
    (GroupFacts("cuda", "nccl", 2, 1, False, None), "auto", "no P2P access"),
    (GroupFacts("cuda", "nccl", 2, 1, True, "the symmetric-memory backend is NVSHMEM"), "auto", "NVSHMEM"),
])
def test_groups_the_fast_path_cannot_serve_get_nccl_with_the_reason(facts, configured, reason):
    choice = choose_for_group("tp", facts, configured=configured)
    assert choice.kind == NCCL and reason in choice.reason, choice


def test_nccl_ranks_on_one_host_with_p2p_get_symmetric_memory():
    choice = choose_for_group("tp", GroupFacts("cuda", "nccl", 4, 1, True, None))
    assert choice.kind == FAST and choice.world_size == 4
    assert "one-shot up to 512 KiB, two-shot up to 8 MiB, NCCL above" in str(choice)


# -- the choice per call -------------------------------------------------------------------

FAST_CHOICE = choose_for_group("tp", GOOD, configured="symm_mem")  # torch's kernels (the Lamport kernel: below)


@pytest.mark.parametrize("rows, dtype, reduce_op, kind, why", [
    (1, torch.bfloat16, "sum", ONE_SHOT, "8192 bytes"),  # a decode step's [1, 4096]
    (8, torch.bfloat16, "sum", ONE_SHOT, "65536 bytes"),
    (32, torch.float32, "sum", ONE_SHOT, f"bytes <= {ONE_SHOT_MAX_BYTES}"),  # exactly the one-shot limit
    (33, torch.float32, "sum", TWO_SHOT, "bytes <= "),
    (TWO_SHOT_MAX_BYTES // 8192, torch.bfloat16, "sum", TWO_SHOT, "bytes <= "),
    (TWO_SHOT_MAX_BYTES // 8192 + 1, torch.bfloat16, "sum", NCCL, "over the"),
    (1, torch.float16, "sum", NCCL, "torch.float16"),
    (1, torch.bfloat16, "max", NCCL, "sum only"),
])
def test_each_call_gets_one_shot_two_shot_or_nccl_by_size_dtype_and_reduction(rows, dtype, reduce_op, kind, why):
    got, reason = kind_for_call(FAST_CHOICE, reduce_op=reduce_op, dtype=dtype, numel=rows * 4096)
    assert got == kind and why in reason, (got, reason)


def test_sizes_the_kernels_cannot_split_evenly_get_nccl():
    assert kind_for_call(FAST_CHOICE, reduce_op="sum", dtype=torch.bfloat16, numel=3)[0] == NCCL  # 6 bytes
    assert kind_for_call(FAST_CHOICE, reduce_op="sum", dtype=torch.float32, numel=4, contiguous=False)[0] == NCCL
    big_odd = ONE_SHOT_MAX_BYTES // 4 + 4  # 16-byte multiple, but not 2 aligned shards
    assert kind_for_call(FAST_CHOICE, reduce_op="sum", dtype=torch.float32, numel=big_odd)[0] == NCCL


def test_a_group_on_nccl_sends_every_call_to_nccl():
    choice = choose_for_group("tp", GOOD, configured="nccl")
    assert kind_for_call(choice, reduce_op="sum", dtype=torch.bfloat16, numel=4096) == (NCCL, choice.reason)


# -- the Lamport kernel, part of "auto" ----------------------------------------------------

LAMPORT_CHOICE = choose_for_group("tp", GOOD, configured="auto")
TORCH_KERNELS_CHOICE = choose_for_group("tp", GOOD, configured="symm_mem")


def test_auto_takes_lamport_and_symm_mem_leaves_it_out_and_says_so():
    assert LAMPORT_CHOICE.kind == FAST and LAMPORT_CHOICE.lamport
    assert "Lamport up to 64 KiB, then one-shot up to 512 KiB" in str(LAMPORT_CHOICE)
    assert TORCH_KERNELS_CHOICE.kind == FAST and not TORCH_KERNELS_CHOICE.lamport
    assert TORCH_KERNELS_CHOICE.lamport_max_bytes == 0
    assert "no Lamport kernel (Config.all_reduce='symm_mem')" in str(TORCH_KERNELS_CHOICE)


@pytest.mark.parametrize("numel, dtype, reduce_op, aligned, kind, why", [
    (4096, torch.bfloat16, "sum", True, LAMPORT, "8192 bytes <= 65536"),  # a decode step's [1, 4096]
    (LAMPORT_MAX_BYTES // 2, torch.bfloat16, "sum", True, LAMPORT, "65536 bytes <= 65536"),
    (LAMPORT_MAX_BYTES // 4, torch.float32, "sum", True, LAMPORT, "65536 bytes"),
    (LAMPORT_MAX_BYTES // 2 + 8, torch.bfloat16, "sum", True, ONE_SHOT, "65552 bytes <= 524288"),
    (4096, torch.bfloat16, "sum", False, ONE_SHOT, "not 16-byte aligned: not Lamport"),
    (4096, torch.float16, "sum", True, NCCL, "torch.float16"),
    (4096, torch.bfloat16, "max", True, NCCL, "sum only"),
    (3, torch.bfloat16, "sum", True, NCCL, "not a multiple of 16"),
])
def test_lamport_takes_small_aligned_sums_and_leaves_the_rest(numel, dtype, reduce_op, aligned, kind, why):
    got, reason = kind_for_call(LAMPORT_CHOICE, reduce_op=reduce_op, dtype=dtype, numel=numel, aligned=aligned)
    assert got == kind and why in reason, (got, reason)


def test_symm_mem_keeps_one_shot_for_what_lamport_would_take():
    assert kind_for_call(TORCH_KERNELS_CHOICE, reduce_op="sum", dtype=torch.bfloat16, numel=4096)[0] == ONE_SHOT


def test_a_group_where_lamport_cannot_run_keeps_one_shot_with_the_reason():
    facts = GroupFacts("cuda", "nccl", 2, 1, True, None, "rank 1: triton cannot be imported (No module named 'triton')")
    choice = choose_for_group("tp", facts, configured="auto")
    assert choice.fast and not choice.lamport
    assert "Lamport off: rank 1: triton cannot be imported" in choice.reason
    assert kind_for_call(choice, reduce_op="sum", dtype=torch.bfloat16, numel=4096)[0] == ONE_SHOT
    nccl_group = choose_for_group("tp", GroupFacts("cuda", "nccl", 2, 2, True, None), configured="auto")
    assert nccl_group.kind == NCCL and not nccl_group.lamport and "2 hosts" in nccl_group.reason


def test_config_takes_symm_mem_and_suggests_it_for_a_typo():
    from cgcompile import Config
    from cgcompile.errors import ConfigError

    assert Config(all_reduce="symm_mem").rewrites.all_reduce == "symm_mem"
    with pytest.raises(ConfigError, match="symm_mem"):
        Config(all_reduce="symm_men")


def test_a_later_set_up_asking_for_another_fast_path_is_told_the_group_kept_its_first_choice(caplog):
    from cgcompile.parallel.distributed import _warn_set_up_before

    with one_gloo_rank(), caplog.at_level("WARNING", logger="cgcompile.parallel.distributed"):
        _warn_set_up_before(LAMPORT_CHOICE, "auto")
        _warn_set_up_before(TORCH_KERNELS_CHOICE, "symm_mem")
        _warn_set_up_before(LAMPORT_CHOICE, "nccl")
        assert not caplog.records
        _warn_set_up_before(LAMPORT_CHOICE, "symm_mem")
    assert "all_reduce='symm_mem' asked for group 'tp', which was set up earlier" in caplog.text


# -- the rewrite on a Dynamo graph ---------------------------------------------------------


@contextlib.contextmanager
def one_gloo_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def tensor_parallel_layer(x, w, group):
    y = funcol.all_reduce(x @ w, "sum", group)  # row-parallel linear
    peak = funcol.all_reduce(y, "max", group)  # left alone: not a sum
    z = torch.relu(y) + peak
    dist.all_reduce(z, group=group)  # traced as a functional all-reduce, wait and copy_
    return z * 2


def dynamo_graph(fn, *args):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def test_the_rewrite_routes_sum_pairs_and_leaves_the_others():
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    with one_gloo_rank() as group:
        gm = dynamo_graph(tensor_parallel_layer, x, w, group)
        sites = find_all_reduces(gm)
        assert [(s.reduce_op, s.blocker is None) for s in sites] == [("sum", True), ("max", False), ("sum", True)]
        assert all(s.wait is not None and s.group_name == group.group_name for s in sites)
        assert "only sums" in sites[1].blocker
        assert route_all_reduces(gm, sites, ALL_REDUCE_OP) == 2
        ops = [op_name(n) for n in gm.graph.nodes]
        assert ops.count("cgcompile::all_reduce") == 2
        assert ops.count("_c10d_functional::wait_tensor") == 1  # the max's
        # On gloo the routed op is the group's own all-reduce: the same result as eager.
        torch.testing.assert_close(gm(x, w)[0], tensor_parallel_layer(x, w, group))


def test_graphs_off_cuda_keep_their_collectives_with_the_reason():
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    with one_gloo_rank() as group:
        gm = dynamo_graph(tensor_parallel_layer, x, w, group)
        before = gm.code
        records = route_graph_all_reduces(gm, torch.device("cpu"), configured="auto")
        assert gm.code == before
        assert [r.kind for r in records] == [NCCL] * 3
        assert [records[0].reason, records[2].reason] == ["the graph runs on cpu"] * 2
        assert "only sums" in records[1].reason  # the site's own blocker comes first
        nccl = route_graph_all_reduces(gm, torch.device("cuda"), configured="nccl")
        assert [r.reason for r in nccl][0] == "Config.all_reduce='nccl'"
        assert "[3, 8] torch.float32 on group" in str(records[0])


def test_an_input_that_requires_grad_is_not_routed():
    x, w = torch.randn(3, 8), torch.randn(8, 8, requires_grad=True)
    with one_gloo_rank() as group:
        gm = dynamo_graph(lambda x, w: funcol.all_reduce(x @ w, "sum", group), x, w)
        assert "requires grad" in find_all_reduces(gm)[0].blocker


# -- the rewrite on the aten graph inside Inductor ----------------------------------------


def aten_graph(group, device="cuda", dtype=torch.bfloat16):
    """The aten graph of a row-parallel layer, traced on fake tensors (no GPU needed)."""
    def layer(x, w):
        return funcol.all_reduce(x @ w, "sum", group) + 1

    with FakeTensorMode():
        x, w = torch.empty(3, 8, device=device, dtype=dtype), torch.empty(8, 8, device=device, dtype=dtype)
        return make_fx(layer)(x, w)


def test_aten_all_reduces_follow_the_recorded_choice_of_their_group():
    registry = GroupRegistry()
    with one_gloo_rank() as group:
        unset = route_compiled_all_reduces(aten_graph(group), registry.choice_of)
        assert [(r.kind, r.level) for r in unset] == [(NCCL, "inductor")]
        assert "not set up before the compile" in unset[0].reason
        registry.add(FastGroup(choose_for_group(group.group_name, GOOD), {}))
        gm = aten_graph(group)
        RouteCompiledAllReduces(registry)(gm.graph)  # as Inductor calls it
        ops = [op_name(n) for n in gm.graph.nodes]
        assert ops.count("cgcompile::all_reduce") == 1 and "_c10d_functional::wait_tensor" not in ops, gm.code
        half = route_compiled_all_reduces(aten_graph(group, dtype=torch.float16), registry.choice_of)
        assert half[0].kind == NCCL and "torch.float16" in half[0].reason
        on_cpu = route_compiled_all_reduces(aten_graph(group, device="cpu"), registry.choice_of)
        assert on_cpu[0].kind == NCCL and "its input is on cpu" in on_cpu[0].reason


def test_the_inductor_pass_keys_the_cache_by_the_recorded_choices():
    registry = GroupRegistry()
    before = RouteCompiledAllReduces(registry)
    uuid, name = before.uuid(), repr(before)
    registry.add(FastGroup(choose_for_group("tp", GOOD), {}))
    assert before.uuid() != uuid and repr(before) != name
    assert "0x" not in repr(before)  # no address: cgcompile's compile keys hold it


def test_pieces_compile_with_the_pass_unless_all_reduce_is_nccl():
    assert isinstance(PieceCompiler("inductor", all_reduce="auto").post_grad_pass.all_reduces, RouteCompiledAllReduces)
    assert PieceCompiler("inductor", all_reduce="nccl").post_grad_pass is None
    mine = RouteCompiledAllReduces(GroupRegistry())
    assert post_grad_pass({POST_GRAD_PASS: mine}, "auto") is None  # the user's own pass is kept


def test_the_pass_is_in_inductors_config_during_a_piece_compile_only():
    import torch._inductor.config as inductor_config

    seen = []
    compiler = PieceCompiler("inductor", all_reduce="auto")
    compiler._inductor(lambda: seen.append(getattr(inductor_config, POST_GRAD_PASS)))
    assert seen == [compiler.post_grad_pass]
    assert getattr(inductor_config, POST_GRAD_PASS) is not compiler.post_grad_pass


# -- 2 ranks ------------------------------------------------------------------------------


def test_on_two_gloo_ranks_everything_falls_back_and_equals_eager():
    out = torchrun(ROOT / "tests" / "parallel" / "all_reduce_worker.py", timeout=400)
    for rank in (0, 1):
        assert f"rank {rank}: gloo falls back: ok" in out, out
        assert f"rank {rank}: routed op equals eager: ok" in out, out
        assert f"rank {rank}: dtensor all-reduce routed inside inductor: ok" in out, out
        assert f"rank {rank}: fused norm op falls back: ok" in out, out


@pytest.mark.cuda
@two_gpus
def test_cuda_fast_all_reduce_in_captured_pieces_equals_nccl():
    out = torchrun(ROOT / "tests" / "parallel" / "all_reduce_cuda_worker.py", timeout=400)
    for rank in (0, 1):
        assert f"rank {rank}: fast path chosen: ok" in out, out
        assert f"rank {rank}: captured sizes equal nccl: ok" in out, out
        assert f"rank {rank}: tensor-parallel decoder equals nccl: ok" in out, out
        assert f"rank {rank}: dtensor layers fast inside inductor: ok" in out, out
