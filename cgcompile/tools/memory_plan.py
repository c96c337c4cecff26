"""Graph memory you can plan: how many CUDA graphs and bytes each capture size costs,
and capture under a memory budget.

The plan, before any capture:
  - without CUDA (`count_graphs`): the sizes and how many graphs each would make, from the
    Dynamo graphs traced so far; bytes unknown.
  - on CUDA (`profile_plan`): every size captured into a temporary pool, largest first,
    one size at a time as the real capture does it, and the pool measured after each;
    then everything is released. `SizePlan.pool_bytes` is cumulative: the pool that
    holds this size and every larger one of the plan.

Capture under a budget (`capture_within_budget`, `Backend.capture(memory_budget=...)`):
largest sizes first, while the measured pool stays within the budget. When even the
largest size alone does not fit, it is dropped and the rest measured again. Then:
  - a call of size n runs padded to the smallest captured size >= n;
  - a call above the largest captured size runs without graphs;
  - no graph is added lazily afterwards (`CaptureSession.lazy_capture` is off): a size or
    a Dynamo graph that has no graph runs its compiled pieces without one.
The pool after the real capture is measured too; should it exceed the budget (a profile
that did not repeat), the smallest captured size is dropped and the rest captured again,
so the budget holds when `capture` returns. `Backend.clear()` lifts all of this.

Why the estimate holds: graphs of different sizes share one pool (see `capture`), and
the profile captures the same sizes, in the same order, with the same calls as the real
capture, so the caching allocator makes the same requests and the pool ends the same.

What this module reads of the graphs' owner (a Backend) it is handed: the Dynamo graphs'
runtimes and piece records for a count, a `GraphOwner` (the session, the runners holding
graphs, a probe factory, the settings it needs) for a profile or a budgeted capture. It
changes the session only through the session's own methods (`CaptureSession.probe`,
`keep_only`, `clear`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from typing import Any, Callable, Sequence

from . import aot_capture
from .aot_capture import MakeInputs, capture_all, check_capture_call, require_cuda_graphs, requested_sizes
from ..run.capture import CaptureSession
from .dump import read_json
from ..stats import Piece
from ..errors import CaptureError, expect, expected

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class GraphOwner:
    """What a profile and a budgeted capture read of the owner of the graphs (a Backend).

    session: the owner's capture session, which every runner captures with.
    runners: the runners that hold CUDA graphs (graph pieces, full graphs): a plan is
        made, and a budgeted capture starts, with none held.
    probe: `with probe() as session:` captures into a temporary pool and releases it on
        leaving (`CaptureSession.probe`).
    capture_sizes: Config.capture_sizes. cudagraphs: False where Config.cudagraphs=False.
    dump_dir: where plans are written (None: nowhere).
    """

    session: CaptureSession
    runners: Sequence[Any]
    probe: Callable[[], contextlib.AbstractContextManager[CaptureSession]]
    capture_sizes: tuple[int, ...]
    cudagraphs: bool
    dump_dir: str | None

    def graphs_held(self) -> int:
        return sum(len(r.graphs) for r in self.runners)


@dataclasses.dataclass(frozen=True)
class SizePlan:
    """One capture size: the graphs its capture makes and the pool once it is captured."""

    size: int
    graphs: int | None  # CUDA graphs a capture of this size makes (measured or counted); None: not profiled
    pool_bytes: int | None  # pool holding this size and every larger one of the plan; None: not measured


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Which sizes get graphs and what they cost, for one model (one Backend).

    sizes: the sizes planned, largest first. captured: those that get graphs (all of them
    without a budget). budget: bytes, or None. actual_bytes: the pool after the capture,
    once it ran. capture_sizes: the Backend's (empty in plans written before it was
    recorded). Calls of a size that was not captured: see `runs_at`.
    """

    name: str
    sizes: tuple[SizePlan, ...]
    captured: tuple[int, ...]
    budget: int | None = None
    actual_bytes: int | None = None
    capture_sizes: tuple[int, ...] = ()  # Config.capture_sizes: a call of another size runs padded to one

    @property
    def graphs(self) -> int:
        return sum(row.graphs or 0 for row in self.sizes if row.size in self.captured)

    @property
    def estimate_bytes(self) -> int | None:
        """The pool the captured sizes need (measured by the profile), 0 when none is captured."""
        rows = [row for row in self.sizes if row.size in self.captured]
        if not rows:
            return 0
        return rows[-1].pool_bytes

    @property
    def skipped(self) -> tuple[int, ...]:
        return tuple(row.size for row in self.sizes if row.size not in self.captured)

    def runs_at(self, n: int) -> int | None:
        """The captured size a call of size n replays at; None: it runs without graphs."""
        fitting = [size for size in self.captured if size >= n]
        return min(fitting) if fitting and n > 0 else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        return format_plan(self.to_dict())


