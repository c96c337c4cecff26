"""Recovery from a piece whose CUDA graph capture failed: find the node, split there.

A capture fails when something in the piece cannot be recorded in a graph: a copy
between host and device, a synchronisation, an op that torch refuses during capture,
often hidden inside an opaque custom op that the split rule cannot look into. The
search runs the piece node by node on the inputs the capture was given (each node first
eagerly, so lazy initialisation is done, then alone under a throwaway capture) and
returns the first node whose capture fails. `PieceRecovery` then splits the piece at that
node (`split_at_node`): the node runs eagerly, the rest is captured as before.

`PieceRecovery` is given to a graph's runtime when it is built and arms the runtime's
graph pieces with it; it builds the re-split's runners with the same phase that built
the first ones (`phases.build_runners`), and updates the Backend's records that it was
handed (`stats.PieceRecords`, `UncapturableOps`): nothing here calls the Backend.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Interpreter, Node

from .capture import CaptureSession, end_capture, gc_paused
from .compat import end_pool_allocation, release_cublas_workspaces, reset_generators_after_failed_capture
from .errors import CaptureError
from .graph_piece import CudaGraphPiece
from .passes import SplitGraph, SplitReason, is_floating, split_graph
from .runtime import GraphRuntime, PieceRunner
from .stats import PieceRecords

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Uncapturable:
    """The node that a CUDA graph cannot hold, and what torch said when capturing it."""

    node: Node
    error: str

    @property
    def op(self) -> str:
        """The op as `Config.splitting_ops` accepts it ("ns::op"), or a readable name."""
        target = self.node.target
        schema = getattr(target, "_schema", None)
        if schema is not None:
            return schema.name
        qualified = getattr(target, "_qualified_op_name", None)
        return qualified or getattr(target, "__name__", str(target))

    @property
    def advice(self) -> str:
        if "::" in self.op:
            return f"add Config(splitting_ops=[{self.op!r}]) to split there without this search"
        return f"{self.op} is not an op splitting_ops can name; wrap it in an @cgcompile.eager_break or a custom op"


def find_uncapturable_node(gm: GraphModule, args: Sequence[Any], session: CaptureSession) -> Uncapturable | None:
    """The first node of `gm` whose capture fails when run on `args`, or None."""
    finder = _NodeByNodeCapture(gm, session)
    try:
        finder.run(*args)
    except _Found as found:
        return found.result
    return None


def split_at_node(gm: GraphModule, found: Uncapturable) -> SplitGraph:
    """Split a piece's graph so that the uncapturable node runs eagerly."""
    node = next(n for n in gm.graph.nodes if n.name == found.node.name)
    reason = SplitReason(
        "capture_failed",
        f"{found.op} failed under CUDA graph capture ({_first_line(found.error, limit=200)}); {found.advice}",
        node.name,
    )
    return split_graph(gm, {node: reason})


class _Found(Exception):
    def __init__(self, result: Uncapturable):
        self.result = result


class _NodeByNodeCapture(Interpreter):
    def __init__(self, gm: GraphModule, session: CaptureSession):
        super().__init__(gm)
        self.session = session

    def run_node(self, node: Node) -> Any:
        result = super().run_node(node)  # eagerly: the warm-up, and the value later nodes read
        if node.op in ("call_function", "call_method", "call_module") and not is_floating(node):
            error = self._capture_alone(node)
            if error is not None:
                raise _Found(Uncapturable(node, error))
        return result

    def _capture_alone(self, node: Node) -> str | None:
        # Each try captures into a pool of its own, dropped afterwards: a failed capture
        # leaves its pool unusable (see `CaptureSession.abandon`).
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        with self.session.on_capture_stream(), gc_paused():
            release_cublas_workspaces()
            graph.capture_begin(pool=pool, capture_error_mode=self.session.error_mode)
            try:
                super().run_node(node)
                end_capture(graph)  # a node alone may launch nothing: no warning for that
            except Exception as e:  # noqa: BLE001 - any failure under capture is the answer
                try:
                    end_capture(graph)  # a failure before any launch leaves it empty: no warning
                except RuntimeError:
                    pass
                end_pool_allocation(pool)
                reset_generators_after_failed_capture()
                return f"{type(e).__name__}: {e}"
            finally:
                release_cublas_workspaces()
        del graph
        return None


def _first_line(value: BaseException | str, limit: int | None = None) -> str:
    """The first line of a text or an error's message (an empty message: the error's type),
    cut to `limit` characters."""
    text = str(value).strip()
    line = text.splitlines()[0] if text else type(value).__name__ if isinstance(value, BaseException) else ""
    return line if limit is None or len(line) <= limit else line[:limit - 3] + "..."


