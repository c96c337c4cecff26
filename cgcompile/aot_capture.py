"""Ahead-of-time capture of every capture size, shared by the backend and the manager."""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Iterable

import torch

from .capture import CaptureSession, Mode

log = logging.getLogger(__name__)

MakeInputs = Callable[[int, bool], Any]


def call_with(run: Callable, inputs: Any) -> Any:
    """Call `run` with what a make_inputs factory returned: a tuple, a dict, or one value."""
    if isinstance(inputs, tuple):
        return run(*inputs)
    if isinstance(inputs, dict):
        return run(**inputs)
    return run(inputs)


def capture_all(session: CaptureSession, run: Callable, make_inputs: MakeInputs,
                sizes: Iterable[int], progress: bool = True) -> int:
    """Warm up and capture each size, largest first so smaller sizes reuse the pool.

    make_inputs(size, warmup) builds the inputs of one call; the capture run gets its own
    (warmup=False) state, so nothing the graphs read was only initialised in warm-up.
    Returns how many graphs were captured.
    """
    before = session.graphs_captured
    for size in _progress(sorted(set(sizes), reverse=True), progress):
        with session.mode_as(Mode.WARMUP):
            call_with(run, make_inputs(size, True))
        with session.mode_as(Mode.CAPTURE):
            call_with(run, make_inputs(size, False))
    gc.collect()  # once per batch of captures, not per graph
    torch.cuda.synchronize()
    return session.graphs_captured - before


def _progress(sizes: list[int], enabled: bool):
    if not enabled:
        return sizes
    try:
        from tqdm import tqdm
    except ImportError:
        log.info("cgcompile: capturing %d sizes (install tqdm for a progress bar)", len(sizes))
        return sizes
    return tqdm(sizes, desc="cgcompile capture", unit="size")