def format_plan(plan: dict) -> str:
    """The plan as a table: one row per size, then what calls of other sizes do.

    Worded by what happened: "captured" once a capture ran under the plan (`actual_bytes`
    is set), "would capture" for a plan made before any capture (counted without CUDA, or
    profiled in a temporary pool that is released again). A planned size that is not a
    capture size gets no graphs of its own: its calls, the capture's too, run padded up.
    """
    ran = plan.get("actual_bytes") is not None
    own = _own_sizes(plan)
    rows = [(r["size"], r["graphs"], r["pool_bytes"]) for r in plan["sizes"]]
    graphs = sum(g or 0 for s, g, _ in rows if s in own)
    estimate = next((b for s, _, b in reversed(rows) if s in own), 0) if own else 0
    head = [f"model {plan['name']}: {len(own)} of {len(rows)} sizes {'captured' if ran else 'planned'}, "
            f"{graphs} graphs{'' if ran else ' (none captured yet)'}, estimate {_mib(estimate)}"]
    if ran:
        head.append(f"actual {_mib(plan['actual_bytes'])}")
    if plan.get("budget") is not None:
        head.append(f"budget {_mib(plan['budget'])}")
    verb, answers = plan_answers(plan)
    lines = [", ".join(head), f"  {'size':>6}  {'graphs':>6}  {'pool after':>12}  {verb}"]
    for (size, count, pool), answer in zip(rows, answers):
        count = "?" if count is None else count
        lines.append(f"  {size:>6}  {count:>6}  {_mib(pool):>12}  {answer}")
    lines.append(_calls_line(own, ran))
    return "\n".join(lines)


def plan_answers(plan: dict) -> tuple[str, tuple[str, ...]]:
    """The heading of a plan's last column ("captured" once a capture ran under it, "would
    capture" before) and its answer per row of plan["sizes"]; the text table and
    `inspect --html` both print these, so the two never disagree."""
    verb = "captured" if plan.get("actual_bytes") is not None else "would capture"
    configured = tuple(plan.get("capture_sizes") or ())
    own = _own_sizes(plan)
    return verb, tuple(_row_answer(r["size"], own, configured) for r in plan["sizes"])


def _own_sizes(plan: dict) -> list[int]:
    """The planned sizes that get graphs of their own (a capture size, where those are known)."""
    configured = tuple(plan.get("capture_sizes") or ())
    return [s for s in plan["captured"] if not configured or s in configured]


def _row_answer(size: int, own: list[int], configured: tuple[int, ...]) -> str:
    if size in own:
        return "yes"
    if configured and size not in configured:
        above = [c for c in configured if c >= size]
        return f"no: not a capture size (runs at {min(above)})" if above else "no: not a capture size"
    return "no"


def _calls_line(captured: list[int], ran: bool) -> str:
    if not captured:
        return "  nothing captured: every call runs without graphs"
    if ran:
        return (f"  a call of size n runs padded to the smallest captured size >= n; "
                f"above {max(captured)} it runs without graphs")
    return (f"  once captured (Backend.capture, CUDA only), a call of size n runs padded to the smallest "
            f"captured size >= n; above {max(captured)} it runs without graphs")


def _mib(value) -> str:
    return "unknown" if value is None else f"{value / _MIB:.1f} MiB"


# -- checks -------------------------------------------------------------------------------


def check_budget(culprit: str, budget: Any) -> int:
    ok = isinstance(budget, int) and not isinstance(budget, bool) and budget > 0
    expect(ok, f"{culprit}: memory_budget", "a positive int of bytes", budget,
           "e.g. memory_budget=2 * 1024**3 for 2 GiB (write int(...) for a computed float)")
    return budget


