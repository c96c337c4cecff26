"""The Lamport all-reduce on 2 GPUs (run by tests/parallel/test_lamport_all_reduce.py under
torchrun, whose time limit turns a deadlock into a failure): the group set up with
all_reduce="auto" (the default) gets the kernel; eager calls, messages of -0.0, one CUDA graph of 64
all-reduces replayed with new data, and two graphs replayed in alternating orders with
eager calls between (the phase hazard: phases live on the device) all equal NCCL's sums;
so do compiled pieces under the default Config."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.parallel.all_reduce_choice import LAMPORT, ONE_SHOT  # noqa: E402
from cgcompile.parallel.distributed import prepare_collectives, setup_all_reduce, torchrun_worker  # noqa: E402
from cgcompile.parallel.symm_all_reduce import GROUPS  # noqa: E402

# (rows, hidden, dtype): one to all 8 programs, a partial program, fp32; [64, 4096] bf16
# (512 KiB) is over the Lamport limit and goes one-shot.
EAGER = ((1, 4096, torch.bfloat16), (8, 4096, torch.bfloat16), (64, 256, torch.bfloat16), (1, 24, torch.bfloat16),
         (1, 4096, torch.float32), (4, 4096, torch.float32), (64, 4096, torch.bfloat16))


def group_name() -> str:
    return dist.group.WORLD.group_name


def lamport(x):
    return torch.ops.cgcompile.all_reduce(x, "sum", group_name())


def nccl(x):
    expected = x.clone()
    dist.all_reduce(expected)
    return expected


def rank_values(rows, hidden, dtype, seed, device):
    """Small integers: every sum is exact, so the paths must agree bit for bit (but for -0.0)."""
    generator = torch.Generator(device="cpu").manual_seed(seed * 10 + dist.get_rank())
    return torch.randint(-8, 8, (rows, hidden), generator=generator).to(device, dtype)


def calls(kind) -> int:
    return GROUPS.get(group_name()).calls[kind]


def lamport_chosen(device):
    prepare_collectives(device, all_reduce="auto")
    choice = setup_all_reduce(device)
    assert choice.lamport, f"expected the Lamport kernel on 2 GPUs of one host with triton, got {choice}"
    assert set(GROUPS.get(group_name()).lamport) == set(choice.dtypes)
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    for buffer in GROUPS.get(group_name()).lamport.values():  # every test below runs launched so
        assert buffer._constants["PDL"] == hopper and buffer._constants.get("launch_pdl", False) == hopper
    return "lamport chosen"


def eager_calls_equal_nccl(device):
    before = calls(LAMPORT), calls(ONE_SHOT)
    for seed in range(3):
        for rows, hidden, dtype in EAGER:
            x = rank_values(rows, hidden, dtype, seed, device)
            torch.testing.assert_close(lamport(x), nccl(x), rtol=0, atol=0)
    assert calls(LAMPORT) - before[0] == 3 * (len(EAGER) - 1), GROUPS.get(group_name()).calls
    assert calls(ONE_SHOT) - before[1] == 3, GROUPS.get(group_name()).calls
    return "eager calls equal nccl"


def negative_zeros_equal_nccl(device):
    x = torch.full((1, 4096), -0.0, device=device, dtype=torch.bfloat16)  # every element the sentinel's bits
    got = lamport(x)
    torch.testing.assert_close(got, nccl(x), rtol=0, atol=0)
    assert not bool(torch.signbit(got).any()), "a sum of -0.0 is +0.0 (the kernel publishes +0.0)"
    mixed = rank_values(8, 4096, torch.bfloat16, 7, device)
    mixed[:, ::3] = -0.0
    torch.testing.assert_close(lamport(mixed), nccl(mixed), rtol=0, atol=0)
    return "negative zeros equal nccl"


def capture(fn, *args):
    """fn(*args) captured in a CUDA graph after one warm-up on a side stream; (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def chain(x, count):
    """`count` all-reduces, each of other data: x + i sums to sum(x) + world * i."""
    return torch.stack([lamport(x + i) for i in range(count)])


def expected_chain(x, count):
    world = dist.get_world_size()
    steps = torch.arange(count, device=x.device, dtype=torch.float32).view(-1, *([1] * x.dim())) * world
    return (nccl(x).float() + steps).to(x.dtype)


def one_graph_of_64_replayed_equals_nccl(device):
    static = rank_values(1, 4096, torch.bfloat16, 0, device)
    graph, out = capture(chain, static, 64)
    before = calls(LAMPORT)
    for seed in range(5):
        static.copy_(rank_values(1, 4096, torch.bfloat16, seed, device))
        graph.replay()
        torch.testing.assert_close(out, expected_chain(static, 64), rtol=0, atol=0)
    assert calls(LAMPORT) == before, "a replay runs no Python"
    graph.reset()
    return "one graph of 64 replayed equals nccl"


def two_graphs_alternating_equal_nccl(device):
    """5 and 7 calls a replay (neither a multiple of the phases) of two sizes, in an order
    that a phase baked in at capture would get wrong, with eager calls between."""
    small = rank_values(1, 4096, torch.bfloat16, 1, device)
    large = rank_values(8, 4096, torch.bfloat16, 2, device)
    graphs = {"small": (*capture(chain, small, 5), small, 5), "large": (*capture(chain, large, 7), large, 7)}
    for step, name in enumerate(["small", "large", "large", "small", "eager", "large", "small", "small", "eager",
                                 "large", "small", "large", "large", "large"]):
        if name == "eager":
            x = rank_values(2, 4096, torch.bfloat16, step, device)
            torch.testing.assert_close(lamport(x), nccl(x), rtol=0, atol=0)
            continue
        graph, out, static, count = graphs[name]
        static.copy_(rank_values(*static.shape, static.dtype, step, device))
        graph.replay()
        torch.testing.assert_close(out, expected_chain(static, count), rtol=0, atol=0, msg=f"step {step}: {name}")
    for graph, *_ in graphs.values():
        graph.reset()
    return "two graphs alternating equal nccl"


def reduce_layer(x):  # x: [T, 4096] bf16
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def compiled_pieces_equal_nccl(device):
    torch._dynamo.reset()
    config = cgcompile.Config(capture_sizes=(1, 8), capture_error_mode="thread_local")
    backend = cgcompile.Backend(config)
    compiled = torch.compile(reduce_layer, backend=backend)
    before = calls(LAMPORT)
    for seed in range(3):
        for rows in (1, 8):
            x = rank_values(rows, 4096, torch.bfloat16, seed, device)
            if rows > 1:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), nccl(x * 2) + 1, rtol=0, atol=0)
    assert backend.stats.graphs_captured >= 2, backend.stats
    assert calls(LAMPORT) > before, GROUPS.get(group_name()).calls
    return "compiled pieces equal nccl"


if __name__ == "__main__":
    with torchrun_worker("cuda") as device, torch.inference_mode():
        for check in (lamport_chosen, eager_calls_equal_nccl, negative_zeros_equal_nccl,
                      one_graph_of_64_replayed_equals_nccl, two_graphs_alternating_equal_nccl,
                      compiled_pieces_equal_nccl):
            print(f"rank {dist.get_rank()}: {check(device)}: ok", flush=True)
