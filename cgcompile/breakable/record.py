"""Recording one call of a module as breakable-graph steps, and what a replay runs.

The module runs once under a dispatch mode. Split ops, `@eager_break` functions and
integration hooks (`run_as_eager_break`) end the current segment and run eagerly; every
other op belongs to a segment (`breakable.segments` says what a segment is recorded into).
Along the way the recorder tracks where each tensor comes from, by storage, so that
`finish` can say:

  - which inputs captured ops read: they get static buffers and fix the signature's
    shapes; the other tensor inputs, and objects of the live types, reach the eager steps
    live at replay (the call's own tensor or cache object, not the captured one);
  - which results of eager steps captured ops read: a replay copies the fresh result into
    the captured buffer, and raises `CaptureError` if its shape changed (a segment would
    read stale or partial data); results only later eager steps read are handed over live
    (the keys and values a cache update returns, read by attention);
  - which inputs the call wrote into (`Recording.written_inputs`), by any step, captured
    or eager, directly or through a view: the inputs' version counters before and after.
    The module runs on copies of the call's tensors (see `runner`), so the runner copies
    these back into the caller's tensors after the call, and after every replay;
  - what makes the call impossible to capture (`uncapturable`): a captured op reads the
    results of a step declared `dynamic_results` (a cache update: they grow every step),
    a captured op synchronises with the host, host code asked a live object for its state
    while capturing (`note_host_read`), or a live object reached an eager step without
    being an input of the module. Such a call is still computed correctly (the recorder
    ran it); it just gets no graph.

Ownership: a `Recording` holds every tensor its steps read (eager-step arguments, static
results, tensors from outside the module that segments read), so no graph can read memory
that was handed to someone else.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import CaptureError, expected
from ..ops import SplitOps
from ..passes.split_rule import HOST_SYNC_ATEN_OPS
from .signature import Signature, StaticTensor, flatten_call, is_flat, unflatten_call

log = logging.getLogger(__name__)

# The recorder of the call being recorded on this thread. A context variable because the
# functions that break the graph are called from model code, which cannot pass it along.
_ACTIVE: contextvars.ContextVar["Recorder | None"] = contextvars.ContextVar("cgcompile_breakable_recorder",
                                                                            default=None)

_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_"})


def run_as_eager_break(label: str, fn: Callable, args: tuple, kwargs: dict, *, dynamic_results: bool = False):
    """fn(*args, **kwargs), as an eager break while a breakable graph is being recorded
    (ends the segment, runs eagerly now and at every replay), as a plain call otherwise.

    dynamic_results: the result's shapes change from call to call (a growing cache); a
    captured op that reads them makes the call uncapturable instead of raising at replay.
    """
    recorder = _ACTIVE.get()
    if recorder is None:
        return fn(*args, **kwargs)
    return recorder.run_eagerly(label, fn, args, kwargs, dynamic_results)


def note_host_read(what: str) -> None:
    """Called by integration hooks when host code reads a live object's state (a cache's
    length): while recording outside an eager step, a graph would freeze that value."""
    recorder = _ACTIVE.get()
    if recorder is not None and not recorder.paused:
        recorder.mark_uncapturable(f"host code read {what} while the graph was recorded; a graph would "
                                   f"freeze the value it got")


def recording() -> bool:
    """Whether a breakable graph is being recorded on this thread, outside an eager step."""
    recorder = _ACTIVE.get()
    return recorder is not None and not recorder.paused


# -- replay steps ----------------------------------------------------------------------------


class SegmentStep:
    """Replays one recorded segment. ops: how many times each op ran in it, for people."""

    __slots__ = ("replay", "ops")

    def __init__(self, replay: Callable[[], None], ops: dict[str, int] | None = None):
        self.replay = replay
        self.ops = ops or {}

    def __call__(self, live: list, results: list) -> None:
        self.replay()

    def describe(self) -> str:
        ops = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in self.ops.items())
        return f"graph segment: {sum(self.ops.values())} ops ({ops})"


class EagerStep:
    """Re-runs one eager break with its captured arguments, some replaced by live values.

    A replay calls each step as `step(live, results)`: live holds the call's input leaves,
    results what each earlier step of this replay returned (by position in the steps). An
    eager step returns its result leaves when a later eager step reads them (`keep`), else
    None; a segment step returns None. Nothing passes between steps outside that list, and
    nothing outlives the replay.

    subs: (position among the flattened arguments, step, index): the call's input leaf
    `index` when step is None, else `results[step][index]` (a live result of an earlier
    step). static_results: (index, tensor): result leaves that captured ops read, copied
    into the tensor they had at capture.
    """

    __slots__ = ("label", "fn", "args", "kwargs", "flat", "structure", "subs", "count", "static_results",
                 "keep", "owner", "positional")

    def __init__(self, label, fn, flat, structure, subs, count, static_results, keep, owner):
        self.label, self.fn, self.flat, self.structure = label, fn, flat, structure
        self.subs, self.count, self.static_results = subs, count, static_results
        self.keep, self.owner = keep, owner
        self.args, self.kwargs = unflatten_call(flat, structure)
        # Flat calls (the usual case) rebuild args and kwargs without walking the structure.
        self.positional = len(structure[0]) if is_flat(structure) else None

    def describe(self) -> str:
        live = f", {len(self.subs)} arguments live" if self.subs else ""
        return f"eager step: {self.label}{live}"

    def __call__(self, live: list, results: list) -> list | None:
        if self.subs:
            flat = self.flat.copy()
            for position, step, index in self.subs:
                flat[position] = live[index] if step is None else results[step][index]
            if self.positional is not None:
                args, kwargs = flat[:self.positional], dict(zip(self.structure[1], flat[self.positional:]))
            else:
                args, kwargs = unflatten_call(flat, self.structure)
        else:
            args, kwargs = self.args, self.kwargs
        result = self.fn(*args, **kwargs)
        leaves = tensor_leaves(result)
        if len(leaves) != self.count:
            raise CaptureError(expected(
                f"{self.owner}: eager step {self.label}", f"{self.count} tensor(s) in its result, as at capture "
                f"(later graph segments read them)", f"{len(leaves)}", "return the same tensors on every call",
                raw=True))
        for index, static in self.static_results:
            fresh = leaves[index]
            if fresh.shape != static.shape:
                raise CaptureError(expected(
                    f"{self.owner}: eager step {self.label}", f"a result of shape {tuple(static.shape)}, as at "
                    f"capture (a captured op reads it, and would read stale or partial data)",
                    f"{tuple(fresh.shape)}", "move the ops that read it into the eager break (attention together "
                    "with the cache update), or return the same shape on every call", raw=True))
            if fresh.data_ptr() != static.data_ptr():
                static.copy_(fresh)
        return leaves if self.keep else None


def replay_steps(steps: list, live: list) -> None:
    """Run a recording's steps in order, handing each the results of the steps before it."""
    results: list = []
    for step in steps:
        results.append(step(live, results))


