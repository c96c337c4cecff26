"""Breakable CUDA graphs: capture an eager module, broken at attention and other split ops.

No Dynamo, no Inductor. The module runs once under capture; a dispatch mode that is
active only during capture ends the current graph segment at every split op (the same
default set as the backend, plus `Config.splitting_ops`) and at every function marked
`@eager_break`, runs it eagerly, records it, and begins the next segment in the same
pool. Replay walks the recorded steps: segment, eager op, segment, ...

Ownership: every tensor a step reads or writes, and every static input and output, is
held by strong references for as long as the graphs live. A weak reference would let
the pool hand that memory to a later segment while a recorded step still reads it.

Eager steps replay with the arguments they were captured with: the same tensors (whose
contents the segments refresh) and the same Python values. Host-side state that changes
per call must therefore be read at call time, e.g. from an object an `@eager_break`
function holds, not passed as an int to an op.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .attention_backend import call_without_cudnn_attention
from .capture import CaptureSession, Mode, gc_paused
from .config import Config
from .errors import CaptureError, expect
from .split_ops import SplitOps

log = logging.getLogger(__name__)

# The recorder of the capture in progress on this thread. A context variable because
# an @eager_break function is called from user code that cannot pass it along.
_ACTIVE_RECORDER: contextvars.ContextVar["_Recorder | None"] = contextvars.ContextVar(
    "cgcompile_breakable_recorder", default=None
)


def eager_break(fn: Callable | None = None) -> Callable:
    """Mark a Python function as an eager break: under breakable capture it ends the
    current graph segment and runs eagerly, at capture and at every replay.

    Write `@cgcompile.eager_break` (no parentheses) above a def."""
    expect(fn is not None, "eager_break", "a function to decorate", "no argument",
           "write @cgcompile.eager_break without parentheses", raw=True)
    expect(callable(fn), "eager_break", "a function to decorate", fn,
           "write @cgcompile.eager_break above a def")
    label = getattr(fn, "__qualname__", type(fn).__name__)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        recorder = _ACTIVE_RECORDER.get()
        if recorder is None:
            return fn(*args, **kwargs)
        return recorder.run_eagerly(label, fn, args, kwargs)

    return wrapper


@dataclasses.dataclass
class _EagerStep:
    """Re-runs one split op with its captured arguments; copies fresh results into place."""

    fn: Callable
    args: tuple
    kwargs: dict
    outputs: list  # tensor leaves of the captured result: the addresses later segments read

    def __call__(self) -> None:
        result = self.fn(*self.args, **self.kwargs)
        # One tensor is the common case (attention); skip flattening it on every replay.
        new_leaves = (result,) if isinstance(result, torch.Tensor) else _tensor_leaves(result)
        if len(new_leaves) != len(self.outputs):
            raise CaptureError(
                f"eager step {getattr(self.fn, '__qualname__', self.fn)}: returned {len(new_leaves)} tensors "
                f"at replay but {len(self.outputs)} at capture; an eager break must return the same "
                f"structure every call (later graph segments read the captured outputs)"
            )
        for static, new in zip(self.outputs, new_leaves):
            if new.data_ptr() != static.data_ptr():
                static.copy_(new)


def _tensor_leaves(value) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


class _Interceptor(TorchDispatchMode):
    """Active during capture only: sends split ops to the recorder, runs the rest."""

    def __init__(self, recorder: "_Recorder", split_ops: SplitOps):
        super().__init__()
        self.recorder = recorder
        self.split_ops = split_ops
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused or self.split_ops.reason(func) is None:
            self.recorder.ops_in_segment += 1
            return func(*args, **kwargs)
        return self.recorder.run_eagerly(str(func), func, args, kwargs)


class _Recorder:
    """Builds the list of replay steps while the module runs under capture."""

    def __init__(self, session: CaptureSession, name: str, split_ops: SplitOps):
        self.session = session
        self.name = name
        self.steps: list[Callable[[], None]] = []
        self.keep_alive: list[Any] = []
        self.mode = _Interceptor(self, split_ops)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ops_in_segment = 0

    def begin_segment(self) -> None:
        self.graph = self.session.begin_graph()
        self.ops_in_segment = 0

    def end_segment(self, before: str) -> None:
        graph, self.graph = self.graph, None
        self.session.end_graph(graph, f"{self.name} (segment before {before})")
        if self.ops_in_segment:
            self.steps.append(graph.replay)
            self.keep_alive.append(graph)

    def run_eagerly(self, label: str, fn: Callable, args: tuple, kwargs: dict):
        self.end_segment(label)
        self.mode.paused = True
        try:
            result = fn(*args, **kwargs)
        finally:
            self.mode.paused = False
        self.steps.append(_EagerStep(fn, args, kwargs, _tensor_leaves(result)))
        self.keep_alive.append(result)
        self.begin_segment()
        return result


@dataclasses.dataclass
class _BreakableGraph:
    """One capture size: the steps, the static inputs they read, the static outputs."""

    steps: list[Callable[[], None]]
    spec: Any  # pytree structure of (args, kwargs) at capture
    inputs: list  # flat input leaves: static tensors, or the captured non-tensor values
    outputs: Any  # the module's result, static tensors inside
    keep_alive: list


class BreakableRunner:
    """Replays `module.forward` from breakable CUDA graphs, one set per capture size.

    The size of a call is dim 0 of its first tensor input; tensor inputs whose dim 0 is
    that size are padded to the capture size (padding rows zeroed), outputs are cut
    back. Non-tensor inputs are frozen at capture: a call that passes different ones
    raises. Calls above the largest capture size run eagerly.
    """

    def __init__(self, module: torch.nn.Module, config: Config, session: CaptureSession):
        self.module = module
        self.config = config
        self.session = session
        self.graphs: dict[int, _BreakableGraph] = {}
        self._warmed: set[int] = set()  # sizes that had an ahead-of-time warm-up run
        self._forward = module.forward
        session.register(self)

    def clear(self) -> None:
        self.graphs.clear()

    def __call__(self, *args, **kwargs):
        if self.config.cudnn_attention:
            return self._call(*args, **kwargs)
        return call_without_cudnn_attention(self._call, *args, **kwargs)

    def _call(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        n = next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        size = self.session.padding.padded(n) if n is not None else None
        if size is None:
            return self._forward(*args, **kwargs)
        entry = self.graphs.get(size)
        if entry is None or self.session.mode is not Mode.LAZY:
            return self._first_call(leaves, spec, n, size, entry)
        return self._replay(entry, leaves, n, size, spec)

    # -- replay ---------------------------------------------------------------------------

    def _replay(self, entry: _BreakableGraph, leaves: list, n: int, size: int, spec=None):
        if spec is not None and spec != entry.spec:
            raise CaptureError(
                f"breakable graph of size {size}: the call's argument structure differs from the "
                f"captured one ({entry.spec} vs {spec}); call with the same arguments every time"
            )
        for static, leaf in zip(entry.inputs, leaves):
            if isinstance(leaf, torch.Tensor):
                if leaf.data_ptr() != static.data_ptr():
                    _copy_padded(static, leaf, n, size)
            elif leaf is not static and leaf != static:
                raise CaptureError(
                    f"breakable graph of size {size}: a non-tensor input changed since capture "
                    f"(captured {static!r}, got {leaf!r}); breakable graphs freeze non-tensor inputs: "
                    f"pass it as a tensor, or read it inside an @eager_break function"
                )
        for step in entry.steps:
            step()
        return _cut(entry.outputs, n, size, clone=not self.config.reuse_output_buffers)

    # -- capture --------------------------------------------------------------------------

    def _first_call(self, leaves, spec, n: int, size: int, entry):
        # Normal tensors even under inference_mode: a later replay outside it copies into them.
        with torch.inference_mode(False):
            static = [_padded_copy(x, n, size) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        mode = self.session.mode
        if mode is Mode.WARMUP:
            self._warmed.add(size)
            return _cut(self.session.warm_up(self._forward, *args, **kwargs), n, size, clone=True)
        if entry is None:
            if mode is Mode.LAZY or size not in self._warmed:
                self.session.warm_up(self._forward, *args, **kwargs)
            entry = self._capture(static, spec, args, kwargs, size)
        return self._replay(entry, leaves, n, size, spec)

    def _capture(self, static: list, spec, args, kwargs, size: int) -> _BreakableGraph:
        recorder = _Recorder(self.session, f"{type(self.module).__name__}[size {size}]", self.config.split_ops)
        token = _ACTIVE_RECORDER.set(recorder)
        try:
            with self.session.on_capture_stream(), gc_paused():
                recorder.begin_segment()
                try:
                    with recorder.mode:
                        outputs = self._forward(*args, **kwargs)
                except Exception:
                    if recorder.graph is not None:
                        self.session.abandon(recorder.graph)
                    raise
                recorder.end_segment("the end of forward")
        finally:
            _ACTIVE_RECORDER.reset(token)
        entry = _BreakableGraph(recorder.steps, spec, static, outputs, recorder.keep_alive)
        self.graphs[size] = entry
        return entry


def _padded_copy(x: torch.Tensor, n: int, size: int) -> torch.Tensor:
    if x.dim() > 0 and x.shape[0] == n:
        buf = torch.zeros((size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        buf[:n].copy_(x)
        return buf
    return x.clone()


def _copy_padded(static: torch.Tensor, x: torch.Tensor, n: int, size: int) -> None:
    if static.shape[0] == size and x.shape[0] == n and n != size:
        static[n:].zero_()
        static[:n].copy_(x)
    elif static.shape == x.shape:
        static.copy_(x)
    else:
        raise CaptureError(
            f"breakable graph of size {size}: expected an input of shape {tuple(static.shape)} "
            f"(or {n} rows of it), got {tuple(x.shape)}; only dim 0 may vary between calls"
        )


def _cut(outputs, n: int, size: int, clone: bool):
    def cut(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() > 0 and x.shape[0] == size and n != size:
            x = x[:n]
        return x.clone() if clone else x

    return pytree.tree_map(cut, outputs)
