"""Breakable CUDA graphs: capture an eager module, broken at attention and other split ops.

No Dynamo, no Inductor. A call runs the module once under a recorder
(`breakable.record`): a dispatch mode that ends the current graph segment at every split
op (the same default set as the backend, plus `Config.splitting_ops`), at every function
marked `@eager_break` and at every integration hook (`run_as_eager_break`), runs it
eagerly, and records the next segment into the same pool. Replay walks the recorded
steps: segment, eager step, segment, ...

Which calls replay which graph is the signature rule of `breakable.signature`: per size
(dim 0 of the first tensor input, exact; padded to a capture size only with
`Config(padding=True)`, see `BreakableRunner`), one graph per call
signature (the shapes of the tensors captured ops read, the Python values frozen at
capture); a new signature is first observed (run eagerly under the recorder), and captured
when two calls in a row of that size have it. So a prefill runs eagerly and the decode
steps after it replay, and no shape a model legitimately passes raises.

Capture and run: each segment is replayed right after its capture, so the eager steps of
the capturing call see real data and every eager step runs exactly once per call (a cache
update appends once). Eager steps replay with the arguments they were captured with,
except what the recorder found to be live: tensor inputs only eager steps read (an
attention mask that grows), objects of the runner's live types (a transformers cache),
and results of earlier eager steps that only eager steps read (the keys and values a
cache update returns). Other host-side state that changes per call must be read inside
an `@eager_break` function, from an object it holds.

Writes into inputs: every recorded call (observe or capture) runs the module on copies of
the call's tensors (the static buffers a graph may keep), so neither run's ops touch the
caller's tensors, and each call runs each op once. The recorder tells which copies some
step wrote into, captured or eager, through a view or not (their version counters,
`Recording.written_inputs`); the runner copies those back into the caller's tensors after
the call and after every replay of its graph (`write_back`; the first n rows of a padded
copy; nothing where an eager step got the caller's tensor itself). So a split op's write
into `out`, or a captured `out.mul_`, lands exactly once per call, as in eager, with no
warm-up run whose effects would need undoing. Parameters and buffers are never copied:
their writes land in place, once per call.

Weights: segments read the module's parameters and buffers in place. Each call compares
their addresses with those at capture (`parameter_addresses`): a call whose weights were
replaced by new tensors runs eagerly, and once the new addresses settle every runner of
the group captures again.

Ownership: every tensor a step reads or writes, every static input and output, is held
by strong references for as long as the graph lives (`Recording.keep_alive`, the steps,
`StaticInput`). A weak reference would let the pool hand that memory to a later segment
while a recorded step still reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import weakref
from typing import Any, Callable

import torch
from torch.autograd.graph import increment_version
from torch.utils import _pytree as pytree

from ..run.buffers import SharedStatics, SizePolicy, StaticInput, padded_rows_copy
from ..run.capture import CaptureSession
from ..config import Config
from ..errors import expect
from ..ops import call_without_cudnn_attention
from ..run.weights import ModuleTensors, ParameterAddresses
from .record import Recorder, recording, replay_steps, run_as_eager_break
from .segments import SEGMENT_KINDS, observer_for, segments_for
from .signature import Action, Signature, SignatureRule, flatten_call, unflatten_call

log = logging.getLogger(__name__)

__all__ = ["BreakableGroup", "BreakableRunner", "eager_break", "recording", "run_as_eager_break"]


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
        return run_as_eager_break(label, fn, args, kwargs)

    return wrapper


class BreakableGroup:
    """What runners built together share: static buffers (see `buffers.SharedStatics`), the
    log lines already written (so sixteen decoder layers log a new signature once), the
    graphs that a runner whose weights moved drops (`drop_graphs`), and one description
    (`describe`, written to `Config.dump_dir` after each capture)."""

    _count = itertools.count()

    def __init__(self):
        self.statics = SharedStatics()
        self.logged: set = set()
        self._runners: list[weakref.ref] = []
        self.dump_name = f"breakable_{next(BreakableGroup._count)}.txt"

    def add(self, runner: "BreakableRunner") -> None:
        self._runners.append(weakref.ref(runner))

    def describe(self) -> str:
        """Every runner's graphs, step by step; runners whose graphs read the same (the
        layers of a model) are described once."""
        runners = [runner for ref in self._runners if (runner := ref()) is not None]
        blocks: list[tuple[str, list[int]]] = []
        for i, runner in enumerate(runners):
            text = runner.describe()
            if blocks and blocks[-1][0] == text:
                blocks[-1][1].append(i)
            else:
                blocks.append((text, [i]))
        return "\n".join(f"runners {ids[0]}-{ids[-1]} ({len(ids)}): {text}" if len(ids) > 1 else
                         f"runner {ids[0]}: {text}" for text, ids in blocks)

    def dump(self, dump_dir: str) -> None:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, self.dump_name), "w") as f:
            f.write(self.describe() + "\n")

    def drop_graphs(self) -> None:
        """Drop every runner's graphs; they are captured again lazily.

        All runners, not only the one whose weights moved: a new state dict moves every
        layer's. (The pool lives on without them, anchored: `CaptureSession._anchor_pool`.)"""
        for ref in self._runners:
            runner = ref()
            if runner is not None:
                runner.clear()


