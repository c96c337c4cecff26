"""Where a Hugging Face generate() decode token's time goes, measured without a profiler.

A profiler changes what it measures here: under CUPTI a CUDA graph launch took ~0.5 ms of
host time, and the step's host work is the question. This probe instead wraps the call
that runs each decode step and reads plain clocks (the model and variants of hf_bench.py):

    token ms        (t(generate N) - t(generate 1)) / (N - 1), median of --rounds; every
                    variant is warmed up first, then the rounds take turns (the host drifts)
    step host ms    the decode step's call, from entry to return (guards, the variant's own
                    dispatch, the graph launch), no synchronisation
    full path, fused check, address check  cgcompile's own share of the step host time
                    (its decode graph's FullGraph.run, FusedWeights.extend,
                    ParameterAddresses.allow); the rest is Dynamo's guards and calls
    step device ms  CUDA events recorded just before and just after that call: from when
                    the GPU reaches the call (idle, as generate() synchronises every token)
                    to when its last kernel ends: host time before the first kernel plus
                    the step's GPU time
    launch host ms  torch.cuda.CUDAGraph.replay, from entry to return (every replay of
                    the step: one full graph, or a tree's graph)
    loop ms         the same generate() with the forward replaced by one that returns a
                    fixed logits tensor: transformers' own per-token host work (inputs,
                    masks, logits processing, the stopping check that synchronises)

token ~= loop + (step device - the part of the loop that overlaps the GPU). What a variant
can still win is bounded by its step device time; the rest belongs to generate().

--skip-module-guards compiles every variant (transformers' own too) with Dynamo's
`guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe`: what Dynamo's
guards on the model's modules and parameters cost per step. Unsafe in general (a changed
module attribute is not noticed); a measurement, not a recommendation.

    python benchmarks/hf_step_probe.py --variants static,cgcompile-static-sq --batches 1,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import cgcompile
import harness
import hf_bench
from compile_cache import fresh_compile_cache


class StepClock:
    """Host time of each decode step's call, and CUDA events around it: `begin` / `end`."""

    def __init__(self):
        self.host_ms: list[float] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open = None

    def begin(self, ids) -> None:
        if ids is None or ids.shape[-1] != 1:  # the prefill is not a decode step
            return
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        self._open = (before, time.perf_counter())

    def end(self) -> None:
        if self._open is None:
            return
        before, start = self._open
        self.host_ms.append(1e3 * (time.perf_counter() - start))
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        self.events.append((before, after))
        self._open = None

    def device_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.events]


class MethodClock:
    """Stands in for `target`, timing each call of its method `name` (host time)."""

    def __init__(self, target, name: str):
        self._target, self._name = target, name
        self.host_ms: list[float] = []

    def __getattr__(self, attr):
        value = getattr(self._target, attr)
        if attr != self._name:
            return value

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = value(*args, **kwargs)
            self.host_ms.append(1e3 * (time.perf_counter() - start))
            return out

        return timed


def clock_runtime(backend) -> dict[str, MethodClock]:
    """Clocks on the decode graph's full path and fused-weight check (cgcompile variants):
    the part of the step's host time that is cgcompile's own, not Dynamo's."""
    runtime = backend.runtimes[-1]
    clocks = {}
    if runtime.full is not None:
        runtime.full = clocks["full_path_host_ms"] = MethodClock(runtime.full, "run")
    if runtime.fused is not None:
        runtime.fused = clocks["fused_check_host_ms"] = MethodClock(runtime.fused, "extend")
    if runtime.addresses is not None:
        runtime.addresses = clocks["address_check_host_ms"] = MethodClock(runtime.addresses, "allow")
    return clocks


class ReplayClock:
    """Times every torch.cuda.CUDAGraph.replay (host time: the graph launch) while active."""

    def __init__(self):
        self.host_ms: list[float] = []
        self._original = None

    def __enter__(self):
        self._original = original = torch.cuda.CUDAGraph.replay

        def replay(graph):
            start = time.perf_counter()
            original(graph)
            self.host_ms.append(1e3 * (time.perf_counter() - start))

        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self._original


