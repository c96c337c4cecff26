"""Differential fuzzer: random models from a grammar of real-model ops, compiled with
cgcompile and compared with eager at sizes on and off the capture sizes.

    python -m cgcompile.fuzz --cases 2000 --seed 0 [--compiler eager|inductor|both]
                             [--device cpu|cuda] [--padding true|none|false]
                             [--full-graph off|pieces|whole] [--path compiled|breakable]
                             [--sequence [LENGTH]]

A case is one seed: `generate(seed)` builds a `Program` (a model written as Python
source, from the grammar in `cgcompile.testing.grammar`), `run_case` compiles one instance
with `cgcompile.Backend` (or runs it from breakable graphs: `--path breakable`) and
compares it with another, run eagerly, at a few sizes of the capture dimension
(`case_sizes`: a capture size, one between capture sizes, one above the largest, then a
return to one of them). Where a size is called more than once in a row (full graphs,
breakable graphs: observe, capture, replay), each call's float inputs are scaled
differently, so that a replay reading what an earlier call left behind shows.

The sequence mode (`--sequence [LENGTH]`, `Setup.sequence`) runs each case as a walk of
LENGTH sizes (8 by default; `sequence_sizes`) that mixes 1, capture sizes, sizes between
and above them, and returns to earlier ones, e.g. (1, 3, 1, 8, 3, 16, 1, 1); and its
programs keep state across calls (the grammar's "state" productions: a plain attribute
holding a view of a tensor the call made, read by the next call, as a sliding-window KV
cache). The reference and the compiled model each keep their own state and see the same
calls, so their outputs must match at every call: state that aliases graph memory some
later graph (another size, another Dynamo graph) overwrites shows as a mismatch. On
`--path breakable` the walks run programs without state (see `Setup.case`).

A failure is shrunk (`shrink`: drop sizes, keeping a return the failure needs, and
steps while it persists) and reported as a standalone script (`reproducer`, which prints
the sizes in order); `run_campaign` groups failures into classes by the productions
their shrunk programs keep.

A program may write into an input it is handed, and return nothing (the grammar's "sink"
productions): the compiled model and eager each get their own copy of the inputs, and
what a call produced is its outputs and then the inputs it writes, as they are after it.

Statuses: a compiled result that differs from eager beyond float reordering (`error`
above 1) is a "mismatch"; an exception from the compiled model where eager ran is an
"error"; an exception from eager, or from torch.compile without cgcompile, is
"invalid" (a generator bug). A difference no larger
than eager's own answer moves under a 1e-6 perturbation of the inputs (a near tie in a
sort, an amplifying chain of ops) is "unstable" and not counted as a failure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import logging
import math
import random
import sys
import time
import warnings
from typing import Callable, Sequence

import torch

from ..backend import Backend
from ..config import Config
from .grammar import HEADER, PRODUCTIONS, Program, generate, load, source

__all__ = [
    "CAPTURE_SIZES", "FAILURES", "FULL_GRAPH_MODES", "PATHS", "PRODUCTIONS", "SEQUENCE_LENGTH", "Outcome", "Program",
    "Report", "Setup", "case_sizes", "compare", "error", "generate", "load", "main", "reproducer", "run_campaign",
    "run_case", "sequence_sizes", "shrink", "source",
]

CAPTURE_SIZES = (1, 2, 4, 8)
SEQUENCE_LENGTH = 8  # sizes a case runs in the sequence mode, by default
RTOL, ATOL = 1e-4, 1e-5  # ATOL against the output's largest |eager value|, at least 1


# -- running a case --------------------------------------------------------------------------


def case_sizes(seed: int) -> tuple[int, ...]:
    """One capture size, one size between them, one above the largest; sometimes 1 (Dynamo
    compiles n=1 as a static graph of its own); then a return to one of them but the last
    (cheap: nothing new to compile, but graphs of other sizes ran in between)."""
    rng = random.Random(f"sizes-{seed}")
    sizes = [rng.choice((3, 5, 6, 7)), rng.choice((2, 4, 8)), rng.choice((9, 11, 13, 16))]
    rng.shuffle(sizes)
    if sizes[0] == 2:  # a first n of 2 makes AOT specialize `x[1:]` (one row) and reject mark_dynamic
        sizes.append(sizes.pop(0))
    if rng.random() < 0.25:
        sizes.append(1)
    sizes.append(rng.choice(sizes[:-1]))  # drawn last: the sizes before stay what they were
    return tuple(sizes)


def sequence_sizes(seed: int, length: int = 8) -> tuple[int, ...]:
    """A walk of `length` sizes that returns to earlier ones, as a server's batch sizes do:
    1, a capture size, one between capture sizes, one above the largest (and sometimes a
    second between), each at least once where `length` allows, mixed with returns to a
    size seen before and stays at the last one (state a call keeps is read back at its n).
    E.g. (1, 3, 1, 8, 3, 16, 1, 1). Never 2 as the first n above 1 (see `case_sizes`)."""
    rng = random.Random(f"sequence-{seed}")
    kinds = [1, rng.choice((2, 4, 8)), rng.choice((3, 5, 6, 7)), rng.choice((9, 11, 13, 16))]
    if rng.random() < 0.5:
        kinds.append(rng.choice([n for n in (3, 5, 6, 7) if n not in kinds]))
    rng.shuffle(kinds)
    unseen = kinds[: max(length - 1, 1)]  # room for one return at least
    sizes = [unseen.pop()]
    while len(sizes) < length:
        if unseen and (len(unseen) >= length - len(sizes) or len(sizes) < 2 or rng.random() < 0.5):
            sizes.append(unseen.pop())
        elif rng.random() < 0.25:
            sizes.append(sizes[-1])
        else:
            sizes.append(rng.choice([n for n in sizes if n != sizes[-1]] or sizes))
    return _first_dynamic_n_not_2(sizes)


def _first_dynamic_n_not_2(sizes: list[int]) -> tuple[int, ...]:
    """Where 2 is the first n above 1, swap it with the next other n above 1 (or 4)
    everywhere: the walk keeps its returns."""
    dynamic = [n for n in sizes if n > 1]
    other = next((n for n in dynamic if n != 2), 4)
    if not dynamic or dynamic[0] != 2:
        return tuple(sizes)
    return tuple({2: other, other: 2}.get(n, n) for n in sizes)


# AOTAutograd guards a graph that slices one row off a marked-dynamic dim (`x[1:]`, a token
# shift) on n != 2, at whatever n it compiled first; n=2 then recompiles and specializes the
# marked dim, which torch.compile rejects (ConstraintViolationError) with or without
# cgcompile (its backend "eager" does not trace through AOT and is not affected). Such a
# program's walk takes 4 instead of 2 under Inductor.
_AOT_SPECIALIZES_TWO = "shift_rows"

FULL_GRAPH_MODES = ("off", "pieces", "whole")
PATHS = ("compiled", "breakable")


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a case is compiled and run: cgcompile's compiler, the device, `Config.padding`,
    and full graphs: "off"; "pieces" (every split op declared capturable, so a call whose
    host-side inputs repeat replays one graph of the pieces' code); "whole" (the same, the
    full graph being the whole graph compiled as one: `Config.full_graph_compile`). With
    full graphs each size is called `calls` times in a row: the first call of a size runs
    piecewise, the second captures, the third replays. fuse_sibling_linears: the Config field.
    sequence: 0, or the length of the walk of sizes each case runs (`case`).
    path "breakable": no compile; `GraphManager` runs the model from breakable graphs
    (`op_replay` segments on the CPU), each size called three times (observe, capture,
    replay); the compiler and full-graph fields do not apply, and padding=True pads on the
    user's word that rows never mix (a row-mixing program then fails, as documented)."""

    compiler: str = "eager"
    device: str = "cpu"
    padding: bool | None = True
    full_graph: str = "off"
    fuse_sibling_linears: bool | None = None  # None: the Config default
    path: str = "compiled"
    sequence: int = 0

    def case(self, seed: int) -> tuple[Program, tuple[int, ...]]:
        """A seed's program and sizes: `case_sizes`, or with `sequence` a walk of that many
        sizes (`sequence_sizes`) and, on the compiled path, a program that keeps state in
        attributes across calls. (Breakable graphs replay what a captured op read from an
        attribute as it was at capture: state a call changes must be read in an eager
        break, docs/breakable.md, "Breakable CUDA graphs and the manager"; these programs
        do not.)"""
        if self.sequence:
            program, sizes = generate(seed, stateful=self.path == "compiled"), sequence_sizes(seed, self.sequence)
        else:
            program, sizes = generate(seed), case_sizes(seed)
        if self.compiler == "inductor" and _AOT_SPECIALIZES_TWO in program.productions:
            sizes = tuple(4 if n == 2 else n for n in sizes)  # see `_AOT_SPECIALIZES_TWO`
        return program, sizes

    @property
    def calls(self) -> int:
        return 1 if self.full_graph == "off" and self.path == "compiled" else 3

    @property
    def segments(self) -> str:
        return "op_replay" if self.device == "cpu" else "cuda_graphs"

    def config_source(self) -> str:
        if self.path == "breakable":
            return (f"cgcompile.Config(capture_sizes={CAPTURE_SIZES}, padding={self.padding}, "
                    f"splitting_ops=cgcompile.testing.models.FUZZ_SPLIT_OPS, use_breakable=True, "
                    f"cudagraphs={self.device == 'cuda' or None})")
        full = ", full_graph=None"  # "off" means piecewise only, not the automatic full graph of CUDA
        if self.full_graph != "off":
            full = (f", capturable_split_ops=cgcompile.testing.models.FUZZ_SPLIT_OPS + ('attention',), "
                    f"full_graph_compile={self.full_graph == 'whole'}")
        return (
            f"cgcompile.Config(compiler={self.compiler!r}, capture_sizes={CAPTURE_SIZES}, "
            f"padding={self.padding}, splitting_ops=cgcompile.testing.models.FUZZ_SPLIT_OPS{full}, "
            f"fuse_sibling_linears={self.fuse_sibling_linears})"
        )

    def config(self) -> Config:
        from .models import FUZZ_SPLIT_OPS

        if self.path == "breakable":  # on CUDA, graphs whether or not the model has parameters
            return Config(capture_sizes=CAPTURE_SIZES, padding=self.padding, splitting_ops=FUZZ_SPLIT_OPS,
                          use_breakable=True, cudagraphs=self.device == "cuda" or None)
        full = {"full_graph": None}  # "off" means piecewise only, not the automatic full graph of CUDA
        if self.full_graph != "off":
            full = dict(capturable_split_ops=FUZZ_SPLIT_OPS + ("attention",),
                        full_graph_compile=self.full_graph == "whole")
        return Config(compiler=self.compiler, capture_sizes=CAPTURE_SIZES, padding=self.padding,
                      splitting_ops=FUZZ_SPLIT_OPS, fuse_sibling_linears=self.fuse_sibling_linears, **full)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """status: "ok"; "mismatch" (compiled differs from eager); "error" (compiled raised
    where eager did not); "unstable" (differs, but no more than eager's own answer moves
    under a tiny perturbation: not counted); "invalid" (eager, or torch.compile without
    cgcompile, raised: a bug of the generator)."""

    status: str
    size: int | None = None
    detail: str = ""
    graphs: int = 0  # Dynamo graphs the backend saw (1, plus 1 when n=1 ran)
    padded: bool = False  # some graph ran padded to the capture sizes (`Piece.sizes`)
    full_calls: int = 0  # calls that took the full path (Setup.full_graph)
    fused_linears: int = 0  # linears fused away (Setup.fuse_sibling_linears)
    breakable_graphs: int = 0  # breakable graphs captured (Setup.path "breakable")
    position: int | None = None  # where in the case's sizes `size` failed (a size may recur)

    @property
    def kind(self) -> str:
        """What must stay the same while shrinking: the status, and an error's type."""
        return self.detail.split(":", 1)[0] if self.status in ("error", "invalid") else self.status


