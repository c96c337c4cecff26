"""Recovery from a piece whose CUDA graph capture failed: find the node, split there.

A capture fails when something in the piece cannot be recorded in a graph: a copy
between host and device, a synchronisation, an op that torch refuses during capture,
often hidden inside an opaque custom op that the split rule cannot look into. The
search runs the piece node by node on the inputs the capture was given (each node first
eagerly, so lazy initialisation is done, then alone under a throwaway capture) and
returns the first node whose capture fails. The backend then splits the piece at that
node (`split_at_node`): the node runs eagerly, the rest is captured as before.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Interpreter, Node

from .capture import CaptureSession, end_capture, gc_paused
from .compat import end_pool_allocation, release_cublas_workspaces, reset_generators_after_failed_capture
from .passes import SplitGraph, SplitReason, is_floating, split_graph

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
        f"{found.op} failed under CUDA graph capture ({_first_line(found.error)}); {found.advice}",
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


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= 200 else line[:197] + "..."
