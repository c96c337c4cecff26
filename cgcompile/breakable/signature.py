"""Which calls a breakable graph serves, and the rule that decides when a call gets one.

A breakable graph reads every tensor its captured segments read at a fixed address and
at a fixed shape; everything else a call passes is either handed live to the eager steps
or frozen into the graph. So a call's *signature* at a given size is:

  - its argument structure (positional count, keyword names, nested tuples/lists/dicts);
  - for each tensor a captured op reads: its shape (dim 0 may be the call's row count,
    padded to the size) and dtype;
  - for each tensor only eager steps read (an attention mask whose length grows with the
    cache): its dtype and rank, never its shape: the eager step gets the call's tensor;
  - for each object of a live type (a transformers `Cache`): its type: eager steps get
    the call's object;
  - every other Python value (`use_cache=True`, a module, None): its value, frozen.

Which tensors captured ops read is known only after running the module under the
recorder (an *observation*, see `breakable.record`). The rule, per size:

  1. a call that fits a captured graph replays it;
  2. a call whose signature was observed, and that the previous call of this size also
     had, is captured (so the prefill of a generate() call, followed by decode steps of
     another signature, runs eagerly, and the second decode step is captured);
  3. a call whose signature was observed but differs from the previous call's runs
     eagerly, as does one whose signature cannot be captured (the reason is logged);
  4. any other call is observed: it runs eagerly under the recorder, which learns its
     signature; the decision is logged once per new signature.

At most `MAX_GRAPHS_PER_SIZE` signatures get graphs per size (later ones run eagerly,
logged once) and the last `MAX_OBSERVED_PER_SIZE` observed signatures are remembered.
Ahead-of-time capture overrides the rule: its warm-up run observes, its capture run
captures.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any

import torch

from ..run.capture import Mode

log = logging.getLogger(__name__)

MAX_GRAPHS_PER_SIZE = 4
MAX_OBSERVED_PER_SIZE = 16


# -- call structure ----------------------------------------------------------------------------


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, tuple]:
    """(leaves, structure) of a call. Plain tuples, lists and dicts are walked; anything
    else (tensors, modules, caches, dataclasses) is a leaf. `structure` is hashable and
    compares in C: the fast check that two calls have the same shape of arguments."""
    leaves: list = []
    return leaves, (_flatten_items(args, leaves), tuple(kwargs), _flatten_items(kwargs.values(), leaves))


def _flatten_items(items, leaves: list) -> tuple:
    return tuple([_flatten(item, leaves) for item in items])


def _flatten(value, leaves: list):
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind, _flatten_items(value, leaves))
    if kind is dict:
        return (dict, tuple(value), _flatten_items(value.values(), leaves))
    leaves.append(value)
    return None


def is_flat(structure: tuple) -> bool:
    """Whether no argument of the call is a tuple, list or dict: then the leaves are the
    positional args followed by the keyword values."""
    arg_keys, _, value_keys = structure
    return all(key is None for key in arg_keys) and all(key is None for key in value_keys)


def unflatten_call(leaves: list, structure: tuple) -> tuple[tuple, dict]:
    """The (args, kwargs) that `flatten_call` took apart, with `leaves` in their places."""
    it = iter(leaves)
    arg_keys, names, value_keys = structure
    args = tuple(_rebuild(key, it) for key in arg_keys)
    return args, dict(zip(names, (_rebuild(key, it) for key in value_keys)))


def _rebuild(key, it):
    if key is None:
        return next(it)
    if key[0] is dict:
        return dict(zip(key[1], (_rebuild(k, it) for k in key[2])))
    return key[0](_rebuild(k, it) for k in key[1])


def leaf_names(structure: tuple) -> list[str]:
    """Readable names of a call's leaves, in leaf order: `args[0]`, `attention_mask`,
    `position_embeddings[1]`. For log lines and error messages only."""
    arg_keys, names, value_keys = structure
    out: list[str] = []
    for i, key in enumerate(arg_keys):
        _names(key, f"args[{i}]", out)
    for name, key in zip(names, value_keys):
        _names(key, name, out)
    return out


def _names(key, prefix: str, out: list[str]) -> None:
    if key is None:
        out.append(prefix)
    elif key[0] is dict:
        for name, k in zip(key[1], key[2]):
            _names(k, f"{prefix}[{name!r}]", out)
    else:
        for i, k in enumerate(key[1]):
            _names(k, f"{prefix}[{i}]", out)


def same_value(a: Any, b: Any) -> bool:
    """Whether a frozen Python value still holds: identity, else a plain bool `==`."""
    if a is b:
        return True
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - objects whose == raises are simply not equal
        return False
    return equal is True


# -- signatures --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StaticTensor:
    """A tensor input that captured ops read: the graph reads it at one shape."""

    index: int
    shape: tuple[int, ...]  # the static buffer's: dim 0 is the size when rows follow the call
    dtype: torch.dtype
    rows_follow_call: bool  # dim 0 is the call's row count (padded to the size)


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a call must look like to replay a graph (see the module docstring)."""

    structure: tuple
    static: tuple[StaticTensor, ...]
    live_tensors: tuple[tuple[int, torch.dtype, int], ...]  # (index, dtype, ndim): eager steps read them
    live_objects: tuple[tuple[int, type], ...]  # (index, type): objects passed live to eager steps
    values: tuple[tuple[int, Any], ...]  # (index, value): frozen Python values
    uncapturable: str | None = None  # why no graph can serve this signature

    def __post_init__(self):
        # Plain tuples for the check every call makes (`fits`): no method call per input.
        fixed = tuple((s.index, torch.Size(s.shape), s.dtype) for s in self.static if not s.rows_follow_call)
        rows = tuple((s.index, torch.Size(s.shape), torch.Size(s.shape[1:]), s.dtype)
                     for s in self.static if s.rows_follow_call)
        object.__setattr__(self, "_fixed", fixed)
        object.__setattr__(self, "_rows", rows)

    def fits(self, leaves: list, structure: tuple, n: int) -> bool:
        if structure != self.structure:
            return False
        Tensor = torch.Tensor
        for index, shape, dtype in self._fixed:
            x = leaves[index]
            if not isinstance(x, Tensor) or x.shape != shape or x.dtype != dtype:
                return False
        for index, shape, tail, dtype in self._rows:
            x = leaves[index]
            if not isinstance(x, Tensor) or x.dtype != dtype:
                return False
            if x.shape != shape and (x.shape[0] != n or x.shape[1:] != tail):  # a full call, or n padded rows
                return False
        for index, dtype, ndim in self.live_tensors:
            x = leaves[index]
            if not isinstance(x, Tensor) or x.dtype != dtype or x.dim() != ndim:
                return False
        for index, kind in self.live_objects:
            if type(leaves[index]) is not kind:
                return False
        for index, value in self.values:
            x = leaves[index]
            if x is not value and not same_value(x, value):
                return False
        return True

    def describe(self) -> str:
        names = leaf_names(self.structure)
        parts = [f"{names[s.index]} {tuple(s.shape)} {str(s.dtype).replace('torch.', '')}" for s in self.static]
        live = [names[i] for i, _, _ in self.live_tensors] + [names[i] for i, _ in self.live_objects]
        if live:
            parts.append(f"live: {', '.join(live)}")
        return "; ".join(parts) or "no tensor inputs"