FAILURES = ("mismatch", "error", "invalid")


def run_case(program: Program, sizes: Sequence[int], setup: Setup) -> Outcome:
    """Compile the program with cgcompile (or run it from breakable graphs) and compare it
    with eager at each size, in order."""
    torch._dynamo.reset()
    namespace = load(program)
    # Two instances, equal by their seeded initialization: a model may write its buffers.
    reference, model = namespace["Model"]().to(setup.device), namespace["Model"]().to(setup.device)
    if setup.path == "breakable":
        return _run_breakable(program, namespace, reference, model, sizes, setup)
    backend = Backend(setup.config())
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    outcome = _run_sizes(program, namespace, reference, compiled, sizes, setup, _state_marker(namespace, model))
    outcome = _check_plans(outcome, backend, sizes)
    if setup.device == "cuda":
        backend.clear()  # return the case's graph pool before the next case
    tried = sizes[: _failing_position(sizes, outcome) + 1] if outcome.status == "error" else ()
    if tried and _rejected_by_torch(program, namespace, tried, setup):
        detail = f"torch.compile rejects it too: {outcome.detail}"
        outcome = dataclasses.replace(outcome, status="invalid", detail=detail)
    padded = any(piece.sizes.startswith("padded") for piece in backend.pieces)
    stats = backend.stats
    return dataclasses.replace(outcome, graphs=stats.graphs_seen, padded=padded, full_calls=stats.full_graph_calls,
                               fused_linears=stats.fused_linears)


