"""The all-reduce fused with the residual add and RMS norm on 2 GPUs (run by
tests/parallel/test_all_reduce_norm.py under torchrun, whose time limit turns a deadlock into a
failure): eager calls of every size class (the fused kernel's, and those it leaves to the
unfused ops) against NCCL's sum and the unfused ops; fused calls inside two CUDA graphs
replayed in alternating orders, between plain Lamport all-reduces and eager calls; and a
compiled tensor-parallel block with one-row products folded into the fused call against the
same block under the default Config (fused, no fold) and with the fusion off."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.parallel.all_reduce_norm import (  # noqa: E402
    LAMPORT_ADD_RMS_NORM, LAMPORT_LINEAR_ADD_RMS_NORM, add_rms_norm,
)
from cgcompile.parallel.distributed import prepare_collectives, setup_all_reduce, torchrun_worker  # noqa: E402
from cgcompile.testing.decode_model import RMSNorm  # noqa: E402
from lamport_cuda_worker import calls, capture, group_name, lamport, nccl, rank_values  # noqa: E402

EPS = 1e-5
# (rows, hidden, dtype, fused?): the kernel takes up to 8 rows, hidden up to 8192, 64 KiB.
SHAPES = ((1, 4096, torch.bfloat16, True), (8, 4096, torch.bfloat16, True), (3, 2048, torch.bfloat16, True),
          (1, 8192, torch.bfloat16, True), (4, 24, torch.bfloat16, True), (2, 4096, torch.float32, True),
          (16, 1024, torch.bfloat16, False), (2, 16384, torch.bfloat16, False), (8, 4096, torch.float32, False))


def fused(x, residual, weight):
    return torch.ops.cgcompile.all_reduce_add_rms_norm(x, residual, weight, EPS, group_name())


def operands(rows, hidden, dtype, seed, device):
    """x of small integers (exact sums: NCCL's and the kernel's agree bit for bit), a residual
    and a weight as the model has them (replicated: the same on every rank)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(device, dtype)
    return rank_values(rows, hidden, dtype, seed, device), residual, weight


def unfused(x, residual, weight):
    return add_rms_norm(nccl(x), residual, weight, EPS)


def assert_same(got, want, msg=""):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, msg=f"{msg}: sum")  # same roundings
    torch.testing.assert_close(got[1], want[1], msg=f"{msg}: norm")  # the norm's sum in another order


def fused_eager_calls_equal_the_unfused_ops(device):
    prepare_collectives(device, all_reduce="auto")
    assert setup_all_reduce(device).lamport
    before = calls(LAMPORT_ADD_RMS_NORM)
    for seed in range(3):
        for rows, hidden, dtype, _ in SHAPES:
            args = operands(rows, hidden, dtype, seed, device)
            assert_same(fused(*args), unfused(*args), f"{rows}x{hidden} {dtype}")
    taken = sum(1 for *_, f in SHAPES if f)
    assert calls(LAMPORT_ADD_RMS_NORM) - before == 3 * taken, calls(LAMPORT_ADD_RMS_NORM)
    return "fused eager calls equal the unfused ops"


def chain(x, residual, weight, count):
    """`count` fused calls, each on other data, with a plain Lamport all-reduce between."""
    outs = []
    for i in range(count):
        total, normed = fused(x + i, residual, weight)
        outs += [total, normed, lamport(x - i)]
    return torch.stack(outs)


def expected_chain(x, residual, weight, count):
    outs = []
    for i in range(count):
        outs += [*unfused(x + i, residual, weight), nccl(x - i)]
    return torch.stack(outs)


