"""The benchmark method, once: every benchmark here times its variants with these helpers.

    timing      `time_steps` times one window of steps: CUDA events around each step on a
                GPU, the host clock elsewhere, after untimed warm-up steps. `wall_s` times
                one call on the host clock from an idle device to the end of its work
                (a whole generate(), a capture, a pipeline's steps across ranks).
    rounds      `run_interleaved` runs every (variant, case) in rounds, one window each,
                variants taking turns: the GPU machine is a VM whose host slows by up to 2x
                for seconds at a time, and taking turns lets every variant see the same
                phases. `Timing.of(windows)` keeps the median of every step (the verdict),
                the lowest window median (the host at its quietest) and the mean.
    floor       `measure_peak_bandwidth` copies a large buffer on the device (bytes read +
                written, median of several copies); `floor_ms(bytes, peak)` is the time a
                step that must read `bytes` cannot beat.
    cold        `fresh_compile_cache`: Inductor's caches empty for each measured variant,
                so a warm-up time is a cold compile.
    report      `environment` (versions, device, commit), `write_json`, `log`, `guarded`
                (one failing variant must not stop the others).

A benchmark file keeps only its model, its variants and its targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
import traceback
from typing import Callable, Hashable, TypeVar

import torch

_T0 = time.perf_counter()
T = TypeVar("T")


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


class Unavailable(RuntimeError):
    """A variant that cannot run here (a library is missing); its row gives the reason."""


def guarded(what: str, fn: Callable):
    """(fn(), None), or (None, the error in words) when fn raises; the run goes on either way."""
    try:
        return fn(), None
    except Unavailable as e:  # a missing library: the reason is the whole story
        log(f"  {what} skipped: {e}")
        return None, str(e)
    except Exception as e:  # one failing variant must not stop the others
        traceback.print_exc()
        log(f"  {what} FAILED: {type(e).__name__}: {e}")
        return None, f"{type(e).__name__}: {e}"


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device | str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def dynamo_graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


# -- timing --------------------------------------------------------------------------------


def time_steps(step: Callable[[int], object], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `steps` calls step(k), after `warmup` untimed ones."""
    for k in range(warmup):
        step(k)
    if device.type != "cuda":
        return [_host_ms(step, k) for k in range(steps)]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    synchronize(device)
    for k, (begin, end) in enumerate(events):
        begin.record()
        step(k)
        end.record()
    torch.cuda.synchronize(device)
    return [begin.elapsed_time(end) for begin, end in events]


def _host_ms(step: Callable[[int], object], k: int) -> float:
    t0 = time.perf_counter()
    step(k)
    return (time.perf_counter() - t0) * 1e3


def wall_s(fn: Callable[[], T], device: torch.device | str) -> tuple[float, T]:
    """(wall seconds of fn(), its result): the device idle before, and waited for after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float  # median of every timed step: the verdict
    best_window_ms: float  # lowest window median: the host at its quietest (informative)
    mean_ms: float

    @classmethod
    def of(cls, windows: list[list[float]]) -> "Timing":
        every = [ms for w in windows for ms in w]
        return cls(statistics.median(every), min(statistics.median(w) for w in windows), statistics.fmean(every))


Key = tuple[str, Hashable]  # (variant, case), e.g. ("cgcompile-inductor", 8)


def run_interleaved(windows: dict[Key, Callable[[], T]], rounds: int) -> tuple[dict[Key, list[T]], dict[str, str]]:
    """Call every window once per round, in the order given, for `rounds` rounds.

    Returns each key's samples (one per round) and, for each variant whose window raised,
    the error: that variant (every case of it) sits out the later rounds, its samples dropped.
    """
    samples: dict[Key, list[T]] = {key: [] for key in windows}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for key, window in windows.items():
            if key[0] in errors:
                continue
            sample, error = guarded(f"{key[0]} timing", window)
            if error is not None:
                errors[key[0]] = error
            else:
                samples[key].append(sample)
    return {key: s for key, s in samples.items() if key[0] not in errors}, errors


# -- cold compiles -------------------------------------------------------------------------


def fresh_compile_cache(warm: bool = False):
    """Inductor's caches (on disk and in memory) start empty inside this scope, unless `warm`.

    Without it, a variant measured after another reuses the Triton kernels the first one
    compiled (a fused RMSNorm is the same kernel in both), and its warm-up looks shorter.
    """
    if warm:
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache  # renamed in torch 2.9
    # Kept on disk after the scope: the compiled code stays in use (the variant is timed later).
    return fresh(delete=False)


# -- the bandwidth floor -------------------------------------------------------------------


def measure_peak_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy of `nbytes` (read + written), median of `repeats`.

    What a bandwidth-bound kernel can reach on this device, measured rather than taken
    from a data sheet (an H100's copy reaches about 80-90% of its nominal figure)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    ms = time_steps(lambda k: dst.copy_(src), repeats, 1, device)
    return 2 * nbytes / (statistics.median(ms) / 1e3) / 1e9


def floor_ms(nbytes: int, peak_gbs: float) -> float:
    """The time a step that must read `nbytes` once cannot beat at `peak_gbs`."""
    return nbytes / (peak_gbs * 1e9) * 1e3


def matmul_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weight matrices a step multiplies with (the embedding table is only
    indexed); of this rank's shards where the parameters are DTensors."""
    return sum(_local_bytes(p) for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# -- report --------------------------------------------------------------------------------


def environment(device: torch.device | str, **extra) -> dict:
    device = torch.device(device)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
    }
    env["source_digest"] = source_digest()
    with contextlib.suppress(Exception):  # may lag where the tree was copied without its history
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    return env | extra


def source_digest() -> str:
    """sha256 (12 hex digits) of the library's sources, cgcompile/ and passes/ by path: ties
    a result to the code that made it even where `git rev-parse` is stale (a working tree
    copied to another machine). `git show REV:path` per file recomputes it for a commit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder in ("cgcompile", "passes"):
        for base, _, files in sorted(os.walk(os.path.join(root, folder))):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(base, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:12]


def default_out(filename: str) -> str:
    """$OUT/filename when OUT is set (the GPU machine's result folder), else ./filename."""
    return os.path.join(os.environ["OUT"], filename) if os.environ.get("OUT") else filename


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
