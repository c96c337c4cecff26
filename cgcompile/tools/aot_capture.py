"""Ahead-of-time capture of every capture size, shared by the backend and the manager.

Here too are the checks of what those two owners are given. They run before anything is
warmed up or captured, so a wrong call leaves the owner as it was: arguments first
(`check_capture_call`, `requested_sizes`, `check_pool`), then the machine
(`require_cuda_graphs`). Without CUDA, or with CUDA graphs off, every capture entry
point raises `CaptureError` the same way instead of running the model.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch

from ..run.capture import CaptureSession, Mode
from ..run.capture import GraphPool
from ..errors import CaptureError, CGCompileError, ConfigError, expect, expected

log = logging.getLogger(__name__)

MakeInputs = Callable[[int, bool], Any]

_INPUTS = "a tuple of positional args, a dict of keyword args, or one tensor"


def call_with(run: Callable, inputs: Any, culprit: str = "inputs") -> Any:
    """Call `run` with what a make_inputs factory returned: a tuple, a dict, or one value.

    A list is refused rather than guessed at: it could be the positional args or one
    argument that is a list, and the two guesses run different code.
    """
    expect(not isinstance(inputs, list), culprit, _INPUTS, inputs,
           "write tuple(inputs) for positional args, or (inputs,) to pass the list as one argument")
    if isinstance(inputs, tuple):
        return run(*inputs)
    if isinstance(inputs, Mapping):
        return run(**inputs)
    return run(inputs)


def check_capture_call(culprit: str, model: Any, make_inputs: Any, progress: Any) -> None:
    """The arguments every capture entry point takes besides the sizes."""
    expect(callable(model), f"{culprit}: model", "the compiled model (what torch.compile returned)", model)
    expect(callable(make_inputs), f"{culprit}: make_inputs", "a function make_inputs(size, warmup)", make_inputs,
           "pass e.g. lambda size, warmup: (torch.zeros(size, 16, device='cuda'),)")
    expect(isinstance(progress, bool), f"{culprit}: progress", "True or False", progress)


def requested_sizes(culprit: str, sizes: Any, configured: tuple[int, ...], *, bounded: bool) -> tuple[int, ...]:
    """The sizes a capture call asked for, checked; None means every configured size.

    bounded: no size may exceed the largest configured one (a call above it runs without
    graphs, so capturing it would silently capture nothing).
    """
    if sizes is None:
        return tuple(configured)
    expect(isinstance(sizes, (tuple, list, range)) and len(sizes) > 0, f"{culprit}: sizes",
           "None or a non-empty tuple of sizes", sizes, "e.g. sizes=(1, 2, 4)")
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
    expect(not bad, f"{culprit}: sizes", "positive ints", bad)
    largest = max(configured)
    above = [s for s in sizes if s > largest] if bounded else []
    expect(not above, f"{culprit}: sizes", f"sizes up to the largest capture size {largest}", above,
           "add them to Config.capture_sizes (calls above the largest size run without graphs)")
    return tuple(sizes)


def cuda_present() -> bool:
    """Whether this machine has CUDA: the one question every check here asks of it."""
    return torch.cuda.is_available()


def require_cuda_graphs(culprit: str, graphs_on: bool, off_because: str) -> None:
    """Raise before any warm-up when no CUDA graph can be captured here.

    graphs_on: whether the owner runs CUDA graphs at all; off_because says why not.
    """
    if not cuda_present():
        raise CaptureError(expected(
            culprit, "a CUDA device (CUDA graphs need CUDA)", "none: torch.cuda.is_available() is False",
            "run on a GPU; on CPU leave capture out: calls run the split pieces without graphs", raw=True))
    if not graphs_on:
        raise CaptureError(expected(
            culprit, "CUDA graphs on", off_because,
            "put the model on CUDA and leave Config.cudagraphs=None, or leave capture out", raw=True))


def require_captured(culprit: str, session: CaptureSession) -> None:
    """Raise when a capture ran every size and its owner still holds no graph at all."""
    if session.graphs_captured == 0:
        raise CaptureError(expected(
            culprit, "CUDA graphs captured", "none after running every size",
            "pass the model compiled with this backend, with its tensors on CUDA; a model whose "
            "pieces all run eagerly has nothing to capture (see backend.pieces for the reasons)", raw=True))


def check_pool(culprit: str, pool: Any) -> None:
    """`pool` as an owner takes it: None, a GraphPool, or a torch.cuda.graph_pool_handle()."""
    handle = isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool)
    expect(pool is None or isinstance(pool, GraphPool) or handle, f"{culprit}: pool",
           "None, a cgcompile.GraphPool or torch.cuda.graph_pool_handle()", pool)
    expect(pool is None or cuda_present(), f"{culprit}: pool", "None without CUDA",
           pool, "a graph pool needs a CUDA device")


def check_cudagraphs_setting(culprit: str, config) -> None:
    """Config.cudagraphs=True asks for graphs: refuse it where there is no CUDA."""
    expect(config.graphs.cudagraphs is not True or cuda_present(), f"{culprit}: Config.cudagraphs",
           "None or False on a machine without CUDA", True, "leave cudagraphs=None: the model then runs eagerly",
           ConfigError)


def capture_all(session: CaptureSession, run: Callable, make_inputs: MakeInputs,
                sizes: Iterable[int], progress: bool = True) -> int:
    """Warm up and capture each size, largest first so smaller sizes reuse the pool.

    make_inputs(size, warmup) builds the inputs of one call; the capture run gets its own
    (warmup=False) state, so nothing the graphs read was only initialised in warm-up.
    Returns how many graphs were captured. A call that fails raises `CaptureError`
    naming the size and the run, chained to the original error.
    """
    before = session.graphs_captured
    for size in _progress(sorted(set(sizes), reverse=True), progress):
        with session.mode_as(Mode.WARMUP):
            _run_one(run, make_inputs, size, warmup=True)
        with session.mode_as(Mode.CAPTURE):
            _run_one(run, make_inputs, size, warmup=False)
    gc.collect()  # once per batch of captures, not per graph
    torch.cuda.synchronize()
    return session.graphs_captured - before


def _run_one(run: Callable, make_inputs: MakeInputs, size: int, warmup: bool) -> None:
    label = f"capture of size {size} ({'warm-up' if warmup else 'capture'} run)"
    try:
        inputs = make_inputs(size, warmup)
    except CGCompileError:
        raise
    except Exception as e:
        raise CaptureError(expected(label, f"make_inputs({size}, {warmup}) to return inputs",
                                    _first_line(e), "fix make_inputs (the cause is chained)", raw=True)) from e
    try:
        call_with(run, inputs, f"{label}: make_inputs({size}, {warmup})")
    except CGCompileError:
        raise
    except Exception as e:
        raise CaptureError(expected(
            label, f"the model to accept make_inputs({size}, {warmup})", _first_line(e),
            f"check that make_inputs returns the inputs of a call of size {size} in the shapes and dtypes "
            f"forward expects (the cause is chained)", raw=True)) from e


def _first_line(error: BaseException) -> str:
    """The root cause as "Type: first line". Dynamo reports a shape error met while tracing
    as "...: got RuntimeError('...')" inside pages of context; that inner error is the cause."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    inner = re.search(r"\): got (\w+)\((['\"])(.+?)\2\)\n", text)
    if inner:
        kind, text = inner.group(1), inner.group(3)
    else:
        kind, text = type(error).__name__, text.splitlines()[0] if text else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{kind}: {text}" if text else kind


def _progress(sizes: list[int], enabled: bool):
    if not enabled:
        return sizes
    try:
        from tqdm import tqdm
    except ImportError:
        log.info("cgcompile: capturing %d sizes (install tqdm for a progress bar)", len(sizes))
        return sizes
    return tqdm(sizes, desc="cgcompile capture", unit="size")