def same_signature(a: Signature, b: Signature) -> bool:
    """Signatures learned from two runs of the same calls: equal but for object values."""
    return (a.structure == b.structure and a.static == b.static and a.live_tensors == b.live_tensors
            and a.live_objects == b.live_objects and len(a.values) == len(b.values)
            and all(i == j and same_value(u, v) for (i, u), (j, v) in zip(a.values, b.values)))


# -- the rule ----------------------------------------------------------------------------------


class Action(enum.Enum):
    REPLAY = "replay"  # a captured graph serves the call
    CAPTURE = "capture"  # capture a graph for the call's signature (and run the call)
    OBSERVE = "observe"  # run eagerly under the recorder to learn the signature
    EAGER = "eager"  # run the module's forward as is


@dataclasses.dataclass
class Decision:
    action: Action
    signature: Signature | None = None
    entry: Any = None  # the graph to replay


@dataclasses.dataclass
class _SizeState:
    graphs: list = dataclasses.field(default_factory=list)  # [(Signature, entry)], capture order
    observed: list = dataclasses.field(default_factory=list)  # [Signature], most recent last
    last: Signature | None = None  # the signature of the previous call of this size
    full_warned: bool = False


class SignatureRule:
    """The per-size bookkeeping of one runner and its decisions (module docstring).

    name: what log lines call the runner. logged: a set shared by runners whose lines
    would repeat (the decoder layers of one model), so each line is logged once.
    """

    def __init__(self, name: str, logged: set | None = None):
        self.name = name
        self.logged = logged if logged is not None else set()
        self.sizes: dict[int, _SizeState] = {}

    def decide(self, size: int, leaves: list, structure: tuple, n: int, mode: Mode) -> Decision:
        state = self.sizes.get(size)
        if state is None:
            state = self.sizes[size] = _SizeState()
        for signature, entry in state.graphs:
            if signature.fits(leaves, structure, n):
                state.last = signature
                if mode is Mode.WARMUP:  # an ahead-of-time warm-up of a size already captured
                    return Decision(Action.EAGER, signature)
                return Decision(Action.REPLAY, signature, entry)
        known = next((s for s in reversed(state.observed) if s.fits(leaves, structure, n)), None)
        if mode is Mode.CAPTURE:
            return Decision(Action.EAGER if known and known.uncapturable else Action.CAPTURE, known)
        if known is None or mode is Mode.WARMUP:
            return Decision(Action.OBSERVE)
        previous, state.last = state.last, known
        if known.uncapturable or previous is not known:
            return Decision(Action.EAGER, known)
        if len(state.graphs) >= MAX_GRAPHS_PER_SIZE:
            self._warn_full(size, state, known)
            return Decision(Action.EAGER, known)
        return Decision(Action.CAPTURE, known)

    def observed(self, size: int, signature: Signature) -> Signature:
        """Remember a signature learned by observation; returns the one to use from now
        on (an equal one seen before keeps its place)."""
        state = self.sizes.setdefault(size, _SizeState())
        for known in state.observed:
            if same_signature(known, signature):
                state.last = known
                return known
        state.observed.append(signature)
        del state.observed[:-MAX_OBSERVED_PER_SIZE]
        state.last = signature
        if signature.uncapturable:
            self._log_once(logging.WARNING, (size, signature.describe(), signature.uncapturable),
                           "cgcompile: %s: calls of size %d with signature [%s] run eagerly: %s",
                           self.name, size, signature.describe(), signature.uncapturable)
        else:
            self._log_once(logging.INFO, (size, signature.describe()),
                           "cgcompile: %s: new call signature at size %d [%s]: runs eagerly; captured "
                           "once two calls in a row of this size have it", self.name, size, signature.describe())
        return signature

    def uncapturable(self, size: int, signature: Signature) -> Signature:
        """A capture found that `signature` cannot be captured: remember that instead."""
        state = self.sizes.setdefault(size, _SizeState())
        state.observed = [s for s in state.observed if not same_signature(s, signature)]
        return self.observed(size, signature)

    def captured(self, size: int, signature: Signature, entry: Any) -> None:
        state = self.sizes.setdefault(size, _SizeState())
        state.graphs.append((signature, entry))
        state.last = signature
        self._log_once(logging.INFO, ("captured", size, signature.describe()),
                       "cgcompile: %s: captured a breakable graph for size %d [%s]",
                       self.name, size, signature.describe())

    def graph_count(self) -> int:
        return sum(len(state.graphs) for state in self.sizes.values())

    def graphs(self, size: int) -> list:
        state = self.sizes.get(size)
        return [entry for _, entry in state.graphs] if state else []

    def clear(self) -> None:
        """Forget the graphs; observed signatures stay (they describe the model, not memory)."""
        for state in self.sizes.values():
            state.graphs.clear()
            state.last = None

    def _warn_full(self, size: int, state: _SizeState, signature: Signature) -> None:
        if not state.full_warned:
            state.full_warned = True
            self._log_once(logging.WARNING, ("full", size),
                           "cgcompile: %s: size %d already has graphs for %d call signatures "
                           "(MAX_GRAPHS_PER_SIZE); calls with another signature [%s] run eagerly",
                           self.name, size, MAX_GRAPHS_PER_SIZE, signature.describe())

    def _log_once(self, level: int, key: tuple, message: str, *args) -> None:
        key = (self.name,) + key
        if key not in self.logged:
            self.logged.add(key)
            log.log(level, message, *args)