def _check_plans(outcome: Outcome, backend: Backend, sizes: Sequence[int]) -> Outcome:
    """An error (placed at the walk's end) where calls ran the stitch because no replay
    plan could be made: the results still match, but the fast path failed to build."""
    failures = [f"n={n}, size {size}: {why}" for rt in backend.runtimes if rt.plans is not None
                for (n, size), why in rt.plans.failures.items()]
    if outcome.status != "ok" or not failures:
        return outcome
    detail = _one_line(RuntimeError(f"no replay plan at {failures[0]}"))
    return Outcome("error", sizes[-1], detail, position=len(sizes) - 1)


def _run_breakable(program: Program, namespace: dict, reference, model, sizes, setup: Setup) -> Outcome:
    from ..manager import GraphManager

    manager = GraphManager(model, setup.config(), boundary=None, segments=setup.segments)
    outcome = _run_sizes(program, namespace, reference, lambda *inputs: manager.run_pw_graph(model, inputs),
                         sizes, setup, _state_marker(namespace, model))
    graphs = manager.breakable.graph_count()
    if setup.device == "cuda":
        manager.clear()  # return the case's graph pool before the next case
    return dataclasses.replace(outcome, breakable_graphs=graphs)


def _state_marker(namespace: dict, model) -> Callable[[], None]:
    """What runs before each call of the compiled model: the program's `mark_state`."""
    mark_state = namespace.get("mark_state")
    return (lambda: mark_state(model)) if mark_state else (lambda: None)