def clock_steps(model, variant: str) -> StepClock:
    """A StepClock around the call generate() runs each decode step through, put where
    it changes nothing Dynamo guards on (replacing `model.forward` would recompile)."""
    clock = StepClock()
    if variant == "static":  # generate() calls model._compiled_call (modeling_utils.get_compiled_call)
        compiled = model._compiled_call

        def timed(*args, **kwargs):
            clock.begin(kwargs.get("input_ids"))
            out = compiled(*args, **kwargs)
            clock.end()
            return out

        model._compiled_call = timed
    else:  # module hooks run in nn.Module.__call__, outside the compiled model.forward
        model.register_forward_pre_hook(lambda m, args, kwargs: clock.begin(kwargs.get("input_ids")), with_kwargs=True)
        model.register_forward_hook(lambda m, args, kwargs, out: clock.end(), with_kwargs=True)
    return clock


class Probe:
    """One warmed-up variant with its clocks; `round()` adds one token rate and one clocked generate()."""

    def __init__(self, variant: str, batch: int, args):
        settings = hf_bench.VARIANT_COMPILER_CONFIG.get(variant, {})
        with fresh_compile_cache(False), torch.compiler.config.patch(**settings):
            self.loaded = hf_bench.warm_up(variant, batch, args)
        self.variant, self.batch, self.args = variant, batch, args
        model = self.loaded.model
        self.prompt = hf_bench.make_prompt(args, batch, model.config.vocab_size)
        self.token_ms: list[float] = []
        self.step = clock_steps(model, variant)
        backend = self.loaded.backend
        self.inner = clock_runtime(backend) if isinstance(backend, cgcompile.Backend) else {}
        self.replay_ms: list[float] = []

    def round(self) -> None:
        model, kwargs, new_tokens = self.loaded.model, self.loaded.kwargs, self.args.new_tokens
        self.token_ms.append(token_ms(model, *self.prompt, kwargs, new_tokens))
        with ReplayClock() as replays:
            hf_bench.timed(model, *self.prompt, new_tokens, kwargs)
        self.replay_ms += replays.host_ms

    def row(self) -> dict:
        steps = len(self.step.host_ms)
        row = {"variant": self.variant, "batch": self.batch, "token_ms": statistics.median(self.token_ms),
               "step_host_ms": statistics.median(self.step.host_ms),
               "step_device_ms": statistics.median(self.step.device_ms()),
               "replays_per_step": len(self.replay_ms) / max(steps, 1),
               "launch_host_ms": statistics.median(self.replay_ms) if self.replay_ms else None, "steps": steps}
        row.update({name: statistics.median(c.host_ms) for name, c in self.inner.items() if c.host_ms})
        stats = getattr(self.loaded.backend, "stats", None)
        if stats is not None:
            row.update(full_graph_calls=stats.full_graph_calls, piecewise_calls=stats.piecewise_calls)
        return row


def token_ms(model, ids, mask, kwargs, new_tokens: int) -> float:
    """Decode time per token: (t(generate N) - t(generate 1)) / (N - 1)."""
    one, _ = hf_bench.timed(model, ids, mask, 1, kwargs)
    full, _ = hf_bench.timed(model, ids, mask, new_tokens, kwargs)
    return 1e3 * (full - one) / (new_tokens - 1)


def loop_only(args, batch: int) -> Callable[[], float]:
    """generate() with a forward that does no work: transformers' per-token host time."""
    model = hf_bench.build_model(args)
    logits = torch.zeros(batch, 1, model.config.vocab_size, device=args.device, dtype=model.dtype)
    model.forward = lambda *a, **kw: CausalLMOutputWithPast(logits=logits, past_key_values=kw.get("past_key_values"))
    kwargs = {"cache_implementation": "static", "disable_compile": True}
    ids, mask = hf_bench.make_prompt(args, batch, model.config.vocab_size)
    hf_bench.timed(model, ids, mask, args.new_tokens, kwargs)
    return lambda: token_ms(model, ids, mask, kwargs, args.new_tokens)