def tensor_leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) is tuple and all(x is None or isinstance(x, torch.Tensor) for x in value):
        return [x for x in value if x is not None]
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


# -- recording -------------------------------------------------------------------------------


@dataclasses.dataclass
class _EagerRecord:
    label: str
    fn: Callable
    flat: list
    structure: tuple
    sources: dict  # position -> ("input", index) or ("result", (step, leaf))
    results: list  # tensor leaves of the result
    dynamic: bool


@dataclasses.dataclass
class Recording:
    """What `Recorder.finish` learned: the signature, and the steps a replay runs."""

    signature: Signature
    steps: list  # SegmentStep / EagerStep, in order
    static_inputs: list[int]  # leaf indices whose static buffers captured ops read
    live_tensor_inputs: list[int]  # tensor leaves eager steps get live
    written_inputs: list[int]  # tensor leaves some step wrote into (copied back to the caller's)
    outputs: Any  # the module's result, static tensors inside
    keep_alive: list  # tensors from outside the module that segments read


class _Interceptor(TorchDispatchMode):
    """Active while recording: sends split ops to the recorder as eager breaks, records the rest."""

    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder.paused:
            return func(*args, **kwargs)
        if recorder.split_ops.reason(func) is not None:
            return recorder.run_eagerly(str(func), func, args, kwargs, False)
        return recorder.run_captured(func, args, kwargs)


