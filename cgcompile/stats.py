"""What the backend records: one `Piece` per piece of every Dynamo graph, and counters."""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Mapping, Sequence

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of a split graph, as users and tests inspect it.

    capturable: replayed from CUDA graphs (on CUDA) or run compiled; else run eagerly.
    reason: why the piece runs eagerly, in words (None for capturable pieces).
    input_shapes: each input's shape with its symbols, e.g. "f32[s0, 64]".
    padding_unsafe: why padding could change this capturable piece's results, node by
        node (None when it keeps rows apart); see `cgcompile.passes.padding_safety`.
    sizes: how its graph's pieces are sized, and why ("padded to the capture sizes",
        "exact sizes: piece_2 is unsafe to pad (...)", "static: ...").
    uncaptured: why this capturable piece runs compiled but never from a CUDA graph on a
        device that has them (its graph needs gradients: `phases.without_graphs_for_autograd`).
    """

    name: str
    graph_index: int
    capturable: bool
    reason: str | None
    graph: torch.fx.GraphModule
    input_shapes: tuple[str, ...]
    padding_unsafe: str | None = None
    sizes: str = ""
    uncaptured: str | None = None

    @property
    def node_count(self) -> int:
        return sum(1 for n in self.graph.graph.nodes if n.op not in ("placeholder", "output"))


@dataclasses.dataclass
class BackendStats:
    """Counters a `Backend` keeps; tests and users assert on these."""

    graphs_seen: int = 0
    pieces: int = 0
    capturable_pieces: int = 0
    compilations: int = 0
    compile_s: float = 0.0  # wall seconds those compiles took (Inductor's, at the pieces' general sizes)
    graphs_captured: int = 0
    specialised_compilations: int = 0  # compiles at one of Config.compile_sizes (one per distinct piece and size)
    specialise_s: float = 0.0  # wall seconds those compiles took: the warm-up compile_sizes adds
    matvec_reductions: int = 0  # one-row linears compiled as reductions, per distinct compile (Config.matvec_as_reduction)
    # One-row products handed to cgcompile::skinny_linear or cgcompile::grouped_skinny_linear by the
    # compiles Inductor ran, of those the ones run in groups (q/k/v, gate/up: one launch a group), and
    # the ones that make a gated MLP's silu(gate) * up as they read it (cgcompile::silu_mul_linear).
    skinny_linears: int = 0
    grouped_skinny_linears: int = 0
    gated_skinny_linears: int = 0
    layout_copies: int = 0  # inputs copied into a compiled piece's traced layout (calls without graphs)
    # Calls of graphs that have a full-graph plan (Config.full_graph), by path;
    # why the piecewise ones were, per case (see `cgcompile.run.full_graph`).
    full_graph_calls: int = 0
    piecewise_calls: int = 0
    piecewise_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    # Graphs by how their full path was chosen (`phases.full_graph`): "automatic: ..." where
    # Config.full_graph is "auto" (the default) and CUDA graphs are on, "configured: ..."
    # where written out, "off: ..." or "none: ..." (no full graph, and why).
    full_graph_choices: dict[str, int] = dataclasses.field(default_factory=dict)
    # Graphs that could have had CUDA graphs but run without, by why (their calls need
    # gradients: see `phases.without_graphs_for_autograd`).
    uncaptured_graphs: dict[str, int] = dataclasses.field(default_factory=dict)
    # Compiles made for full graphs: whole graphs (Config.full_graph_compile), eager pieces
    # holding attention (Config.small_query_attention).
    full_graph_compilations: int = 0
    full_graph_compile_s: float = 0.0  # wall seconds they took
    # Config.fuse_sibling_linears: linears fused away, the fused weights that share the
    # parameters' memory, the bytes of those that are copies (where sharing was not safe;
    # the log says why), and how often a changed parameter made them be copied again.
    fused_linears: int = 0
    shared_fused_weights: int = 0
    fused_weight_bytes: int = 0
    fused_weight_refreshes: int = 0
    # Calls whose parameters or buffers were not where the captured pieces read them (a
    # second instance of the model's class, replaced weights): run without graphs; and
    # recaptures once new addresses settled (see `cgcompile.run.weights`).
    calls_with_moved_parameters: int = 0
    parameter_recaptures: int = 0


@dataclasses.dataclass(frozen=True)
class RunCounts:
    """What one part of the run half counted, as the part reports it (`counts()` on a
    runner, a full graph, a graph's runtime); the Backend adds the parts' up into its
    `BackendStats`. Fields as there."""

    layout_copies: int = 0
    full_graph_calls: int = 0
    piecewise_calls: int = 0
    piecewise_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    full_graph_compilations: int = 0
    full_graph_compile_s: float = 0.0
    fused_weight_refreshes: int = 0
    calls_with_moved_parameters: int = 0
    parameter_recaptures: int = 0

    def __add__(self, other: "RunCounts") -> "RunCounts":
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self) if f.name != "piecewise_reasons"}
        reasons = dict(self.piecewise_reasons)
        for case, count in other.piecewise_reasons.items():
            reasons[case] = reasons.get(case, 0) + count
        return RunCounts(piecewise_reasons=reasons, **summed)


def total(counts: Iterable[RunCounts]) -> RunCounts:
    """The sum of what several parts counted."""
    return sum(counts, RunCounts())


class PieceRecords:
    """A Backend's `Piece` records and their counters, as one object that its compile
    adds to and capture recovery updates (`recovery.PieceRecovery`)."""

    def __init__(self, pieces: list[Piece], stats: BackendStats):
        self.pieces = pieces
        self.stats = stats

    def add(self, graph_index: int, pieces: Sequence[Piece]) -> None:
        """Record the pieces of a graph's split (or of a piece's re-split)."""
        self.pieces.extend(pieces)
        self.stats.pieces += len(pieces)
        self.stats.capturable_pieces += sum(p.capturable for p in pieces)
        if not any(p.capturable for p in pieces):
            log.warning("cgcompile: graph %d has no capturable piece; it runs eagerly. Reasons: %s", graph_index,
                        "; ".join(p.reason or "" for p in self.pieces if p.graph_index == graph_index))

    def replace(self, name: str, reason: str) -> None:
        """The piece `name` runs eagerly from now on, for `reason` (capture recovery)."""
        for i, piece in enumerate(self.pieces):
            if piece.name == name:
                self.pieces[i] = dataclasses.replace(piece, capturable=False, reason=reason)
                self.stats.capturable_pieces -= 1
