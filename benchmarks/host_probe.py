"""Where the host time of one replayed decode step goes, part by part.

A replayed step's GPU work is its graphs' kernels; everything else is Python between
launches. This probe splits that Python into named parts by wrapping the functions a
replayed step passes through with host-clock counters (exclusive time: a part's own time,
its wrapped callees subtracted), then prints microseconds per step and per layer:

    compiled path (Backend)       breakable path (GraphManager)
    outside the runtime:          outside the runner:
      Dynamo's guards and frame,    the manager, the decoder's own Python
      the runtime's entry
    address check                 address check (+ reading the module's tensor addresses)
    fused weights, size policy    signature: choosing the recorded graph
    runtime call, cuDNN toggle    static inputs: copies into the graph's buffers
    stitch code (generated)
    graph piece dispatch          graph launches (CUDAGraph.replay)
    input copies (fill_all)       eager steps (attention)
    or, once every graph of the
    call's size is captured, the
    replay plan (checks, copies)
    graph launches                outputs: slicing / copies
    output slicing, copies
    pieces run eagerly (attention)

Each step runs with the device idle before it (synchronised), so the host never waits
on a full launch queue and its time is its own. The same steps are also timed without
the wrappers ("step, plain") to show what the wrappers add. Uses decode_bench's model,
inputs and variants, so the numbers sit beside its step times:

    python benchmarks/host_probe.py --model 1b --batches 1,8 --variants cgcompile-inductor,breakable
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from typing import Callable

import torch

import cgcompile
import cgcompile.breakable.record as record
import cgcompile.breakable.runner as runner_module
import cgcompile.run.graph_piece as graph_piece
import cgcompile.run.replay_plan as replay_plan
import cgcompile.run.runtime as runtime_module
from cgcompile.run.buffers import SizePolicy, StaticInput
from cgcompile.breakable.signature import SignatureRule
from cgcompile.run.full_graph import FullGraph
from cgcompile.testing.decode_model import MODEL_CONFIGS
from cgcompile.run.fused_weights import FusedWeights
from cgcompile.run.weights import ModuleTensors, ParameterAddresses
from decode_bench import build_bench, default_dtype, timing_start
from decode_variants import VARIANT_NAMES, VARIANTS
from harness import environment, log, synchronize, write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTSIDE = "outside the runtime / runner"


class HostClock:
    """Exclusive host nanoseconds per label: a wrapped call's time minus its wrapped callees'."""

    def __init__(self):
        self.ns: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._children: list[int] = []  # per open wrapped call: its wrapped callees' time

    def wrap(self, label: str, fn: Callable) -> Callable:
        clock = time.perf_counter_ns
        stack, ns, calls = self._children, self.ns, self.calls

        def timed(*args, **kwargs):
            stack.append(0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                ns[label] += elapsed - stack.pop()
                calls[label] += 1
                if stack:
                    stack[-1] += elapsed

        return timed


@contextlib.contextmanager
def patched(pairs: list[tuple[object, str, Callable]]):
    """Set each (owner, attribute, value); put every original back on exit."""
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in pairs]
    try:
        for owner, name, value in pairs:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is None:  # inherited: remove the shadowing wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, value)


# What each path's replay passes through, by owner: {attribute: (path, label)}. Owners
# are classes (the wrapper replaces a method for every instance) or modules (a function
# their code calls by its global name).
PARTS = {
    ParameterAddresses: {"allow": ("compiled", "address check"), "allow_addresses": ("breakable", "address check")},
    FusedWeights: {"extend": ("compiled", "fused weights")},
    SizePolicy: {"size_for": ("compiled", "size policy")},
    runtime_module.GraphRuntime: {"_run": ("compiled", "runtime call")},
    runtime_module: {"call_without_cudnn_attention": ("compiled", "cuDNN toggle"),
                     "copy_out": ("compiled", "output copies")},
    FullGraph: {"run": ("compiled", "full graph choice")},
    graph_piece: {"fill_all": ("compiled", "input copies"), "narrow_all": ("compiled", "output slicing")},
    torch.cuda.CUDAGraph: {"replay": (None, "graph launches")},  # both paths
    runner_module.BreakableRunner: {"_call": ("breakable", "runner entry"), "_replay": ("breakable", "replay loop")},
    ModuleTensors: {"read": ("breakable", "address check")},
    SignatureRule: {"decide": ("breakable", "signature")},
    StaticInput: {"refresh": ("breakable", "static inputs")},
    runner_module: {"padded_rows_copy": ("breakable", "static inputs"),
                    "increment_version": ("breakable", "version bumps"), "_cut": ("breakable", "outputs")},
    record.EagerStep: {"__call__": ("breakable", "eager steps")},
}


def wrap_parts(clock: HostClock, path: str) -> list[tuple[object, str, Callable]]:
    return [(owner, name, clock.wrap(label, getattr(owner, name)))
            for owner, attributes in PARTS.items() for name, (part_path, label) in attributes.items()
            if part_path in (path, None)]


def stitch_patches(clock: HostClock, backend: cgcompile.Backend) -> list:
    """The stitch's generated forward (a runtime's `Stitch` holds it as `_code`) reaches
    each piece through a namespace entry, which the runner's `at(n, size)` returns: both
    are wrapped per runtime, and the namespaces made anew (empty while patched). A
    replay plan binds those entries and `CUDAGraph.replay` when it is made: plans made
    while the wrappers are in place (see `replanned`) bind the wrapped ones, and the
    plan's own time (address checks, input copies) is its exclusive time."""
    pairs = [(replay_plan, "build_plan", _timed_plans(clock))]
    for runtime in backend.runtimes:
        stitch = runtime.stitch
        pairs += [(stitch, "_code", clock.wrap("stitch code", stitch._code)), (stitch, "_namespaces", {})]
        for runner in runtime.runners:
            graph = isinstance(runner, graph_piece.CudaGraphPiece)
            if graph and runtime.plans is not None:
                continue  # a plan replays the piece's graph itself: no dispatch to wrap
            label = "graph piece dispatch" if graph else "pieces run eagerly"
            pairs.append((runner, "at", lambda n, size, at=runner.at, label=label: clock.wrap(label, at(n, size))))
    return pairs


