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

`--hf` times a transformers Llama's decode call the same way (a tiny shape, `--layers`
decoder layers, a `StaticCache`), loaded whole and with `tp_plan="auto"` over 2 gloo ranks
(transformers shards nothing on one), rank 0 printing. The DTensor model's variants drop
the spec guards (as cgcompile's default does), and then also Dynamo's guards on torch.nn's
own modules (`torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe`: unsound where the
program changes such a module's attributes); the whole model gets that filter too:

    torchrun --nproc-per-node 2 benchmarks/dtensor_guards.py --hf --layers 8,16

`--guard-kinds` then lists, for the `tp_plan` model with the spec guards dropped, the guards
that filter would take out: by guard type and by what they read (module paths folded).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from collections import Counter

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


def without_spec_and_inbuilt_module_guards(entries) -> list[bool]:
    keep_modules = torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe(entries)
    return [keep and spec for keep, spec in zip(keep_modules, without_dtensor_spec_guards(entries))]


def median_us(call, calls: int, timed: bool = True) -> float:
    """us per call() (no grad): 5 untimed calls, then the median of 5 runs of `calls` calls;
    with `timed` False only the untimed calls (nan)."""
    runs = []
    with torch.no_grad():
        for _ in range(5):
            call()
        for _ in range(5 if timed else 0):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs) if runs else float("nan")


def us_per_call(model: torch.nn.Module, guard_filter, calls: int) -> float:
    torch._dynamo.reset()
    options = {"guard_filter_fn": guard_filter} if guard_filter else None
    compiled = torch.compile(model, backend=replay_first_outputs, options=options)
    x = torch.randn(1, 64)
    return median_us(lambda: compiled(x), calls)


def hf_us_per_call(model, guard_filter, calls: int, timed: bool = True) -> float:
    """Host us of one decode call of a transformers model (the guards and the frame: the
    backend replays the first call's outputs), timed on rank 0 while the others wait (the
    first call runs the graph, collectives and all, on every rank)."""
    from transformers import StaticCache

    torch._dynamo.reset()
    options = {"guard_filter_fn": guard_filter} if guard_filter else None
    forward = torch.compile(model.forward, backend=replay_first_outputs, options=options)
    cache = StaticCache(config=model.config, max_cache_len=64)
    token, position = torch.ones(1, 1, dtype=torch.long), torch.tensor([8])

    def call():
        return forward(input_ids=token, past_key_values=cache, cache_position=position, logits_to_keep=1)

    us = median_us(call, calls, timed=timed and dist.get_rank() == 0)
    dist.barrier()
    return us


def nn_guard_kinds(model, top: int = 8) -> list[str]:
    """What `skip_guard_on_inbuilt_nn_modules_unsafe` would take out of `model`'s decode frame
    (spec guards dropped first): counts by guard type and by what each guard reads, the
    path down the module tree folded to `<module>`."""
    dropped, total = [], []

    def record(entries):  # called once per frame Dynamo compiles
        keep = torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe(entries)
        total.append(len(entries))
        dropped.extend((e.guard_type, _read(e.name)) for e, k in zip(entries, keep) if not k)
        return without_dtensor_spec_guards(entries)

    hf_us_per_call(model, record, calls=3, timed=False)
    lines = [f"guards on torch.nn's modules: {len(dropped)} of {sum(total)} in the tp_plan model's "
             f"{len(total)} frame(s)"]
    for title, counts in (("by type", Counter(t for t, _ in dropped)), ("by what they read", Counter(r for _, r in dropped))):
        lines.append(f"  {title}: " + ", ".join(f"{name} {n}" for name, n in counts.most_common(top)))
    return lines


_MODULE_PATH = re.compile(r"^(self|L\['self'\])(\._modules\['[^']*'\]|\.\[\d+\])*")


def _read(name: str) -> str:
    """A guard's source with its module path folded: `<module>.forward.__closure__[0]...`."""
    return re.sub(r"\[\d+\]", "[i]", _MODULE_PATH.sub("<module>", name))


def hf_llama(layers: int, tp_plan: bool):
    """A tiny random Llama of `layers` decoder layers, saved by rank 0 and loaded by every rank."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    folder = os.path.join(tempfile.gettempdir(), f"cgcompile-dtensor-guards-{layers}l")
    saved = os.path.join(folder, "saved.ok")  # written last: a save cut short is made again
    if dist.get_rank() == 0 and not os.path.exists(saved):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256)).save_pretrained(folder)
        open(saved, "w").close()
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(folder, **({"tp_plan": "auto"} if tp_plan else {})).eval()


def hf_rows(layer_counts, calls: int, guard_kinds: bool) -> None:
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{'layers':>6} {'whole us':>9} {'whole, nn guards skipped':>25} {'tp_plan us':>11} "
              f"{'tp_plan, spec dropped':>22} {'tp_plan, spec dropped, nn guards skipped':>41}")
    for layers in layer_counts:
        whole = hf_llama(layers, tp_plan=False)
        plain = hf_us_per_call(whole, None, calls)
        plain_skipped = hf_us_per_call(whole, torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe, calls)
        del whole
        sharded = hf_llama(layers, tp_plan=True)
        dtensor = hf_us_per_call(sharded, None, calls)
        nospec = hf_us_per_call(sharded, without_dtensor_spec_guards, calls)
        neither = hf_us_per_call(sharded, without_spec_and_inbuilt_module_guards, calls)
        kinds = nn_guard_kinds(sharded) if guard_kinds else []
        if rank0:
            print(f"{layers:>6} {plain:>9.1f} {plain_skipped:>25.1f} {dtensor:>11.1f} {nospec:>22.1f} {neither:>41.1f}",
                  flush=True)
            print("\n".join(kinds), flush=bool(kinds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="8,32", help="MLP blocks (two linears each), comma-separated; with --hf, "
                   "decoder layers")
    p.add_argument("--calls", type=int, default=300, help="calls per timed run (median of 5 runs)")
    p.add_argument("--hf", action="store_true", help="a transformers Llama, whole and tp_plan='auto' (torchrun, 2 ranks)")
    p.add_argument("--guard-kinds", action="store_true",
                   help="with --hf: the guards on torch.nn's modules in the tp_plan frame, by type and by what they read")
    args = p.parse_args()
    if args.hf:
        dist.init_process_group("gloo")
        try:
            hf_rows([int(n) for n in args.layers.split(",")], args.calls, args.guard_kinds)
        finally:
            dist.destroy_process_group()
        return
    # One rank: an in-process store, no port that another run on the machine could hold.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
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
