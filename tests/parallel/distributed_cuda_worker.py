"""GPU checks on 2 ranks over NCCL (run by tests/parallel/test_distributed.py under torchrun):
the all-reduces of a tensor-parallel model are captured inside the pieces' CUDA graphs,
and a pipeline stage's graphs read its intermediate buffers in place."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.parallel.distributed import prepare_collectives, torchrun_worker  # noqa: E402
from cgcompile.parallel.pipeline import PipelineStage, TensorSpec, stage_layers  # noqa: E402
from cgcompile.testing.decode_model import MODEL_CONFIGS, Llama  # noqa: E402
from cgcompile.testing.parallel_model import StageDecoder, TensorParallelDecoder  # noqa: E402

CFG = MODEL_CONFIGS["tiny"]


def llama(device):
    torch.manual_seed(0)
    model = Llama(CFG).to(device)
    model.fill_caches(8)
    return model


def all_reduces_captured(device):
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=["cgbench::decode_attention"], capture_sizes=(1, 2, 4),
                                                 capture_error_mode="thread_local"))
    model = TensorParallelDecoder(llama(device))
    compiled = torch.compile(model, backend=backend)
    prepare_collectives(device)
    ids = torch.arange(3, device=device)
    for start in (8, 9, 10):
        out = compiled(ids, start)
    reference = model(ids, 10)  # eager, same caches: position 10 rewritten with the same k, v
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    eager_with_collectives = [p.name for p in backend.pieces if not p.capturable and "all_reduce" in p.graph.code]
    assert not eager_with_collectives, eager_with_collectives
    assert backend.stats.graphs_captured > 0, backend.stats
    return "all-reduces captured"


def buffers_read_in_place(device):
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=["cgbench::decode_attention"], capture_sizes=(1, 2, 4), capture_error_mode="thread_local",
                                                 reuse_output_buffers=True))
    model = StageDecoder(llama(device), stage_layers(CFG.layers, world, rank))
    compiled = torch.compile(model, backend=backend)
    hidden = {"hidden": TensorSpec((CFG.hidden,), torch.float32)}
    stage = PipelineStage(receives=hidden if rank == 1 else {}, sends=hidden if rank == 0 else {},
                          max_rows=4, device=device, backend=backend)
    stage.connect()
    ids = torch.arange(4, device=device)
    for start in (8, 9, 10):
        if rank == 0:
            stage.exchange({"hidden": compiled(ids, start, 0)}, None)
        else:
            x = stage.exchange(None, 4)["hidden"]
            tokens = compiled(x, start, 0)
    if rank == 1:
        address = stage.buffers["hidden"].data_ptr()
        first_inputs = [a for r in backend._graph_runners() for g in r.graphs.values() for a in g.addresses if a]
        assert any(a[0] == address for a in first_inputs), "no graph reads the intermediate buffer in place"
        assert tokens.shape == (4,)
    return "buffers read in place"


if __name__ == "__main__":
    with torchrun_worker("cuda") as device, torch.inference_mode():
        for check in (all_reduces_captured, buffers_read_in_place):
            print(f"rank {dist.get_rank()}: {check(device)}: ok", flush=True)
