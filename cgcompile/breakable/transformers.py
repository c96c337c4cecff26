"""Hugging Face transformers: generate() on breakable CUDA graphs, nothing changed by the user.

Imported only when transformers is (`cgcompile.breakable.integrations.integration_for`). Every line
of cgcompile that knows about transformers is here.

What runs where in a decode step:
  - eagerly: generate()'s loop, the model's own forward around the layer stack (embedding,
    positions and the causal mask, which the stack computes on the host from the cache
    length and the 2D attention mask), the final norm and the head;
  - from graphs: each decoder layer, one breakable graph per (batch size, signature), in
    two segments: norm, projections and rotary; output projection, MLP and residuals.
    Between them two eager steps: the cache update and attention.

Why per layer and not the stack: the stack's forward asks the cache for its length and
builds positions and masks from it on the host; a graph would freeze them. Each layer
gets all of that as arguments: rotary cos and sin (read by captured ops: static buffers,
shared by all layers), the mask and position ids (read only by attention: passed live,
their shapes free) and the cache (a live object). Layer i's output is returned as its
graph's buffer, which layer i+1 reads in place: no copy between layers. (When something
observes a layer's output, a forward hook such as `output_hidden_states` installs, the
output is returned as a copy instead.) Graphs run at exact batch sizes: a cache holds the
rows of the live batch, so padding rows would have no cache rows to attend to.

Hooks, installed only while a call is recorded (observed or captured) and removed after,
so transformers is as it was between calls and after; replays call the original functions:
  - attention: the model's `attn_implementation` in transformers' attention interface
    (`ALL_ATTENTION_FUNCTIONS`, a local override, removed after) runs as an eager break;
  - `Cache.update` runs as an eager break with dynamic results: its keys and values grow
    every step, so they are handed live to attention and may never be read by a captured
    op. The step holds "the call's cache" (a live input), not the cache's tensors, so a
    replay updates the cache generate() passes now, at its current length;
  - `Cache.get_seq_length`, `get_mask_sizes` and `get_query_offset`, called by code being
    captured, mark the call uncapturable (a graph would freeze the length): it then runs
    eagerly, never wrongly.
The attention implementation must be in the interface ("sdpa", flash attention, ...): with
"eager" attention stays in the captured segments, reads the cache, and every decode step
is found uncapturable (logged once; load the model with attn_implementation="sdpa").
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch.nn.modules import module as nn_module
from torch.utils import _pytree as pytree
from transformers import cache_utils, modeling_utils

from ..run.capture import CaptureSession
from ..config import Config
from .boundary import layers_of, resolve_boundary
from .path import BreakablePath
from .record import note_host_read, run_as_eager_break
from .runner import BreakableGroup, BreakableRunner

log = logging.getLogger(__name__)

LIVE_TYPES = (cache_utils.Cache,)
_HOST_READS = ("get_seq_length", "get_mask_sizes", "get_query_offset")


def breakable_path(model: torch.nn.Module, boundary: Any, config: Config, session: CaptureSession,
                   segments: str) -> BreakablePath:
    """A runner per decoder layer of the stack the boundary names ("auto": found)."""
    stack = resolve_boundary(model, boundary)
    layers = layers_of(stack)
    hooks, group = Hooks(model), BreakableGroup()
    shared = dict(segments=segments, group=group, live_types=LIVE_TYPES, recording_hooks=hooks, exact_sizes=True)
    if not layers:
        log.warning("cgcompile: %s has no list of layers; capturing it whole. Decode steps whose positions or "
                    "masks it computes from the cache are found uncapturable and run eagerly", type(stack).__name__)
        return BreakablePath(model, [BreakableRunner(stack, config, session, **shared)])
    name = f"{type(layers[0]).__name__} x{len(layers)}"
    runners = [BreakableRunner(layer, config, session, clone_outputs=False, log_name=name, **shared)
               for layer in layers]
    log.info("cgcompile: %s: breakable graphs around each of its %d %s; the cache update and attention (%s) "
             "run eagerly between segments", type(model).__name__, len(layers), type(layers[0]).__name__,
             ", ".join(hooks.implementations) or "none hooked")
    return BreakablePath(model, runners, [_LayerForward(runner) for runner in runners])


class _LayerForward:
    """A decoder layer's forward while installed: its runner; the static output goes to
    the next layer as is, or as a copy when a forward hook observes the layer."""

    __slots__ = ("runner", "module")

    def __init__(self, runner: BreakableRunner):
        self.runner = runner
        self.module = runner.module

    def __call__(self, *args, **kwargs):
        out = self.runner(*args, **kwargs)
        if self.module._forward_hooks or nn_module._global_forward_hooks:
            return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        return out


class Hooks:
    """transformers' attention and cache methods as eager breaks, while entered.

    Reentrant and reusable: the first `__enter__` installs, the matching `__exit__`
    restores exactly what was there (a local override of the attention interface, or
    none; the `Cache` class's own functions).
    """

    def __init__(self, model: torch.nn.Module):
        self.implementations = _hookable_implementations(model)
        self._depth = 0
        self._attention: list[tuple[str, Callable | None]] = []
        self._cache: list[tuple[str, Callable]] = []

    def __enter__(self) -> "Hooks":
        if self._depth == 0:
            self._install()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore()

    def _install(self) -> None:
        interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
        # (name, the local override there was, or None): the mapping API cannot tell a local
        # override that holds the global function from none, and both must come back as they were.
        self._attention = [(impl, interface._local_mapping.get(impl)) for impl in self.implementations]
        self._cache = [(name, cache_utils.Cache.__dict__[name]) for name in ("update", *_HOST_READS)
                       if name in cache_utils.Cache.__dict__]
        for impl, _ in self._attention:
            interface[impl] = _attention_break(impl, interface[impl])
        for name, original in self._cache:
            hook = _update_break(original) if name == "update" else _host_read(name, original)
            setattr(cache_utils.Cache, name, hook)

    def _restore(self) -> None:
        interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
        for impl, previous in self._attention:
            if previous is None:
                del interface[impl]  # our local override
            else:
                interface[impl] = previous
        for name, original in self._cache:
            setattr(cache_utils.Cache, name, original)
        self._attention, self._cache = [], []


def _attention_break(impl: str, original: Callable) -> Callable:
    label = f"attention ({impl})"

    def attention(*args, **kwargs):
        return run_as_eager_break(label, original, args, kwargs)

    return attention


def _update_break(original: Callable) -> Callable:
    def update(self, *args, **kwargs):
        return run_as_eager_break(f"{type(self).__name__}.update", original, (self, *args), kwargs,
                                  dynamic_results=True)

    return update


def _host_read(name: str, original: Callable) -> Callable:
    def read(self, *args, **kwargs):
        note_host_read(f"{type(self).__name__}.{name}()")
        return original(self, *args, **kwargs)

    return read


def _hookable_implementations(model: torch.nn.Module) -> list[str]:
    configs = [model.config]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None and text is not model.config:
        configs.append(text)
    wanted = sorted({getattr(c, "_attn_implementation", None) or "eager" for c in configs})
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    missing = [impl for impl in wanted if impl not in interface]
    if missing:
        log.warning("cgcompile: %s uses attention %s, which transformers' attention interface does not list, so "
                    "cgcompile cannot run it eagerly between graph segments; its decode steps will run eagerly. "
                    "Load the model with attn_implementation='sdpa'", type(model).__name__, missing)
    return [impl for impl in wanted if impl in interface]
