"""A straight-line replay of one breakable graph, for the calls that fit it exactly.

A runner's generic call flattens its arguments (`signature.flatten_call`), finds the
row count and the size, checks the parameter addresses, asks the signature rule which
graph fits (`SignatureRule.decide`), and replays that graph's steps in a loop. For a
decoder layer of a Hugging Face model that is some sixty microseconds of Python a layer,
more than the eager steps themselves. Once a graph has replayed, everything but the
call's own values is fixed, so the runner generates one function for it that:

  - takes the call apart at the argument positions the signature names (no walk);
  - checks what `Signature.fits` checks, inlined: every captured tensor's shape and
    dtype, every live tensor's dtype and rank, every live object's type, every frozen
    value; and that the call's row count is the graph's size;
  - checks the parameter addresses (the same `ParameterAddresses` as the generic path);
  - refreshes the static inputs, runs the steps (graph launches bound), bumps the
    outputs' versions and returns the outputs.

Any check that fails returns `MISS` before anything ran, and the generic path takes the
call (a padded call, another signature, a warm-up or capture run), so a plan only ever
does what the generic path would have done. Its graph must be the first of its size in
capture order: the rule replays the first graph that fits, and a later graph's plan
could accept a call that an earlier graph fits too. Plans are dropped with the graphs
(`BreakableRunner.clear`, which weight moves and `CaptureSession.clear` call) and at every
capture or drop anywhere in the session (`CaptureSession.graphs_changed`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.graph import increment_version

from ..capture import Mode
from .record import SegmentStep
from .signature import Signature, same_value

MISS = object()  # a plan's answer for a call it does not serve


class RunnerPlans:
    """One runner's plans by size, and the one its last call used (`current`, tried first).
    Registered with the session, which clears it whenever graphs change."""

    __slots__ = ("by_size", "current", "__weakref__")

    def __init__(self):
        self.by_size: dict[int, Callable] = {}
        self.current: Callable | None = None

    def clear(self) -> None:
        self.by_size.clear()
        self.current = None


class _Source:
    """Lines of the generated function and the constants they name."""

    def __init__(self):
        self.lines: list[str] = []
        self.constants: dict[str, Any] = {"MISS": MISS, "Tensor": torch.Tensor, "same_value": same_value,
                                          "LAZY": Mode.LAZY, "increment_version": increment_version}

    def constant(self, value: Any, hint: str) -> str:
        name = f"{hint}{len(self.constants)}"
        self.constants[name] = value
        return name

    def miss_unless(self, condition: str) -> None:
        self.lines.append(f"if not ({condition}): return MISS")


def build_plan(runner, size: int, entry, cut: Callable) -> Callable[[tuple, dict], Any]:
    """The replay function of `entry` (a `_BreakableGraph` of `runner` at `size`): called
    with a call's (args, kwargs), it returns the outputs, or MISS without running anything.
    cut: the runner's `_cut`, for outputs in containers (a new container every call, as
    the generic path returns)."""
    src = _Source()
    signature: Signature = entry.signature
    leaves = _take_apart(src, signature.structure)
    _check_signature(src, signature, leaves, size)
    state = runner.rule.sizes[size]
    session = src.constant(runner.session, "session")
    src.miss_unless(f"{session}.mode is LAZY")
    # The generic path checks the addresses before deciding; a call that fails runs the
    # module eagerly there too. A check that drops the graphs (new weights settled) drops
    # this plan with them: the generic path then captures again.
    plans = src.constant(runner.plans, "plans")
    src.lines.append(f"if not {src.constant(runner.addresses.allow_addresses, 'allow')}"
                     f"({src.constant(runner._tensors.read, 'read')}()):")
    src.lines.append(f"    return {src.constant(runner._forward, 'forward')}(*args, **kwargs)")
    src.lines.append(f"if {plans}.current is not plan: return MISS")
    src.lines.append(f"{src.constant(state, 'state')}.last = {src.constant(signature, 'signature')}")
    for index, static in entry.statics:
        src.lines.append(f"{src.constant(static, 'static')}.refresh({leaves[index]}, {size}, {size})")
    src.lines.append(f"live = [{', '.join(leaves)}]")
    for step in entry.steps:
        if isinstance(step, SegmentStep):
            src.lines.append(f"{src.constant(step.replay, 'launch')}()")
        else:
            src.lines.append(f"{src.constant(step, 'eager')}(live)")
    for tensor in entry.output_tensors:
        src.lines.append(f"increment_version({src.constant(tensor, 'out')})")
    outputs = src.constant(entry.outputs, "outputs")
    if not isinstance(entry.outputs, torch.Tensor):
        src.lines.append(f"return {src.constant(cut, 'cut')}({outputs}, {size}, {size}, {runner.clone_outputs})")
    else:
        src.lines.append(f"return {outputs}.clone()" if runner.clone_outputs else f"return {outputs}")
    return _compile(src, runner.name, size)


def _take_apart(src: _Source, structure: tuple) -> list[str]:
    """Lines that bind each leaf of a call of `structure` to a local (l0, l1, ...), missing
    when the call has another structure; returns the locals' names in leaf order."""
    arg_keys, names, value_keys = structure
    leaves: list[str] = []
    src.miss_unless(f"len(args) == {len(arg_keys)} and len(kwargs) == {len(names)}")
    if names:
        src.miss_unless(f"tuple(kwargs) == {src.constant(tuple(names), 'names')}")
    for i, key in enumerate(arg_keys):
        _bind(src, key, f"args[{i}]", leaves)
    for name, key in zip(names, value_keys):
        _bind(src, key, f"kwargs[{name!r}]", leaves)
    return leaves