def _check_name(culprit: str, name: Any) -> str:
    ok = isinstance(name, str) and name != "" and os.sep not in name
    expect(ok, f"{culprit}: name", "a non-empty name without a path separator", name, "e.g. name='vision'")
    return name


# -- the plan without CUDA ------------------------------------------------------------------


def count_graphs(runtimes: Sequence[Any], pieces: Sequence[Piece], capture_sizes: tuple[int, ...], sizes=None,
                 name: str = "model") -> MemoryPlan:
    """How many CUDA graphs a capture of each size makes, from the Dynamo graphs traced so
    far (call the model once per kind of call first: prefill and decode are two graphs).

    runtimes: the Dynamo graphs' runtimes, graph k at position k; pieces: their pieces'
    records. Needs no CUDA. An upper bound: it assumes every Dynamo graph is called at
    every size; a graph without a capture dimension is captured once, with the largest
    size. Bytes are unknown until `profile_plan` measures them.
    """
    _check_name("count_graphs", name)
    expect(bool(runtimes), "count_graphs", "a model compiled with this backend and called once",
           "no Dynamo graph yet", "call the compiled model once per kind of call (e.g. prefill and decode) first",
           raw=True)
    sizes = sorted(requested_sizes("count_graphs", sizes, capture_sizes, bounded=True), reverse=True)
    per_size, once = _graphs_per_call(runtimes, pieces)
    rows = tuple(SizePlan(s, per_size + (once if i == 0 else 0), None) for i, s in enumerate(sizes))
    return MemoryPlan(name, rows, tuple(sizes), capture_sizes=tuple(capture_sizes))


def _graphs_per_call(runtimes: Sequence[Any], pieces: Sequence[Piece]) -> tuple[int, int]:
    """(graphs every size adds, graphs captured once) over the Dynamo graphs seen."""
    per_size = once = 0
    for index, runtime in enumerate(runtimes):
        capturable = sum(p.capturable for p in pieces if p.graph_index == index)
        if runtime.sizing is None:
            once += capturable
        else:
            per_size += capturable
    return per_size, once


# -- the plan on CUDA -------------------------------------------------------------------------


def require_profiling_device(culprit: str) -> None:
    """Raise CaptureError without CUDA, naming what works there: profiling captures real
    graphs, while `plan_memory()` with no arguments counts them on any device."""
    if not aot_capture.cuda_present():
        raise CaptureError(expected(
            culprit, "a CUDA device for profiling the graphs' memory", "none: torch.cuda.is_available() is False",
            "on CPU call plan_memory() with no arguments for the plan without profiling (graphs counted, "
            "bytes unknown)", raw=True))


def profile_plan(owner: GraphOwner, model, make_inputs: MakeInputs, sizes=None, memory_budget: int | None = None,
                 name: str = "model", culprit: str = "plan_memory") -> MemoryPlan:
    """Measure graphs and pool bytes per size in a temporary pool, release it, and choose
    the sizes a capture under `memory_budget` would keep (all of them without one).

    Raises CaptureError before running anything without CUDA, or when graphs are captured.
    """
    check_capture_call(culprit, model, make_inputs, False)
    sizes = requested_sizes(culprit, sizes, owner.capture_sizes, bounded=True)
    if memory_budget is not None:
        check_budget(culprit, memory_budget)
    _check_name(culprit, name)
    require_cuda_graphs(culprit, owner.cudagraphs, "Config.cudagraphs=False")
    _require_no_graphs(culprit, owner)
    remaining = sorted(set(sizes), reverse=True)
    while True:
        rows = _profile(owner, model, make_inputs, remaining, memory_budget)
        kept = fitting_sizes(rows, memory_budget)
        if kept or len(remaining) == 1:
            break
        remaining = remaining[1:]  # the largest alone does not fit: measure the rest without it
    # Sizes never profiled: above the kept ones (they did not fit alone), or below where
    # the profile stopped (the pool had passed the budget already).
    profiled = {row.size for row in rows}
    unmeasured = {s: SizePlan(s, None, None) for s in sizes if s not in profiled}
    ordered = sorted([*rows, *unmeasured.values()], key=lambda row: -row.size)
    return MemoryPlan(name, tuple(ordered), kept, memory_budget, capture_sizes=tuple(owner.capture_sizes))