def _run_sizes(program: Program, namespace: dict, reference, compiled, sizes, setup: Setup,
               before_call: Callable[[], None]) -> Outcome:
    """Each size `setup.calls` times in a row, in order; the first outcome that is not ok.
    The reference and the compiled model see the same calls in the same order, so state
    either keeps across calls is the same in both where cgcompile is right."""
    names = [v.name for v in program.outputs + program.written_inputs]
    written = tuple(i for i, v in enumerate(program.used_inputs()) if v in program.written_inputs)
    with _grad_mode(program), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for position, n in enumerate(sizes):
            for call in range(setup.calls):
                before_call()
                outcome = _run_size(namespace["make_inputs"], reference, compiled, n, setup.device, names, call,
                                    written)
                if outcome.status != "ok":
                    return dataclasses.replace(outcome, position=position)
    return Outcome("ok")


def _run_size(make_inputs, reference, compiled, n: int, device: str, names, call: int = 0,
              written: tuple[int, ...] = ()) -> Outcome:
    """written: the positions of the inputs the program writes into; each model gets its
    own copy of those (made alike: `make_inputs` is seeded by n)."""
    def fresh() -> tuple:
        inputs = make_inputs(n, device)
        if call:  # other data than the call before: a replay that reads stale inputs differs
            with torch.no_grad():
                for t in inputs:
                    if t.is_floating_point():
                        t.mul_(1.0 + 0.5 * call)
        return inputs

    inputs = fresh()
    reference_inputs, unwritten = (fresh(), fresh()) if written else (inputs, inputs)
    before = copy.deepcopy(reference)  # its buffers and state as they were before this call
    try:
        want = reference(*reference_inputs)
    except Exception as e:  # the generator wrote a program eager rejects
        return Outcome("invalid", n, _one_line(e))
    try:
        got = compiled(*inputs)
    except Exception as e:
        return Outcome("error", n, _one_line(e))
    if (got is None) != (want is None):
        return Outcome("mismatch", n, f"returned {type(got).__name__}, eager {type(want).__name__}")
    got, want = _produced(got, inputs, written), _produced(want, reference_inputs, written)
    distance = error(got, want)
    if distance <= 1:
        return Outcome("ok")
    status = "unstable" if distance <= 10 * _wobble(before, unwritten, want, written) else "mismatch"
    return Outcome(status, n, compare(got, want, names))