def _timed_plans(clock: HostClock) -> Callable:
    build = replay_plan.build_plan

    def build_timed(*args):
        plan = build(*args)
        if plan is None:
            return None
        timed = clock.wrap("replay plan (checks, input copies)", plan)
        timed.source = plan.source
        return timed

    return build_timed


@contextlib.contextmanager
def replanned(backend):
    """Plans made anew on entry and on exit (so that they bind what is patched then)."""
    sessions = {rt.session for rt in backend.runtimes if rt.session is not None} if backend else set()
    for session in sessions:
        session.graphs_changed()
    try:
        yield
    finally:
        for session in sessions:
            session.graphs_changed()


def host_step_us(step: Callable[[], object], steps: int, device: torch.device) -> list[float]:
    """Host microseconds of each step, the device idle before each."""
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter_ns()
        step()
        times.append((time.perf_counter_ns() - start) / 1e3)
    synchronize(device)
    return times


def device_step_ms(step: Callable[[], object], steps: int) -> float:
    """Median milliseconds of a step back to back on the device (CUDA events)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for begin, end in events:
        begin.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) for b, e in events)


def probe_case(name: str, prepared, batch: int, steps: int, device: torch.device) -> dict:
    counter = iter(range(10**9))

    def step():
        k = next(counter)
        return prepared.step(batch, timing_start(k), k)

    for _ in range(5):  # warm: captured already; this settles caches and allocator
        step()
    plain = host_step_us(step, steps, device)
    clock = HostClock()
    backend = getattr(prepared, "backend", None)
    if backend is not None:
        pairs = wrap_parts(clock, "compiled") + stitch_patches(clock, backend)
    else:
        pairs = wrap_parts(clock, "breakable")
    total = clock.wrap(OUTSIDE, step)
    with patched(pairs), replanned(backend):
        wrapped = host_step_us(total, steps, device)
    per_step = {label: ns / 1e3 / steps for label, ns in clock.ns.items()}
    calls = {label: count / steps for label, count in clock.calls.items()}
    return {
        "variant": name, "batch": batch,
        "step_plain_us": statistics.median(plain), "step_wrapped_us": statistics.median(wrapped),
        "device_ms": device_step_ms(step, steps) if device.type == "cuda" else None,
        "parts_us": dict(sorted(per_step.items(), key=lambda kv: -kv[1])), "calls_per_step": calls,
    }


def format_case(case: dict, layers: int) -> str:
    lines = [f"{case['variant']} B={case['batch']}: step {case['step_plain_us']:.0f} us on the host "
             f"({case['step_wrapped_us']:.0f} wrapped)"
             + (f", {case['device_ms'] * 1e3:.0f} us on the device" if case["device_ms"] else "")]
    for label, us in case["parts_us"].items():
        calls = case["calls_per_step"][label]
        lines.append(f"  {label:<30} {us:8.1f} us/step {us / layers:7.2f} us/layer  {calls:6.1f} calls/step")
    return "\n".join(lines)


def prepare_variant(name: str, bench):
    """The variant's Prepared; for cgcompile variants, with its Backend reachable as `.backend`."""
    variant = next(v for v in VARIANTS if v.name == name)
    made = []
    original = cgcompile.Backend.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    with patched([(cgcompile.Backend, "__init__", remember)]):
        prepared = variant.prepare(bench)
    if prepared.capture is not None:
        prepared.capture()
    prepared.backend = made[-1] if made else None
    return prepared


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_CONFIGS), default="1b")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--variants", default="cgcompile-inductor,breakable",
                   help=f"comma list from {', '.join(VARIANT_NAMES)}")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--json", default=None, help="write the cases here")
    args = p.parse_args(argv)
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.variants = tuple(args.variants.split(","))
    unknown = sorted(set(args.variants) - set(VARIANT_NAMES))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {VARIANT_NAMES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, cfg = torch.device(args.device), MODEL_CONFIGS[args.model]
    log(f"host probe: model {args.model} ({cfg.layers} layers), {args.dtype}, batches {args.batches}")
    bench = build_bench(args.model, cfg, device, DTYPES[args.dtype], args.batches)
    cases = []
    with torch.inference_mode(), default_dtype(DTYPES[args.dtype]):
        for name in args.variants:
            prepared = prepare_variant(name, bench)
            for batch in args.batches:
                prepared.step(batch, timing_start(0), 0)  # first call: compile and capture this size
            for batch in args.batches:
                case = probe_case(name, prepared, batch, args.steps, device)
                cases.append(case)
                print(format_case(case, cfg.layers), flush=True)
            torch._dynamo.reset()
    if args.json:
        write_json(args.json, {"environment": environment(device), "model": args.model, "layers": cfg.layers,
                               "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