# --------------------------------------------------------------------------------------
# Recovery of one Dynamo graph's pieces, and the ops a Backend remembers.


class UncapturableOps:
    """Ops a capture failed on, by target, for one Backend: later graphs split there at
    once instead of failing a capture and searching again; one warning per op."""

    def __init__(self):
        self._ops: dict[Any, str] = {}

    def reason(self, target) -> str | None:
        """Why `target` is split (it failed capture before), or None."""
        if target not in self._ops:
            return None
        return (f"{self._ops[target]} failed CUDA graph capture in an earlier graph of this "
                f"Backend (capture recovery)")

    def remember(self, piece_name: str, found: Uncapturable | None, error: CaptureError) -> None:
        """Remember the op `found` and warn, once per op."""
        cause = _first_line(error.__cause__ or error)
        if found is None:
            log.warning("cgcompile: capturing %s failed (%s) and no single node could be blamed; "
                        "that piece runs eagerly from now on", piece_name, cause)
            return
        if found.node.op == "call_function":
            if found.node.target in self._ops:
                return
            self._ops[found.node.target] = found.op
        log.warning("cgcompile: %s cannot be captured in a CUDA graph (%s); %s splits there, and so do "
                    "later graphs of this Backend. To skip the search: %s",
                    found.op, cause, piece_name, found.advice)


class PieceRecovery:
    """Splits a graph piece whose capture failed at the node to blame, then finishes the call.

    split: the split the graph's runtime runs; rebuild(split, session): the runners of a
    re-split (`phases.build_runners`, bound to this graph); records, uncapturable: the
    Backend's records, updated here; cudnn_attention: as the graph's runtime runs.
    """

    def __init__(self, split: SplitGraph, rebuild: Callable, records: PieceRecords,
                 uncapturable: UncapturableOps, cudnn_attention: bool):
        self.split = split
        self.rebuild = rebuild
        self.records = records
        self.uncapturable = uncapturable
        self.cudnn_attention = cudnn_attention

    def arm(self, runtime: GraphRuntime) -> None:
        """Called by the runtime's constructor: its graph pieces recover here."""
        self._arm(runtime, runtime, self.split)

    def _arm(self, top: GraphRuntime, owner: GraphRuntime, split: SplitGraph) -> None:
        """Each graph piece of `owner` (`top` itself, or a piece's split inside it) recovers
        through `top`, the runtime Dynamo calls."""
        for spec, runner in zip(split.pieces, owner.runners):
            if isinstance(runner, CudaGraphPiece):
                runner.recover = functools.partial(self._recover, top, owner, spec)

    def _recover(self, top: GraphRuntime, owner: GraphRuntime, spec, runner: CudaGraphPiece, args, padded,
                 error: CaptureError):
        """Split the piece at the node that cannot be captured, then finish this call.

        Graphs of `top` captured in earlier calls or earlier in this one are dropped, and
        the rest of this call runs without graphs: all graphs of one size must be captured
        in one call for the pool's memory sharing to hold (see `capture.CaptureSession`).
        """
        found = find_uncapturable_node(spec.graph, padded, runner.session)
        top.drop_graphs()
        top.step.size = None
        if found is None:
            replacement = PieceRunner(runner.piece_name, spec.graph)
            new_runners = [replacement]
            reason = f"capture_failed: no single node could be blamed ({error}); the piece runs eagerly"
        else:
            replacement, new_runners = self._resplit(top, spec, found, runner.session)
            reason = f"capture_failed: split at {found.node.name} ({found.op}), see {runner.piece_name}.*"
        self.uncapturable.remember(runner.piece_name, found, error)
        self.records.replace(runner.piece_name, reason)
        owner.replace_runner(runner, replacement, new_runners)
        top.runners.extend(r for r in new_runners if r not in top.runners)
        return replacement(*args)

    def _resplit(self, top: GraphRuntime, spec, found: Uncapturable,
                 session: CaptureSession) -> tuple[GraphRuntime, list[PieceRunner]]:
        """The piece cut at `found`, run by a runtime of its own inside `top`'s."""
        sub = split_at_node(spec.graph, found)
        sub = dataclasses.replace(sub, pieces=tuple(
            dataclasses.replace(p, name=f"{spec.name}.{p.name}") for p in sub.pieces
        ))
        built = self.rebuild(sub, session)
        self.records.add(built.graph_index, built.pieces)
        runners = list(built.runners)
        replacement = GraphRuntime(sub.stitch, runners, (), self.cudnn_attention, None, top.step)
        self._arm(top, replacement, sub)
        return replacement, runners