def _produced(outputs, inputs: Sequence, written: tuple[int, ...]) -> tuple:
    """What a call produced: its outputs (none where it returned None), then the inputs it
    wrote into, as they are after it."""
    return tuple(outputs or ()) + tuple(inputs[i] for i in written)


def _grad_mode(program: Program):
    return torch.inference_mode() if program.inference_mode else torch.no_grad()


def _rejected_by_torch(program: Program, namespace: dict, sizes: Sequence[int], setup: Setup) -> bool:
    """Whether torch.compile without cgcompile (its eager backend, or Inductor for the
    whole graph) fails too: then the program (a construct Dynamo cannot trace whole, a
    size AOT specializes), not cgcompile, is at fault."""
    torch._dynamo.reset()
    model = namespace["Model"]().to(setup.device)
    compiled = torch.compile(model, backend="inductor" if setup.compiler == "inductor" else "eager", fullgraph=True)
    before_call = _state_marker(namespace, model)
    try:
        with _grad_mode(program), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for n in sizes:
                before_call()
                compiled(*namespace["make_inputs"](n, setup.device))
    except Exception:
        return True
    return False


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _wobble(before, inputs, want, written: tuple[int, ...] = ()) -> float:
    """How far eager's own answer moves (in tolerances, as `error`) when the float inputs
    move by a relative 1e-6: large for a near tie in a sort or an amplifying chain of
    ops, where a reordering of float sums may legitimately move the answer as far.
    `before` is the eager model as it was before the call (each try runs a copy of it)."""
    g = torch.Generator().manual_seed(1)
    moves = []
    for _ in range(2):
        moved = [
            t * (1 + 1e-6 * torch.randn(t.shape, generator=g).to(t.device)) if t.is_floating_point() else t
            for t in inputs
        ]
        moves.append(error(_produced(copy.deepcopy(before)(*moved), moved, written), want))
    return max(moves)


def error(got, want) -> float:
    """How far the compiled outputs are from eager's, in tolerances: at most 1 is a match.
    The tolerance of an entry is RTOL of its eager value plus ATOL of its output's
    largest eager value (at least 1); a different shape, dtype, integer or NaN is inf."""
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        return math.inf
    return max((_tensor_error(a, b) for a, b in zip(got, want)), default=0.0)


def _tensor_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    a, b = a.detach().cpu(), b.detach().cpu()
    if not b.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    finite = b.isfinite() & a.isfinite()
    if not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()) or (a.isfinite() != b.isfinite()).any():
        return math.inf  # NaN or inf where the other has none, or another infinity
    if not finite.any():
        return 0.0
    a, b = a[finite].double(), b[finite].double()
    scale = max(b.abs().max().item(), 1.0)
    return ((a - b).abs() / (ATOL * scale + RTOL * b.abs())).max().item()


def compare(got, want, names: Sequence[str]) -> str | None:
    """None when the compiled outputs match eager's (`error` at most 1), else the first
    output that differs, in words."""
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        count = len(got) if isinstance(got, (tuple, list)) else 1
        return f"returned {type(got).__name__} of {count}, eager {len(want)}"
    for name, a, b in zip(names, got, want):
        if _tensor_error(a, b) > 1:
            return f"output {name}: {_describe_difference(a.detach().cpu(), b.detach().cpu())}"
    return None


def _describe_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{list(a.shape)}, eager {b.dtype}{list(b.shape)}"
    scale = max(b.nan_to_num(0, 0, 0).abs().max().item(), 1.0) if b.is_floating_point() else 0
    bad = ~(torch.isclose(a, b, RTOL, ATOL * scale, equal_nan=True) if b.is_floating_point() else a == b)
    first = tuple(i.item() for i in bad.nonzero()[0])
    worst = f", max error {(a - b)[bad].abs().max().item():.3g}" if b.is_floating_point() else ""
    where = f"first at {list(first)}: {a[first].item():.6g}, eager {b[first].item():.6g}"
    return f"{bad.sum().item()} of {b.numel()} entries differ{worst}; {where}"


