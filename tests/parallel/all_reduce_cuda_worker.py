"""The fast all-reduce on 2 GPUs over NCCL (run by tests/parallel/test_all_reduce.py under
torchrun): the group gets symmetric memory; all-reduces routed into captured pieces equal
NCCL's at Lamport, one-shot, two-shot and over-threshold sizes, replay after replay; a compiled
tensor-parallel decoder gives the same logits with the fast path as with NCCL; a DTensor
MLP (`parallelize_module`) has its all-reduce routed inside Inductor's aten graph, captured,
equal to eager."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.parallel.all_reduce_choice import FAST, LAMPORT, NCCL, ONE_SHOT, TWO_SHOT, TWO_SHOT_MAX_BYTES  # noqa: E402
from cgcompile.parallel.distributed import prepare_collectives, setup_all_reduce, torchrun_worker  # noqa: E402
from cgcompile.parallel.fast_all_reduce import all_reduce_report  # noqa: E402
from cgcompile.testing.parallel_model import TensorParallelDecoder, seeded_llama  # noqa: E402

HIDDEN = 4096
# [1, 4096] and [8, 4096] bf16 go one-shot, [256, 4096] (2 MiB) two-shot, and one row past
# the symmetric buffer (8 MiB) NCCL.
SIZES = (1, 8, 64, 256, TWO_SHOT_MAX_BYTES // (2 * HIDDEN) + 8)  # Lamport, Lamport, one-shot, two-shot, NCCL


def fast_path_chosen(device):
    prepare_collectives(device)
    choice = setup_all_reduce(device)
    assert choice.fast, f"expected the fast path on 2 GPUs of one host, got {choice}"
    return "fast path chosen"


def reduce_layer(x):  # x: [T, 4096] bf16
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def rank_values(rows, seed, device):
    """Small integers: every sum is exact in bf16, so the paths must agree bit for bit."""
    generator = torch.Generator(device="cpu").manual_seed(seed * 10 + dist.get_rank())
    return torch.randint(-8, 8, (rows, HIDDEN), generator=generator).to(device, torch.bfloat16)


def captured_sizes_equal_nccl(device):
    backend = cgcompile.Backend(cgcompile.Config(capture_sizes=SIZES, capture_error_mode="thread_local"))
    compiled = torch.compile(reduce_layer, backend=backend)
    for seed in range(3):  # later calls replay: the same buffers, new data
        for rows in SIZES:
            x = rank_values(rows, seed, device)
            if rows > 1:  # the rows dim dynamic, the hidden one fixed (Dynamo specializes 1)
                torch._dynamo.mark_dynamic(x, 0)
            expected = x * 2
            dist.all_reduce(expected)
            torch.testing.assert_close(compiled(x), expected + 1, rtol=0, atol=0)
    assert backend.stats.graphs_captured >= len(SIZES), backend.stats
    assert all(p.capturable for p in backend.pieces), [p.reason for p in backend.pieces]
    assert any("cgcompile.all_reduce" in p.graph.code for p in backend.pieces), "the all-reduce was not routed"
    calls = all_reduce_report().calls[dist.group.WORLD.group_name]
    assert calls.get(LAMPORT) and calls.get(ONE_SHOT) and calls.get(TWO_SHOT) and calls.get(NCCL), calls
    return "captured sizes equal nccl"


def decoder_logits(device, all_reduce):
    torch._dynamo.reset()
    backend = cgcompile.Backend(cgcompile.Config(
        splitting_ops=["cgbench::decode_attention"], capture_sizes=(1, 2, 4), capture_error_mode="thread_local",
        all_reduce=all_reduce))
    compiled = torch.compile(TensorParallelDecoder(seeded_llama("tiny", device, 8)), backend=backend)
    ids = torch.arange(3, device=device)
    return [compiled(ids, start) for start in (8, 9, 10)], backend


def tensor_parallel_decoder_equals_nccl(device):
    fast, backend = decoder_logits(device, "auto")
    nccl, _ = decoder_logits(device, "nccl")
    for a, b in zip(fast, nccl):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert any("cgcompile.all_reduce" in p.graph.code for p in backend.pieces if p.capturable)
    return "tensor-parallel decoder equals nccl"


def fast_kind_calls(group: str) -> int:
    """The group's all-reduce calls that took a kernel of the fast path (any but NCCL)."""
    return sum(n for kind, n in all_reduce_report().calls.get(group, {}).items() if kind != NCCL)


def dtensor_layers_fast_inside_inductor(device):
    torch._dynamo.reset()
    torch.manual_seed(0)  # the same weights on every rank
    with torch.inference_mode(False):  # parameters, not inference tensors
        mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.ReLU(),
                                  torch.nn.Linear(2 * HIDDEN, HIDDEN)).to(device, torch.bfloat16)
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
        mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    group = mesh.get_group().group_name
    fast_calls = fast_kind_calls(group)
    backend = cgcompile.Backend(cgcompile.Config(capture_sizes=(1, 2, 4), capture_error_mode="thread_local"))
    compiled = torch.compile(mlp, backend=backend)
    with torch._inductor.config.patch(force_disable_caches=True):  # the pass runs (and records) every compile
        for rows in (1, 2, 4, 1, 2):  # the same input on every rank (a replicated activation)
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(device, torch.bfloat16)
            torch.testing.assert_close(compiled(x), mlp(x), rtol=2e-2, atol=2e-2)
    inside = [r for r in all_reduce_report().sites if r.level == "inductor"]
    assert inside and all(r.kind == FAST for r in inside), [str(r) for r in inside]
    assert backend.stats.graphs_captured, backend.stats
    assert fast_kind_calls(group) > fast_calls, all_reduce_report().calls  # rows of 1 to 4: Lamport
    return "dtensor layers fast inside inductor"


if __name__ == "__main__":
    with torchrun_worker("cuda") as device, torch.inference_mode():
        for check in (fast_path_chosen, captured_sizes_equal_nccl, tensor_parallel_decoder_equals_nccl,
                      dtensor_layers_fast_inside_inductor):
            print(f"rank {dist.get_rank()}: {check(device)}: ok", flush=True)
        for line in all_reduce_report().lines():
            print(f"rank {dist.get_rank()}: {line}", flush=True)
