"""Inductor's programmatic dependent launch, with every kernel waiting before its first memory access.

With `triton.enable_pdl` (Hopper and later) Inductor launches each Triton kernel so that it
may start while the kernel before it still runs, and puts the wait (`gdc_wait`) only before
loads of buffers that the kernel just before wrote: it reads anything else early. On torch
2.11 that check let a kernel read a buffer stale: a graph input written in place was read
by a later kernel before the write had landed (the case is in docs/performance.md,
"Programmatic dependent launch").

`kept_in_order(options)` wraps one Inductor compile, and `waiting_first(inner_compile)`
the compile of each of its graphs, forward or backward: AOTAutograd compiles a backward
lazily, at the first backward call, after the outer compile has returned. Where PDL is on,
each kernel waits before its first load or store, as if the kernel before had written every
buffer: kernels still launch early, so their set-up overlaps the previous kernel's tail,
but none touches memory before the kernel before it has finished. By induction every
kernel then sees memory as stream order leaves it, whatever Inductor's dependence check
decides. cgcompile's own Triton kernels wait the same way.

How: Inductor decides each wait in `TritonKernel._handle_pdl_before_access`, from the
scheduler's `previous_node`; with no previous node it always waits. The compile runs with
that method seeing none. The change is part of the compile's cache keys
(`torch.compiler.config.cache_key_tag`, which AOTAutograd's and Inductor's keys include),
so code compiled without it is never served from their caches. A torch whose Inductor
lacks either hook gets the compile with PDL off, and a warning.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger(__name__)

PDL_OPTION = "triton.enable_pdl"
KEY_TAG = "cgcompile-pdl-waits-first-v1"  # what the cache key carries while the waits are forced

# The patch is process-wide (a class attribute, a config value): compiles on other threads
# wait for it to be undone rather than save and restore each other's patched state.
_patching = threading.RLock()


def pdl_requested(options: dict[str, Any] | None) -> bool:
    """Whether a compile with these Inductor option patches has PDL on (the patch, else
    Inductor's config, which TORCHINDUCTOR_ENABLE_PDL sets)."""
    import torch._inductor.config as inductor_config

    if options and PDL_OPTION in options:
        return bool(options[PDL_OPTION])
    return bool(inductor_config.triton.enable_pdl)


@contextlib.contextmanager
def kept_in_order(options: dict[str, Any] | None) -> Iterator[dict[str, Any] | None]:
    """Around one Inductor compile: yields the option patches to compile with. Where they
    have PDL on, every kernel waits before its first memory access (or, where this torch
    cannot be made to, PDL is turned off for the compile). The compile passes its graphs'
    compiles through `waiting_first`, for a backward compiled after this returns."""
    if not pdl_requested(options):
        yield options
        return
    hooks = _hooks()
    if isinstance(hooks, str):
        _warn_once(hooks)
        yield {**(options or {}), PDL_OPTION: False}
        return
    with _waits_forced(*hooks):
        yield options


def waiting_first(inner_compile: Callable) -> Callable:
    """Inductor's compile of one graph (`compile_fx`'s `inner_compile`), forcing the waits
    whenever it runs with PDL on: compile_fx runs it under the compile's option patches, the
    lazy backward's too, so Inductor's config says whether PDL is on."""

    @functools.wraps(inner_compile)
    def compile_waiting_first(*args, **kwargs):
        import torch._inductor.config as inductor_config

        if not inductor_config.triton.enable_pdl:
            return inner_compile(*args, **kwargs)
        if _draws_random_numbers(args[0] if args else kwargs["gm"]):
            # Inductor's kernels read their random seed without a wait (`load_seed`).
            log.debug("cgcompile: a graph that draws random numbers is compiled without %s", PDL_OPTION)
            with inductor_config.patch({PDL_OPTION: False}):
                return inner_compile(*args, **kwargs)
        hooks = _hooks()
        if isinstance(hooks, str):  # kept_in_order turns PDL off before a compile gets here
            raise RuntimeError(f"cgcompile: a compile has {PDL_OPTION} on but its kernels cannot be made "
                               f"to wait before every memory access: {hooks}")
        with _waits_forced(*hooks):
            return inner_compile(*args, **kwargs)

    return compile_waiting_first


def _draws_random_numbers(gm) -> bool:
    """Whether an aten graph calls an op that draws from the random generator."""
    seeded = torch.Tag.nondeterministic_seeded
    return any(node.op == "call_function" and seeded in getattr(node.target, "tags", ())
               for node in gm.graph.nodes)


_forced_depth = 0  # how many _waits_forced blocks are open (they nest: a compile, its graphs)


@contextlib.contextmanager
def _waits_forced(kernel_class: type, compiler_config: Any) -> Iterator[None]:
    """Inductor's kernels wait before their first memory access, and the cache keys say so,
    until the outermost block ends."""
    global _forced_depth
    with _patching:
        if _forced_depth:
            _forced_depth += 1
            try:
                yield
            finally:
                _forced_depth -= 1
            return
        original = kernel_class._handle_pdl_before_access
        tag = compiler_config.cache_key_tag
        kernel_class._handle_pdl_before_access = _waiting_always(original)
        compiler_config.cache_key_tag = f"{tag}|{KEY_TAG}" if tag else KEY_TAG
        _forced_depth = 1
        try:
            yield
        finally:
            _forced_depth = 0
            kernel_class._handle_pdl_before_access = original
            compiler_config.cache_key_tag = tag


def _waiting_always(original):
    """`_handle_pdl_before_access` as Inductor has it, run as if no kernel came before."""
    from torch._inductor.virtualized import V

    def handle(self, wait_buffer, *dependencies, **kwargs):
        scheduler = V.graph.scheduler
        if scheduler is None:  # no previous node either: Inductor waits
            return original(self, wait_buffer, *dependencies, **kwargs)
        previous, scheduler.previous_node = scheduler.previous_node, None
        try:
            return original(self, wait_buffer, *dependencies, **kwargs)
        finally:
            scheduler.previous_node = previous

    handle.__wrapped__ = original
    return handle


def _hooks() -> tuple[type, Any] | str:
    """(Inductor's Triton kernel class, torch.compiler.config), or why they are not as expected."""
    import torch.compiler.config as compiler_config
    from torch._inductor.codegen.triton import TritonKernel

    decide = getattr(TritonKernel, "_handle_pdl_before_access", None)
    if not callable(decide):
        return "Inductor's Triton kernels have no _handle_pdl_before_access"
    if "previous_node" not in _source(getattr(decide, "__wrapped__", decide)):
        return "Inductor's _handle_pdl_before_access does not decide from the scheduler's previous_node"
    if not isinstance(getattr(compiler_config, "cache_key_tag", None), str):
        return "torch.compiler.config has no cache_key_tag"
    return TritonKernel, compiler_config


@functools.cache
def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


_warned: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        log.warning("cgcompile: Inductor's programmatic dependent launch (%s) is off in cgcompile's "
                    "compiles: %s, so its kernels cannot be made to wait before every memory access "
                    "(without that wait, torch 2.11 read stale memory; see docs/performance.md).",
                    PDL_OPTION, why)