# -- shrinking and reproducers ---------------------------------------------------------------


Check = Callable[[Program, tuple[int, ...]], Outcome]


def shrink(program: Program, sizes: tuple[int, ...], outcome: Outcome, check: Check, budget_s: float = 60.0):
    """Drop sizes, then steps, while `check` (`run_case` under one setup) still fails the
    same way (`Outcome.kind`). Returns the smallest (program, sizes, outcome) found
    within the time budget. Sizes: the failing size alone or after one earlier size,
    else the walk up to the failure with single sizes dropped (a failure that needs a
    size revisited keeps the calls in between)."""
    deadline = time.monotonic() + budget_s

    def still_fails(candidate: Program, candidate_sizes) -> Outcome | None:
        if not candidate.steps or time.monotonic() > deadline:
            return None
        result = check(candidate, candidate_sizes)
        return result if result.kind == outcome.kind else None

    for fewer in _fewer_sizes(sizes, outcome):
        result = still_fails(program, fewer)
        if result:
            sizes, outcome = fewer, result
            break
    sizes, outcome = _drop_sizes_one_by_one(program, sizes, outcome, still_fails)
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(program.steps))):
            if i >= len(program.steps):  # an earlier drop took dependent steps with it
                continue
            candidate = program.without_step(i)
            result = still_fails(candidate, sizes)
            if result:
                program, outcome, changed = candidate, result, True
    return program, sizes, outcome


def _failing_position(sizes: Sequence[int], outcome: Outcome) -> int | None:
    if outcome.position is not None:
        return outcome.position
    return sizes.index(outcome.size) if outcome.size in sizes else None


def _fewer_sizes(sizes: tuple[int, ...], outcome: Outcome) -> list[tuple[int, ...]]:
    position = _failing_position(sizes, outcome)
    if position is None:
        return []
    failing, before = sizes[position], sizes[:position]
    options = [(failing,)] if failing > 1 else []
    options += [(s, failing) for s in dict.fromkeys(before)]
    options.append(sizes[: position + 1])
    return [o for o in dict.fromkeys(options) if len(o) < len(sizes)]


def _drop_sizes_one_by_one(program: Program, sizes: tuple[int, ...], outcome: Outcome, still_fails):
    """Each size but the failing one dropped in turn, kept dropped while the case still
    fails; the walk ends at the failure."""
    i = 0
    while len(sizes) > 2 and i < len(sizes) - 1:
        fewer = sizes[:i] + sizes[i + 1:]
        result = still_fails(program, fewer)
        if result:
            sizes, outcome = fewer[: _failing_position(fewer, result) + 1], result
        else:
            i += 1
    return sizes, outcome


def reproducer(program: Program, sizes: Sequence[int], setup: Setup, outcome: Outcome | None = None) -> str:
    """A standalone script: the program's source, the compile call and the sizes."""
    padding = {True: "true", None: "none", False: "false"}[setup.padding]
    lines = [
        f"# cgcompile fuzz case, seed {program.seed}: python -m cgcompile.fuzz --seed {program.seed} --cases 1 "
        f"--compiler {setup.compiler} --device {setup.device} --padding {padding} --full-graph {setup.full_graph}"
        + (" --fuse-sibling-linears" if setup.fuse_sibling_linears else "")
        + (f" --path {setup.path}" if setup.path != "compiled" else "")
        + (f" --sequence {setup.sequence}" if setup.sequence else ""),
        f"# productions ({program.mode}): {', '.join(program.productions)}",
        f"# sizes, in order: {tuple(sizes)}",
    ]
    if outcome is not None and outcome.status != "ok":
        lines.append(f"# {outcome.status} at n={outcome.size}: {outcome.detail}")
    harness = [
        "",
        "",
        f"model, reference = Model().to({setup.device!r}), Model().to({setup.device!r})  # equal: seeded",
        f"config = {setup.config_source()}",
        *_compiled_source(setup),
        f"with torch.{'inference_mode' if program.inference_mode else 'no_grad'}():",
        f"    for n, call in {tuple((n, call) for n in sizes for call in range(setup.calls))}:",
        f"        inputs, expected = make_inputs(n, {setup.device!r}), make_inputs(n, {setup.device!r})  # alike",
        "        for t in inputs + expected:  # each call of a size its own data, as the fuzzer runs it",
        "            if t.is_floating_point():",
        "                t.mul_(1.0 + 0.5 * call)",
        *(["        mark_state(model)"] if program.row_states else []),
        "        # the outputs, and the inputs as the call left them (a program may write into one)",
        "        torch.testing.assert_close((compiled(*inputs), inputs), (reference(*expected), expected), rtol=1e-4,",
        "                                   atol=1e-4, equal_nan=True, msg=lambda m: f'n={n}: {m}')",
        "print('ok')",
    ]
    return "\n".join(lines) + "\n" + HEADER + source(program) + "\n".join(harness) + "\n"