class Recorder:
    """Builds the steps of one call while the module runs (see the module docstring).

    leaves: the call's flattened arguments as the module receives them (static buffers
    for tensors). row_inputs: the leaves whose dim 0 is the call's row count (padded to the
    size in their buffers). live_types: objects of these types are passed live to eager steps.
    """

    def __init__(self, name: str, segments, split_ops: SplitOps, leaves: list, structure: tuple,
                 module: torch.nn.Module, row_inputs: set[int], live_types: tuple[type, ...] = ()):
        self.name = name
        self.row_inputs = row_inputs
        self.segments = segments
        self.split_ops = split_ops
        self.leaves = leaves
        self.structure = structure
        self.live_types = live_types
        self.mode = _Interceptor(self)
        self.paused = False
        self.segment = None
        self.ops_in_segment = 0
        self.segment_ops: dict[str, int] = {}  # op name -> calls in the current segment
        self.order: list = []  # ("segment", SegmentStep) or ("eager", record index)
        self.eager: list[_EagerRecord] = []
        self.uncapturable: str | None = None
        self._input_ids: dict[int, list[int]] = {}
        self._input_storages: dict[int, list[int]] = {}
        for i, leaf in enumerate(leaves):
            self._input_ids.setdefault(id(leaf), []).append(i)
            if isinstance(leaf, torch.Tensor) and _storage(leaf):
                self._input_storages.setdefault(_storage(leaf), []).append(i)
        # Views share their base's counter, so a write through a view of an input counts.
        self._versions = [_version(leaf) for leaf in leaves]
        self._result_ids: dict[int, tuple[int, int]] = {}
        self._result_storages: dict[int, tuple[int, int]] = {}
        self._params = {_storage(t) for t in (*module.parameters(), *module.buffers())}
        self._internal: set[int] = set()
        self.segment_inputs: set[int] = set()
        self.segment_results: set[tuple[int, int]] = set()
        self.eager_results: set[tuple[int, int]] = set()
        self.externals: dict[int, torch.Tensor] = {}

    def __enter__(self) -> "Recorder":
        self._token = _ACTIVE.set(self)
        self.mode.__enter__()
        self.begin_segment()
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            self.mode.__exit__(kind, error, tb)
        finally:
            _ACTIVE.reset(self._token)
            self.mode.recorder = None  # no cycle: what the recording held is freed with it
        if error is not None and self.segment is not None:
            segment, self.segment = self.segment, None
            self.segments.abandon(segment)

    def mark_uncapturable(self, reason: str) -> None:
        if self.uncapturable is None:
            self.uncapturable = reason

    # -- ops inside segments -----------------------------------------------------------------

    def run_captured(self, func, args, kwargs):
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        self._note_segment_reads(tensors)
        if self._syncs_with_host(func, tensors, kwargs):
            # A CUDA graph cannot hold it: run it as a break, and never capture this call.
            self.mark_uncapturable(f"{func} synchronises with the host inside a captured segment")
            return self.run_eagerly(str(func), func, args, kwargs, False)
        out = func(*args, **kwargs)
        self.ops_in_segment += 1
        name = getattr(func, "__name__", str(func))
        self.segment_ops[name] = self.segment_ops.get(name, 0) + 1
        self.segments.record(self.segment, func, args, kwargs, out)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._internal.add(_storage(t))
        return out

    def _note_segment_reads(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            ptr = _storage(t)
            if not ptr:
                continue
            inputs = self._input_storages.get(ptr)
            if inputs is not None:
                self.segment_inputs.update(inputs)
                continue
            result = self._result_storages.get(ptr)
            if result is not None:
                self.segment_results.add(result)
                if self.eager[result[0]].dynamic:
                    self.mark_uncapturable(
                        f"a captured op reads the result of {self.eager[result[0]].label}, whose shape "
                        f"changes from call to call (break the op that reads it out of the graph, e.g. "
                        f"attention: an attention implementation cgcompile does not hook)")
            elif ptr not in self._internal and ptr not in self._params:
                self.externals.setdefault(ptr, t)

    @staticmethod
    def _syncs_with_host(func, tensors: list[torch.Tensor], kwargs: dict) -> bool:
        name = getattr(getattr(func, "_schema", None), "name", "")
        if name in HOST_SYNC_ATEN_OPS:
            return True
        if name in _COPY_OPS:
            devices = {t.device.type for t in tensors}
            if "device" in kwargs and kwargs["device"] is not None:
                devices.add(torch.device(kwargs["device"]).type)
            return "cpu" in devices and len(devices) > 1
        return False

    # -- eager breaks ------------------------------------------------------------------------

    def run_eagerly(self, label: str, fn: Callable, args: tuple, kwargs: dict, dynamic: bool):
        if self.paused:  # an eager break called from inside another one
            return fn(*args, **kwargs)
        self.end_segment(label)
        flat, structure = flatten_call(args, kwargs)
        sources = self._sources(label, flat)
        self.paused = True
        try:
            # Outside the dispatch mode: the step runs exactly as it does at replay (and as in
            # eager), not op by op through Python.
            with _disable_current_modes():
                result = fn(*args, **kwargs)
        finally:
            self.paused = False
        step = len(self.eager)
        results = tensor_leaves(result)
        for j, t in enumerate(results):
            self._result_ids[id(t)] = (step, j)
            if _storage(t) and _storage(t) not in self._input_storages:
                self._result_storages[_storage(t)] = (step, j)
        self.eager.append(_EagerRecord(label, fn, flat, structure, sources, results, dynamic))
        self.order.append(("eager", step))
        self.begin_segment()
        return result

    def _sources(self, label: str, flat: list) -> dict:
        sources = {}
        for position, leaf in enumerate(flat):
            result = self._result_ids.get(id(leaf))
            if result is not None and self.eager[result[0]].results[result[1]] is leaf:
                sources[position] = ("result", result)
                self.eager_results.add(result)
                continue
            inputs = self._input_ids.get(id(leaf))
            if inputs is not None and self.leaves[inputs[0]] is leaf:
                sources[position] = ("input", inputs[0])
            elif self.live_types and isinstance(leaf, self.live_types):
                self.mark_uncapturable(
                    f"a {type(leaf).__name__} reached {label} without being an argument of the captured "
                    f"module, so a replay would use the one from capture")
        return sources

    def begin_segment(self) -> None:
        """Segments begin where the last one ended, on the capture stream (not at their first
        op, which may run on a stream the module forks to)."""
        self.segment = self.segments.begin()
        self.ops_in_segment = 0
        self.segment_ops = {}

    def end_segment(self, before: str) -> None:
        if self.segment is None:
            return
        segment, self.segment = self.segment, None
        replay = self.segments.end(segment, f"{self.name} (segment before {before})", self.ops_in_segment == 0)
        if replay is not None:
            self.order.append(("segment", SegmentStep(replay, self.segment_ops)))

    # -- the result ------------------------------------------------------------------------

    def finish(self, outputs: Any) -> Recording:
        """End the last segment and build the signature and the replay steps."""
        self.end_segment("the end of forward")
        output_tensors = tensor_leaves(outputs)
        self._note_segment_reads(output_tensors)  # the caller reads the outputs after a replay
        signature = self._signature()
        steps = self._steps()
        if self.externals:
            shapes = ", ".join(str(tuple(t.shape)) for t in list(self.externals.values())[:4])
            log.debug("cgcompile: %s: captured ops read %d tensors that are neither inputs nor parameters "
                      "of the module (%s); graphs read them where they are now", self.name, len(self.externals),
                      shapes)
        live_tensors = [i for i, _, _ in signature.live_tensors]
        return Recording(signature, steps, sorted(self.segment_inputs), live_tensors, self._written_inputs(),
                         outputs, list(self.externals.values()))

    def _written_inputs(self) -> list[int]:
        return [i for i, (leaf, before) in enumerate(zip(self.leaves, self._versions))
                if before is not None and _version(leaf) != before]

    def _signature(self) -> Signature:
        static, live_tensors, live_objects, values = [], [], [], []
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):
                if i in self.segment_inputs:
                    static.append(StaticTensor(i, tuple(leaf.shape), leaf.dtype, i in self.row_inputs))
                else:
                    live_tensors.append((i, leaf.dtype, leaf.dim()))
            elif self.live_types and isinstance(leaf, self.live_types):
                live_objects.append((i, type(leaf)))
            else:
                values.append((i, leaf))
        return Signature(self.structure, tuple(static), tuple(live_tensors), tuple(live_objects), tuple(values),
                         self.uncapturable)

    def _steps(self) -> list:
        steps, positions = [], {}  # positions: eager record index -> its step's position in steps
        for kind, item in self.order:
            if kind == "eager":
                positions[item] = len(steps)
                item = self._eager_step(item, self.eager[item], positions)
            steps.append(item)
        return steps

    def _eager_step(self, index: int, record: _EagerRecord, positions: dict) -> EagerStep:
        flat = list(record.flat)
        subs = []
        for position, (kind, where) in record.sources.items():
            if kind == "input" and not self._is_static_input(where):
                subs.append((position, None, where))
                flat[position] = None  # the live value replaces it: do not keep the capture's alive
            elif kind == "result" and where not in self.segment_results:
                subs.append((position, positions[where[0]], where[1]))
                flat[position] = None
        static_results = [(j, t) for j, t in enumerate(record.results) if (index, j) in self.segment_results]
        keep = any((index, j) in self.eager_results and (index, j) not in self.segment_results
                   for j in range(len(record.results)))
        return EagerStep(record.label, record.fn, flat, record.structure, subs, len(record.results),
                         static_results, keep, self.name)

    def _is_static_input(self, index: int) -> bool:
        # Non-tensor inputs: live objects are replaced, frozen values stay as captured.
        leaf = self.leaves[index]
        if isinstance(leaf, torch.Tensor):
            return index in self.segment_inputs
        return not (self.live_types and isinstance(leaf, self.live_types))


def _version(leaf) -> int | None:
    """A tensor leaf's version counter (None: not a tensor, or an inference tensor, which keeps none)."""
    if not isinstance(leaf, torch.Tensor) or leaf.is_inference():
        return None
    return leaf._version


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return 0
