"""Which split ops may be captured inside a full graph: `Config.capturable_split_ops`.

A split op runs eagerly between piecewise graphs because it may depend on host-side
state that changes every call. Declaring it capturable is the promise that it reads
nothing but its arguments: no host state, no plan built outside the graph. Then a full
graph of the whole Dynamo graph replays it correctly whenever its arguments are the
graph's own: every tensor it reads is either made inside the graph or lies at the
address it was captured with, and every host value (a SymInt argument, a size) equals
the captured one. `passes.full_graph_plan` finds those arguments among the graph's
inputs and `cgcompile.full_graph` checks them per call; the declaration alone never
replays a stale value.

Entries: an op object (`torch.ops.mylib.attention`), a qualified name "ns::op" or
"ns::op.overload", or "attention" for every form of scaled-dot-product attention
(the functions Dynamo records, their aten ops and cgcompile's grouped-query rewrite).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn.functional as F

from .passes.sdpa import ATTENTION_FUNCTIONS
from .split_ops import _SDPA_ATEN_OPS, normalize_op, op_names

ATTENTION = "attention"


def normalize_capturable(entry: Any) -> str:
    """"attention" for any spelling of SDPA, else the checked qualified op name."""
    if entry == ATTENTION or entry is F.scaled_dot_product_attention:
        return ATTENTION
    return normalize_op(entry, "capturable_split_ops")


@dataclasses.dataclass(frozen=True)
class CapturableOps:
    """The split ops a full graph may hold. Empty (the default): no full graphs."""

    names: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.names)

    def covers(self, target: Any) -> bool:
        """Whether a split node calling `target` may be captured into a full graph."""
        if ATTENTION in self.names and target in ATTENTION_FUNCTIONS:
            return True
        names = op_names(target)
        if names is None:
            return False
        packet, overload = names
        if ATTENTION in self.names and packet in _SDPA_ATEN_OPS:
            return True
        return packet in self.names or overload in self.names