def skip_module_guards() -> None:
    """Make every later torch.compile drop Dynamo's guards on nn modules (see the docstring).

    torch.compile refuses `mode` beside `options`, so transformers' reduce-overhead mode
    becomes the option it stands for (triton.cudagraphs)."""
    original = torch.compile

    def compile_without_module_guards(model=None, **kwargs):
        options = dict(kwargs.pop("options", None) or {})
        if kwargs.get("mode") == "reduce-overhead":
            kwargs.pop("mode")
            options["triton.cudagraphs"] = True
        elif kwargs.get("mode") not in (None, "default"):
            raise ValueError(f"--skip-module-guards: mode {kwargs['mode']!r} is not handled")
        kwargs.pop("mode", None)
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        return original(model, options=options, **kwargs)

    torch.compile = compile_without_module_guards


def measure_batch(batch: int, variants: list[str], args) -> list[dict]:
    """Warm every variant up, then time them in interleaved rounds (the host drifts)."""
    torch._dynamo.reset()
    loop, error = harness.guarded("loop only", lambda: loop_only(args, batch))
    loop_ms: list[float] = []
    probes, rows = [], []
    for variant in variants:
        made, error_v = harness.guarded(variant, lambda: Probe(variant, batch, args))
        if made is None:
            rows.append({"variant": variant, "batch": batch, "error": error_v})
        else:
            probes.append(made)
    graphs = hf_bench.dynamo_graphs()
    for _ in range(args.rounds):
        if loop is not None:
            loop_ms.append(loop())
        for probe in probes:
            probe.round()
    rows.insert(0, {"variant": "loop only (forward does nothing)", "batch": batch,
                    "token_ms": statistics.median(loop_ms) if loop_ms else None, "error": error})
    rows += [probe.row() for probe in probes]
    if hf_bench.dynamo_graphs() != graphs:  # the clocks must not change what they time
        for row in rows:
            row["error"] = f"Dynamo compiled {hf_bench.dynamo_graphs() - graphs} graph(s) during the rounds"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="static,cgcompile-static-sq")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-module-guards", action="store_true", help="see the module docstring")
    cli = parser.parse_args()
    if cli.skip_module_guards:
        skip_module_guards()
    args = argparse.Namespace(device="cuda", tiny=False, dtype="bfloat16", compiler="inductor", prompt_len=128,
                              new_tokens=cli.new_tokens, rounds=cli.rounds, warm_cache=False)
    print(harness.environment("cuda", variants=cli.variants, new_tokens=cli.new_tokens,
                              skip_module_guards=cli.skip_module_guards), flush=True)
    rows = []
    for batch in [int(b) for b in cli.batches.split(",")]:
        for row in measure_batch(batch, cli.variants.split(","), args):
            rows.append(row)
            print(row, flush=True)
    print(f"\n{'variant':<34} {'B':>2} {'token ms':>9} {'step host':>10} {'step device':>12} {'launch host':>12} "
          f"{'full path':>10} {'fused check':>12} {'address check':>14}")
    for r in rows:
        def f(key):
            return f"{r[key]:.3f}" if r.get(key) is not None else "-"
        print(f"{r['variant']:<34} {r['batch']:>2} {f('token_ms'):>9} {f('step_host_ms'):>10} "
              f"{f('step_device_ms'):>12} {f('launch_host_ms'):>12} {f('full_path_host_ms'):>10} "
              f"{f('fused_check_host_ms'):>12} {f('address_check_host_ms'):>14}")
    if os.environ.get("OUT"):
        harness.write_json(harness.default_out("hf_step_probe.json"), {"rows": rows, "skip_module_guards": cli.skip_module_guards})


if __name__ == "__main__":
    main()