@dataclasses.dataclass
class _BreakableGraph:
    """One (size, signature): the steps, the buffers they read, the static outputs."""

    signature: Signature
    steps: list  # SegmentStep / EagerStep, in replay order
    statics: list[tuple[int, StaticInput]]  # (leaf index, buffer) refreshed before replay
    live_tensor_inputs: list[int]  # leaves eager steps get live (padded when the call is)
    written: list[tuple[int, torch.Tensor | None]]  # (leaf, its static buffer, None when live): copied back
    outputs: Any  # the module's result: static tensors inside
    output_tensors: list[torch.Tensor]  # its tensors, whose version a replay bumps
    keep_alive: list


class BreakableRunner:
    """Replays `module.forward` from breakable graphs: per size, one per call signature.

    The size of a call is dim 0 of its first tensor input: the exact count, at most
    `Config.exact_size_limit` of them, or with `exact_sizes=False` the smallest capture
    size >= it. Padded calls get their inputs whose dim 0 is the call's count padded
    (padding rows zeroed) and outputs cut back. Calls above the largest size run eagerly.

    Padding is sound only when no padding row reaches a real row's result (no mean, sort
    or softmax over dim 0). The compiled path proves that on the graph
    (`passes.padding_safety`); here there is no graph to prove it on, so a runner pads only
    when told to: `exact_sizes=False`, or by default `Config(padding=True)`, the user's
    word that the module's rows never mix, in its split ops too (eager steps run at the
    padded size).

    segments: "cuda_graphs", or "op_replay" (`breakable.segments.OpReplay`: the same
        bookkeeping on any device, segments re-run op by op; for tests and checking).
    group: a `BreakableGroup` shared with runners built together.
    live_types: objects of these types are passed live to eager steps (a cache).
    recording_hooks: a reusable context manager entered while a call is recorded
        (an integration's hooks into its framework).
    clone_outputs: return copies of the static outputs (default: unless
        `Config.reuse_output_buffers`); without, the next replay overwrites what was returned.
    log_name: what log lines call this runner (default: the module's class name).
    """

    def __init__(self, module: torch.nn.Module, config: Config, session: CaptureSession, *,
                 segments: str = "cuda_graphs", group: BreakableGroup | None = None,
                 live_types: tuple[type, ...] = (), recording_hooks: Any = None,
                 exact_sizes: bool | None = None, clone_outputs: bool | None = None, log_name: str | None = None):
        expect(segments in SEGMENT_KINDS, "BreakableRunner: segments", f"one of {SEGMENT_KINDS}", segments)
        self.module = module
        self.config = config
        self.session = session
        self.segments = segments
        self.group = group if group is not None else BreakableGroup()
        self.live_types = live_types
        self.recording_hooks = recording_hooks if recording_hooks is not None else contextlib.nullcontext()
        self.clone_outputs = (not config.graphs.reuse_output_buffers) if clone_outputs is None else clone_outputs
        self.name = log_name or type(module).__name__
        exact = config.sizes.padding is not True if exact_sizes is None else exact_sizes
        self.sizes = SizePolicy(session.padding, exact=exact, limit=config.sizes.exact_size_limit, name=self.name)
        if exact_sizes is None and config.sizes.padding is None and ("exact sizes",) not in self.group.logged:
            self.group.logged.add(("exact sizes",))
            log.info("cgcompile: %s: breakable graphs run at the exact sizes called (at most %d): with no graph "
                     "to prove that padding rows never reach real rows, they pad only with Config(padding=True), "
                     "your word that the module's rows never mix", self.name, config.sizes.exact_size_limit)
        self.rule = SignatureRule(self.name, self.group.logged)
        self._forward = module.forward
        self._warned_for_autograd = False  # the eager-for-autograd warning, once per runner
        # Segments read the module's parameters and buffers in place: a call whose tensors
        # moved (replaced, not updated in place) must not replay (`parameter_addresses`).
        self._tensors = ModuleTensors(module)
        self.addresses = ParameterAddresses(
            self.name, (), self._tensors.names, self.group.drop_graphs, warned=self.group.logged, advice="")
        self.group.add(self)
        session.register(self)

    @property
    def graphs(self) -> dict[int, list[_BreakableGraph]]:
        """The captured graphs by size, in capture order."""
        return {size: self.rule.graphs(size) for size in self.rule.sizes if self.rule.graphs(size)}

    def graph_count(self) -> int:
        return self.rule.graph_count()

    def describe(self) -> str:
        """Its graphs: per size and call signature, the steps a replay runs."""
        count = self.graph_count()
        lines = [f"{self.name}: {count} graph{'' if count == 1 else 's'}"]
        for size, entries in self.graphs.items():
            for entry in entries:
                lines.append(f"  size {size} [{entry.signature.describe()}]")
                lines += [f"    {step.describe()}" for step in entry.steps]
        return "\n".join(lines)

    def clear(self) -> None:
        self.rule.clear()

    def __call__(self, *args, **kwargs):
        if self.config.split.cudnn_attention:
            return self._call(args, kwargs)
        return call_without_cudnn_attention(self._call, args, kwargs)

    def _call(self, args: tuple, kwargs: dict):
        leaves, structure = flatten_call(args, kwargs)
        n = next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), 0)
        size = self.sizes.size_for(n) if n else None
        if size is None or not self.addresses.allow_addresses(self._tensors.read()):
            return self._forward(*args, **kwargs)
        if torch.is_grad_enabled() and self._needs_gradients(leaves):
            self._warn_eager_for_autograd()
            return self._forward(*args, **kwargs)
        decision = self.rule.decide(size, leaves, structure, n, self.session.mode)
        if decision.action is Action.EAGER:
            return self._forward(*args, **kwargs)
        if decision.action is Action.REPLAY:
            return self._replay(decision.entry, leaves, n, size)
        return self._record(decision.action, leaves, structure, n, size)

    def _warn_eager_for_autograd(self) -> None:
        """A call that builds an autograd graph runs the eager module: a replay runs outside
        autograd's view, and what autograd would save at capture (static buffers, pool
        memory) every later replay rewrites, so a backward through it would compute another
        call's gradients. Said once per runner."""
        if self._warned_for_autograd:
            return
        self._warned_for_autograd = True
        log.warning("cgcompile: %s: a call that needs gradients runs eagerly, without breakable graphs (a "
                    "backward through a replay would read memory later replays rewrite); run inference under "
                    "torch.no_grad(), or train through torch.compile(model, backend='cgcompile')", self.name)

    def _needs_gradients(self, leaves: list) -> bool:
        """Whether eager's call would build an autograd graph (read with grad mode on only)."""
        return (any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
                or any(p.requires_grad for p in self.module.parameters()))

    # -- replay ---------------------------------------------------------------------------

    def _replay(self, entry: _BreakableGraph, leaves: list, n: int, size: int):
        for index, static in entry.statics:
            static.refresh(leaves[index], n, size)
        live = leaves
        if n != size and entry.live_tensor_inputs:  # eager steps see every tensor at the padded size
            live = list(leaves)
            for index in entry.live_tensor_inputs:
                live[index] = padded_rows_copy(leaves[index], n, size)
        replay_steps(entry.steps, live)
        for index, buffer in entry.written:
            write_back(leaves[index], live[index] if buffer is None else buffer)
        # A replay rewrites the static outputs behind autograd's back; bump their version so
        # that whoever remembers one as unchanged (`StaticInput.refresh`) sees that it changed.
        for t in entry.output_tensors:
            increment_version(t)
        return _cut(entry.outputs, n, size, self.clone_outputs)

    # -- observe or capture -----------------------------------------------------------------

    def _record(self, action: Action, leaves: list, structure: tuple, n: int, size: int):
        """Run the call under the recorder: observe it (learn its signature) or capture it."""
        observe = action is Action.OBSERVE
        backend = observer_for(self.segments, self.session) if observe else segments_for(self.segments, self.session)
        statics = [self.group.statics.static_for(x, n, size) if isinstance(x, torch.Tensor) else None for x in leaves]
        call_leaves = [x if static is None else static.buffer for x, static in zip(leaves, statics)]
        args, kwargs = unflatten_call(call_leaves, structure)
        rows = {i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n}
        recorder = Recorder(f"{self.name}[size {size}]", backend, self.config.split_ops, call_leaves, structure,
                            self.module, rows, self.live_types)
        with self.recording_hooks, backend.context():
            with recorder:
                outputs = self._forward(*args, **kwargs)
            recording = recorder.finish(outputs)
        for index in recording.written_inputs:  # the call ran on copies: hand its writes over
            write_back(leaves[index], call_leaves[index])
        if observe:
            self.rule.observed(size, recording.signature)
            return _cut(outputs, n, size, clone=False)
        if recording.signature.uncapturable:  # correct results all the same: the recorder ran the call
            self.rule.uncapturable(size, recording.signature)
            return _cut(outputs, n, size, clone=True)  # out of the graphs' pool, which is dropped
        output_tensors = [x for x in pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor)]
        self.group.statics.add_outputs(output_tensors)  # the entry keeps them alive
        static_inputs = set(recording.static_inputs)
        written = [(i, statics[i].buffer if i in static_inputs else None) for i in recording.written_inputs]
        entry = _BreakableGraph(recording.signature, recording.steps,
                                [(i, statics[i]) for i in recording.static_inputs],
                                recording.live_tensor_inputs, written, outputs, output_tensors, recording.keep_alive)
        self.rule.captured(size, recording.signature, entry)
        dump_dir = self.config.resolved_dump_dir()
        if dump_dir:
            self.group.dump(dump_dir)
        return _cut(outputs, n, size, self.clone_outputs)


def write_back(x: torch.Tensor, written: torch.Tensor) -> None:
    """Copy into the caller's tensor x what the call wrote into `written`: x's static
    buffer, or the padded copy an eager step got (their first rows when padded); nothing
    when the call wrote into x itself."""
    if written is x or (written.data_ptr() == x.data_ptr() and written.stride() == x.stride()
                        and written.shape == x.shape):
        return
    x.copy_(written if written.shape == x.shape else written[:x.shape[0]])


def _cut(outputs, n: int, size: int, clone: bool):
    if isinstance(outputs, torch.Tensor):  # the common case: skip pytree
        return _cut_one(outputs, n, size, clone)
    return pytree.tree_map(lambda x: _cut_one(x, n, size, clone) if isinstance(x, torch.Tensor) else x, outputs)


def _cut_one(x: torch.Tensor, n: int, size: int, clone: bool) -> torch.Tensor:
    if n != size and x.dim() > 0 and x.shape[0] == size:
        x = x[:n]
    return x.clone() if clone else x