def _compiled_source(setup: Setup) -> list[str]:
    if setup.path == "breakable":
        return [f"manager = cgcompile.GraphManager(model, config, boundary=None, segments={setup.segments!r})",
                "compiled = lambda *inputs: manager.run_pw_graph(model, inputs)"]
    return ["compiled = torch.compile(model, backend=cgcompile.Backend(config), fullgraph=True)"]


# -- many cases: classes of failures ---------------------------------------------------------


@dataclasses.dataclass
class FailureClass:
    """Failures whose shrunk programs keep the same productions, failing the same way.

    A later failure joins a class without being shrunk when its program contains all of
    the class's productions and fails with the same kind: cheap, and rarely wrong."""

    kind: str
    productions: frozenset[str]
    reproducer: str
    detail: str
    seeds: list[int] = dataclasses.field(default_factory=list)
    compilers: set[str] = dataclasses.field(default_factory=set)

    @property
    def name(self) -> str:
        return f"{self.kind} [{', '.join(sorted(self.productions))}]"


@dataclasses.dataclass
class Report:
    counts: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # (compiler, status) -> cases
    padded: int = 0  # cases in which some graph ran padded
    full_calls: int = 0  # calls that took the full path, over all cases
    fused_linears: int = 0  # linears fused away, over all cases
    breakable_graphs: int = 0  # breakable graphs captured, over all cases
    recompiled: list[int] = dataclasses.field(default_factory=list)  # seeds Dynamo compiled more than expected
    classes: list[FailureClass] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> int:
        return sum(c for (_, status), c in self.counts.items() if status in FAILURES)

    def summary(self) -> str:
        lines = []
        for compiler in sorted({c for c, _ in self.counts}):
            by_status = {s: c for (cc, s), c in self.counts.items() if cc == compiler}
            total = sum(by_status.values())
            detail = ", ".join(f"{s} {c}" for s, c in sorted(by_status.items()))
            lines.append(f"compiler={compiler}: {total} cases: {detail}")
        fused = f"{self.fused_linears} linears fused; " if self.fused_linears else ""
        fused += f"{self.breakable_graphs} breakable graphs captured; " if self.breakable_graphs else ""
        lines.append(f"padded in {self.padded} cases; {self.full_calls} calls took the full path; {fused}"
                     f"{self.failures} failures in {len(self.classes)} classes, {self.seconds:.0f} s")
        if self.recompiled:
            lines.append(f"more Dynamo graphs than sizes need (specialized, fewer sizes share a graph): "
                         f"seeds {self.recompiled[:20]}")
        for cls in self.classes:
            seeds = ", ".join(map(str, cls.seeds[:10])) + (" ..." if len(cls.seeds) > 10 else "")
            lines.append(f"  {cls.name}: {len(cls.seeds)} cases ({'/'.join(sorted(cls.compilers))}), seeds {seeds}")
            lines.append(f"      {cls.detail}")
        return "\n".join(lines)


def run_campaign(
    seeds: Sequence[int], setups: Sequence[Setup], *, shrink_budget_s: float = 60.0,
    on_new_class: Callable[[FailureClass], None] = lambda cls: None,
    on_case: Callable[[int, Setup, Outcome], None] = lambda seed, setup, outcome: None,
) -> Report:
    """Run every seed under every setup; shrink each failure unless a class claims it."""
    report, start = Report(), time.monotonic()
    for seed in seeds:
        for setup in setups:
            program, sizes = setup.case(seed)
            outcome = run_case(program, sizes, setup)
            key = (setup.compiler, outcome.status)
            report.counts[key] = report.counts.get(key, 0) + 1
            report.padded += outcome.padded
            report.full_calls += outcome.full_calls
            report.fused_linears += outcome.fused_linears
            report.breakable_graphs += outcome.breakable_graphs
            if outcome.status == "ok" and not program.stateful and outcome.graphs > 1 + (1 in sizes):
                report.recompiled.append(seed)
            on_case(seed, setup, outcome)
            if outcome.status in FAILURES:
                _classify(report, program, sizes, setup, outcome, shrink_budget_s, on_new_class)
    report.seconds = time.monotonic() - start
    return report