def fused_calls_in_graphs_replayed_in_any_order(device):
    graphs = {}
    for name, rows, count in (("small", 1, 5), ("large", 8, 7)):
        static = operands(rows, 4096, torch.bfloat16, rows, device)
        graphs[name] = (*capture(chain, *static, count), static, count)
    order = ["small", "large", "large", "small", "eager", "large", "small", "small", "eager", "large", "large"]
    for step, name in enumerate(order):
        if name == "eager":
            args = operands(2, 4096, torch.bfloat16, step, device)
            assert_same(fused(*args), unfused(*args), f"step {step}")
            continue
        graph, out, static, count = graphs[name]
        for buffer, new in zip(static, operands(*static[0].shape, torch.bfloat16, 100 + step, device)):
            buffer.copy_(new)
        graph.replay()
        want = expected_chain(*static, count)
        for i in range(0, len(want), 3):
            assert_same(out[i:i + 2], want[i:i + 2], f"step {step}: {name}, call {i // 3}")
            torch.testing.assert_close(out[i + 2], want[i + 2], rtol=0, atol=0)
    for graph, *_ in graphs.values():
        graph.reset()
    return "fused calls in graphs replayed in any order"


class Block(torch.nn.Module):
    """A row-parallel projection, its all-reduce, the residual add and the next norm, twice."""

    def __init__(self, hidden, device):
        super().__init__()
        torch.manual_seed(dist.get_rank())  # each rank's shard
        self.down = torch.nn.Linear(hidden // 2, hidden, bias=False, device=device, dtype=torch.bfloat16)
        torch.manual_seed(0)  # replicated
        self.up = torch.nn.Linear(hidden, hidden // 2, bias=False, device=device, dtype=torch.bfloat16)
        self.norms = torch.nn.ModuleList(RMSNorm(hidden, EPS).to(device, torch.bfloat16) for _ in range(2))
        for norm in self.norms:
            torch.nn.init.normal_(norm.weight, 1.0, 0.1)

    def forward(self, x, residual):
        for norm in self.norms:
            residual = funcol.all_reduce(self.down(x), "sum", dist.group.WORLD) + residual
            x = self.up(norm(residual))
        return residual, x


def compiled_layers_fuse_and_equal_the_unfused_compile(device):
    """The block compiled three ways: a one-row product folded into the fused call after it
    (`Config.fuse_linear_all_reduce`, `linear_all_reduce_add_rms_norm`), the default (fused,
    no fold), the fusion off. The
    folded calls equal the fused ones bit for bit (the same product kernel's rounding, the
    same sum), and both the unfused compile to rounding."""
    block = Block(2048, device)
    configs = {"folded": {"fuse_linear_all_reduce": True}, "fused": {}, "unfused": {"fuse_all_reduce_norm": False}}
    results, ran = {}, {}
    for name, options in configs.items():
        torch._dynamo.reset()
        config = cgcompile.Config(capture_sizes=(1, 8), capture_error_mode="thread_local", **options)
        compiled = torch.compile(block, backend=cgcompile.Backend(config), dynamic=True)
        before = (calls(LAMPORT_ADD_RMS_NORM), calls(LAMPORT_LINEAR_ADD_RMS_NORM))
        results[name] = []
        for rows in (1, 3, 8, 1):
            generator = torch.Generator(device="cpu").manual_seed(rows)
            x = torch.randn(rows, 1024, generator=generator).to(device, torch.bfloat16)
            residual = torch.randn(rows, 2048, generator=generator).to(device, torch.bfloat16)
            results[name].append([t.clone() for t in compiled(x, residual)])
        ran[name] = (calls(LAMPORT_ADD_RMS_NORM) - before[0], calls(LAMPORT_LINEAR_ADD_RMS_NORM) - before[1])
    assert ran["folded"][1] > 0 and ran["fused"][0] > 0 and ran["fused"][1] == 0, ran
    assert ran["unfused"] == (0, 0), ran
    for folded, fused, unfused in zip(results["folded"], results["fused"], results["unfused"]):
        for got, want in zip(folded, fused):
            assert torch.equal(got, want), (got - want).abs().max()
        torch.testing.assert_close(fused[0], unfused[0], atol=4e-2, rtol=4e-2)
        torch.testing.assert_close(fused[1], unfused[1], atol=4e-2, rtol=4e-2)
    return "compiled layers fuse and equal the unfused compile"


if __name__ == "__main__":
    with torchrun_worker("cuda") as device, torch.inference_mode():
        for check in (fused_eager_calls_equal_the_unfused_ops, fused_calls_in_graphs_replayed_in_any_order,
                      compiled_layers_fuse_and_equal_the_unfused_compile):
            print(f"rank {dist.get_rank()}: {check(device)}: ok", flush=True)
