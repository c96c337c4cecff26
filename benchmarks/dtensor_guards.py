"""What Dynamo's guards cost per call when a model's parameters are DTensor shards.

A `tp_plan="auto"` model calls its compiled forward with every parameter a DTensor, and
Dynamo checks each one's DTensor spec in a Python guard (`DTENSOR_SPEC_MATCH`) at every
call. This times the guard evaluation and frame entry alone: a backend that returns the
first call's outputs, so no graph runs. Three variants of one stack of MLP blocks:

  plain            parameters are plain tensors
  dtensor          parameters sharded with `parallelize_module` on a 1-rank mesh
  dtensor-nospec   the same, compiled with a `guard_filter_fn` that drops the DTensor spec
                   guards (a measurement only: nothing checks the specs then)

    python benchmarks/dtensor_guards.py --layers 8,32          # CPU, gloo, one rank
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def mlp_stack(layers: int, sharded: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU(),
                                  torch.nn.Linear(128, 64, bias=False)) for _ in range(layers)]
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in blocks:
            parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return torch.nn.Sequential(*blocks)


def replay_first_outputs(gm, example_inputs):
    """A backend that runs the graph once and hands its outputs back at every call."""
    outputs = gm(*example_inputs)
    return lambda *args: outputs


def without_dtensor_spec_guards(entries) -> list[bool]:
    return [entry.guard_type != "DTENSOR_SPEC_MATCH" for entry in entries]


def us_per_call(model: torch.nn.Module, guard_filter, calls: int) -> float:
    torch._dynamo.reset()
    options = {"guard_filter_fn": guard_filter} if guard_filter else None
    compiled = torch.compile(model, backend=replay_first_outputs, options=options)
    x = torch.randn(1, 64)
    with torch.no_grad():
        for _ in range(5):
            compiled(x)
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                compiled(x)
            runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="8,32", help="MLP blocks (two linears each), comma-separated")
    p.add_argument("--calls", type=int, default=300, help="calls per timed run (median of 5 runs)")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(f"{'layers':>6} {'params':>6} {'plain us':>9} {'dtensor us':>11} {'dtensor-nospec us':>18}")
        for layers in (int(n) for n in args.layers.split(",")):
            plain = us_per_call(mlp_stack(layers, sharded=False), None, args.calls)
            sharded = mlp_stack(layers, sharded=True)
            dtensor = us_per_call(sharded, None, args.calls)
            nospec = us_per_call(sharded, without_dtensor_spec_guards, args.calls)
            print(f"{layers:>6} {2 * layers:>6} {plain:>9.1f} {dtensor:>11.1f} {nospec:>18.1f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