def _classify(report, program, sizes, setup, outcome, budget_s, on_new_class) -> None:
    present = set(program.productions)
    cls = next((c for c in report.classes if c.kind == outcome.kind and c.productions <= present), None)
    if cls is None:
        check = functools.partial(run_case, setup=setup)
        small, small_sizes, small_outcome = shrink(program, sizes, outcome, check, budget_s)
        cls = FailureClass(
            outcome.kind, frozenset(small.productions), reproducer(small, small_sizes, setup, small_outcome),
            f"n={small_outcome.size}: {small_outcome.detail}",
        )
        report.classes.append(cls)
        on_new_class(cls)
    cls.seeds.append(program.seed)
    cls.compilers.add(setup.compiler)


# -- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgcompile.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="first seed; case i runs seed + i")
    parser.add_argument("--compiler", choices=("eager", "inductor", "both"), default="eager")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--padding", choices=("true", "none", "false"), default="true")
    parser.add_argument("--full-graph", choices=FULL_GRAPH_MODES, default="off",
                        help="declare every split op capturable (pieces), and compile full graphs whole (whole)")
    parser.add_argument("--fuse-sibling-linears", action="store_true",
                        help="compile with Config(fuse_sibling_linears=True)")
    parser.add_argument("--path", choices=PATHS, default="compiled",
                        help="compiled: cgcompile's backend; breakable: GraphManager's breakable graphs, no compile")
    parser.add_argument("--sequence", type=int, nargs="?", const=SEQUENCE_LENGTH, default=0, metavar="LENGTH",
                        help=f"each case a walk of LENGTH sizes (default {SEQUENCE_LENGTH}) that returns to earlier "
                             "ones, and programs that keep state across calls")
    parser.add_argument("--shrink-budget", type=float, default=60.0, help="seconds to shrink each new class")
    parser.add_argument("--show", action="store_true", help="print the program of each seed and exit")
    args = parser.parse_args(argv)
    seeds = range(args.seed, args.seed + args.cases)
    if args.sequence and args.sequence < 2:
        parser.error(f"expected --sequence of 2 sizes or more, got {args.sequence}; a walk needs a size to return to")
    if args.show:
        setup = _setups(args)[0]
        for seed in seeds:
            print(reproducer(*setup.case(seed), setup))
        return 0
    logging.getLogger("cgcompile").setLevel(logging.ERROR)  # "no capturable piece" etc.
    report = run_campaign(seeds, _setups(args), shrink_budget_s=args.shrink_budget,
                          on_new_class=_print_class, on_case=_progress_printer())
    print(report.summary())
    return 1 if report.failures else 0


def _setups(args) -> list[Setup]:
    padding = {"true": True, "none": None, "false": False}[args.padding]
    compilers = ("eager", "inductor") if args.compiler == "both" else (args.compiler,)
    if args.path == "breakable":
        compilers = ("eager",)  # nothing is compiled: one run per case
    return [Setup(c, args.device, padding, args.full_graph, args.fuse_sibling_linears or None, args.path,
                  args.sequence)
            for c in compilers]


def _print_class(cls: FailureClass) -> None:
    print(f"\n=== new failure class: {cls.name}\n{cls.reproducer}", flush=True)


def _progress_printer() -> Callable[[int, Setup, Outcome], None]:
    """Prints each case that is not ok, and a count every 100 cases (to stderr)."""
    done = itertools.count(1)

    def on_case(seed: int, setup: Setup, outcome: Outcome) -> None:
        if outcome.status != "ok":
            print(f"seed {seed} ({setup.compiler}): {outcome.status} at n={outcome.size}: {outcome.detail}", flush=True)
        count = next(done)
        if count % 100 == 0:
            print(f"... {count} cases run", file=sys.stderr, flush=True)

    return on_case


if __name__ == "__main__":
    sys.exit(main())