def fitting_sizes(rows: tuple[SizePlan, ...], budget: int | None) -> tuple[int, ...]:
    """The largest-first run of sizes whose cumulative pool stays within the budget."""
    kept = []
    for row in rows:
        if budget is not None and (row.pool_bytes is None or row.pool_bytes > budget):
            break
        kept.append(row.size)
    return tuple(kept)


def _profile(owner: GraphOwner, model, make_inputs, sizes: list[int], stop_above: int | None) -> tuple[SizePlan, ...]:
    """Capture `sizes` largest first into a temporary pool; stop once it exceeds stop_above
    (smaller sizes could not be kept anyway)."""
    rows = []
    with owner.probe() as probe:
        for size in sizes:
            before = probe.graphs_captured
            capture_all(probe, model, make_inputs, (size,), progress=False)
            rows.append(SizePlan(size, probe.graphs_captured - before, probe.pool.bytes_reserved()))
            if stop_above is not None and rows[-1].pool_bytes > stop_above:
                break
    return tuple(rows)


def _require_no_graphs(culprit: str, owner: GraphOwner) -> None:
    if owner.graphs_held():
        raise CaptureError(expected(culprit, "no captured graphs", "some", "call it before the first "
                                    "capture, or after backend.clear()", raw=True))


# -- capture under a budget -------------------------------------------------------------------


def capture_within_budget(owner: GraphOwner, model, make_inputs: MakeInputs, memory_budget: int, sizes=None,
                          progress: bool = True, name: str = "model") -> MemoryPlan:
    """Plan, then capture the kept sizes into the owner's pool; see the module docstring
    for what calls of the other sizes do. Returns the plan with the measured pool.

    Graphs captured before (lazily, by earlier calls) are dropped first: the budget
    covers every graph in the pool."""
    check_budget("Backend.capture", memory_budget)
    require_cuda_graphs("Backend.capture", owner.cudagraphs, "Config.cudagraphs=False")
    if owner.graphs_held():
        log.info("cgcompile: %s: dropping %d graphs captured before, so the budget covers the whole pool",
                 name, owner.graphs_held())
        owner.session.clear()
    plan = profile_plan(owner, model, make_inputs, sizes, memory_budget, name, "Backend.capture")
    kept = list(plan.captured)
    while True:
        _capture_only(owner.session, model, make_inputs, kept, progress)
        actual = owner.session.graph_memory()
        if actual <= memory_budget or not kept:
            break
        log.warning("cgcompile: %s's pool is %d bytes after capture, over the budget of %d (the profile "
                    "measured %d); dropping size %d and capturing again", name, actual, memory_budget,
                    plan.estimate_bytes, kept[-1])
        owner.session.clear()
        kept.pop()
    if not kept:
        log.warning("cgcompile: %s: no capture size fits the memory budget of %d bytes; every call "
                    "runs without CUDA graphs", name, memory_budget)
    plan = dataclasses.replace(plan, captured=tuple(kept), actual_bytes=actual)
    write_plan(owner.dump_dir, plan)
    return plan


def _capture_only(session: CaptureSession, model, make_inputs, sizes: list[int], progress: bool) -> None:
    """Capture exactly these sizes, one at a time largest first as `_profile` does; calls
    pad to them from now on and add no graph lazily."""
    session.keep_only(sizes)
    for size in sizes:
        capture_all(session, model, make_inputs, (size,), progress=progress)


# -- the plan on disk, for `python -m cgcompile.inspect` -----------------------------------------


def write_plan(dump_dir: str | None, plan: MemoryPlan) -> None:
    """memory_plan.<name>.json in the dump folder, when there is one."""
    if not dump_dir:
        return
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, f"memory_plan.{plan.name}.json"), "w") as f:
        json.dump(plan.to_dict(), f, indent=1)


def read_plans(dump_dir: str) -> list[dict]:
    """Every memory_plan.<name>.json in dump_dir, by name; ArgumentError names a bad one."""
    plans = []
    for entry in sorted(os.listdir(dump_dir)):
        if entry.startswith("memory_plan.") and entry.endswith(".json"):
            plans.append(_read_plan(os.path.join(dump_dir, entry)))
    return plans


def _read_plan(path: str) -> dict:
    return read_json(path, "a memory plan written by cgcompile", ("name", "sizes", "captured"), "write the plan again")