def _bind(src: _Source, key, expression: str, leaves: list[str]) -> None:
    if key is None:
        name = f"l{len(leaves)}"
        src.lines.append(f"{name} = {expression}")
        leaves.append(name)
        return
    container = f"c{len(src.lines)}"
    src.lines.append(f"{container} = {expression}")
    if key[0] is dict:
        _, keys, inner = key
        src.miss_unless(f"type({container}) is dict and tuple({container}) == {src.constant(tuple(keys), 'keys')}")
        for k, sub in zip(keys, inner):
            _bind(src, sub, f"{container}[{src.constant(k, 'key')}]", leaves)
        return
    kind, inner = key
    src.miss_unless(f"type({container}) is {src.constant(kind, 'kind')} and len({container}) == {len(inner)}")
    for i, sub in enumerate(inner):
        _bind(src, sub, f"{container}[{i}]", leaves)


def _check_signature(src: _Source, signature: Signature, leaves: list[str], size: int) -> None:
    """`Signature.fits` for a call of `size` rows, inlined; and that the call's row count
    (dim 0 of its first tensor leaf with dims, as the runner counts it) is `size`."""
    first = None
    for s in signature.static:
        x = leaves[s.index]
        src.miss_unless(f"isinstance({x}, Tensor) and {x}.dtype == {src.constant(s.dtype, 'dtype')} "
                        f"and {x}.shape == {src.constant(torch.Size(s.shape), 'shape')}")
        if len(s.shape) > 0 and (first is None or s.index < first):
            first = s.index
    for index, dtype, ndim in signature.live_tensors:
        x = leaves[index]
        src.miss_unless(f"isinstance({x}, Tensor) and {x}.dtype == {src.constant(dtype, 'dtype')} "
                        f"and {x}.dim() == {ndim}")
        if ndim > 0 and (first is None or index < first):
            first = index
    for index, kind in signature.live_objects:
        src.miss_unless(f"type({leaves[index]}) is {src.constant(kind, 'type')}")
    for index, value in signature.values:
        x, frozen = leaves[index], src.constant(value, "value")
        src.miss_unless(f"{x} is {frozen} or same_value({x}, {frozen})")
    if first is not None:
        # Static rows are checked at full size above; a live tensor's rows are not.
        src.miss_unless(f"{leaves[first]}.shape[0] == {size}")


def _compile(src: _Source, name: str, size: int) -> Callable:
    source = "def plan(args, kwargs):\n" + "".join(f"    {line}\n" for line in src.lines)
    namespace = dict(src.constants)
    exec(compile(source, f"<cgcompile breakable plan {name} size={size}>", "exec"), namespace)
    plan = namespace["plan"]
    plan.source = source
    return plan
