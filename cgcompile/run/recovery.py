"""Recovery from a piece whose CUDA graph capture failed: find the node, split there.

A capture fails when something in the piece cannot be recorded in a graph: a copy
between host and device, a synchronisation, an op that torch refuses during capture,
often hidden inside an opaque custom op that the split rule cannot look into. The
search runs the piece node by node on the inputs the capture was given (each node first
eagerly, so lazy initialisation is done, then alone under a throwaway capture) and
returns the first node whose capture fails. `PieceRecovery` then splits the piece at that
node (`split_at_node`): the node runs eagerly, the rest is captured as before.

The flow: a graph piece whose capture fails raises `runtime.PieceCaptureFailed`; the
runtime that ran it catches it and asks the `PieceRecovery` it was built with for a
`Resplit` (`PieceRecovery.resplit`), then swaps its own runner for it. The recovery
builds the re-split's runners with the same phase that built the first ones
(`phases.build_runners`) and updates the Backend's records that it was handed
(`stats.PieceRecords`, `UncapturableOps`). It holds no runtime and writes into none;
nothing here calls the Backend.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Interpreter, Node

from .capture import CaptureSession, end_capture, gc_paused
from ..compat import end_pool_allocation, release_cublas_workspaces, reset_generators_after_failed_capture
from ..errors import CaptureError
from ..passes import SplitGraph, SplitReason, is_floating, split_graph
from .runtime import PieceCaptureFailed, PieceRunner, Resplit
from ..stats import PieceRecords

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
    """Splits a graph piece whose capture failed at the node to blame.

    split: the split the graph's runtime runs; rebuild(split, session): the runners of a
    re-split (`phases.build_runners`, bound to this graph); records, uncapturable: the
    Backend's records, updated here.
    """

    def __init__(self, split: SplitGraph, rebuild: Callable, records: PieceRecords,
                 uncapturable: UncapturableOps):
        self.rebuild = rebuild
        self.records = records
        self.uncapturable = uncapturable
        # Piece graphs by spec name ("piece_0", and "piece_0.piece_2" after a re-split).
        self._graphs: dict[str, GraphModule] = {spec.name: spec.graph for spec in split.pieces}

    def resplit(self, failed: PieceCaptureFailed) -> Resplit:
        """The failed piece split at the node that cannot be captured (or, where no single
        node is to blame, its code run eagerly); the Backend's records say so."""
        piece = failed.piece
        spec_name = piece.piece_name.split(".", 1)[1]  # "graph0.piece_0" -> "piece_0"
        graph = self._graphs[spec_name]
        found = find_uncapturable_node(graph, failed.padded, piece.session)
        if found is None:
            result = Resplit(None, (PieceRunner(piece.piece_name, graph),))
            reason = f"capture_failed: no single node could be blamed ({failed.cause}); the piece runs eagerly"
        else:
            result = self._split(spec_name, graph, found, piece.session)
            reason = f"capture_failed: split at {found.node.name} ({found.op}), see {piece.piece_name}.*"
        self.uncapturable.remember(piece.piece_name, found, failed.cause)
        self.records.replace(piece.piece_name, reason)
        return result

    def _split(self, spec_name: str, graph: GraphModule, found: Uncapturable, session: CaptureSession) -> Resplit:
        sub = split_at_node(graph, found)
        sub = dataclasses.replace(sub, pieces=tuple(
            dataclasses.replace(p, name=f"{spec_name}.{p.name}") for p in sub.pieces
        ))
        self._graphs.update((p.name, p.graph) for p in sub.pieces)
        built = self.rebuild(sub, session)
        self.records.add(built.graph_index, built.pieces)
        return Resplit(sub.stitch, tuple(built.runners))
