"""`python -m cgcompile.inspect DUMP_DIR --html OUT.html`: the split as one page.

Each Dynamo graph is a horizontal strip of its pieces in replay order, as wide as their
node counts (with a floor, so a one-node attention piece stays visible), coloured by kind;
hovering a piece shows its full reason and input shapes (the title attribute). Under the
strips: the capture dimension and sizing line of each graph, and the memory plan of each
model where the dump holds one. The page is self-contained (inline CSS, no scripts, no
external URLs), so it can be attached to an issue or opened from a CI artifact.
"""

from __future__ import annotations

import html
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the records only; inspect imports this module, not the other way round
    from .inspect import DumpedGraph, DumpedPiece, DumpedRun

KINDS = {  # kind: (colour, what the legend says)
    "capturable": ("#4c9a5a", "capturable: replayed from a CUDA graph"),
    "eager": ("#c8553d", "eager: runs without a graph (the reason on hover)"),
    "full-graph": ("#d9a03f", "full-graph: eager piecewise, inside the graph's full graph when a call matches"),
}
_MIN_GROW = 4  # nodes a piece's box is at least as wide as (eager boxes also have a minimum width)

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 16px; margin: 20px 0 6px; }
.legend span { display: inline-block; margin-right: 16px; }
.legend i { display: inline-block; width: 12px; min-width: 0; height: 12px; margin-right: 4px; vertical-align: -1px; }
.graph { margin: 14px 0 18px; }
.graph h3 { font-size: 14px; margin: 0 0 4px; }
.strip { display: flex; gap: 2px; min-height: 58px; }
.piece { color: #fff; padding: 3px 5px; overflow: hidden; white-space: nowrap; border-radius: 3px;
         min-width: 42px; font-size: 12px; box-sizing: border-box; }
.piece b { display: block; } .piece small { display: block; opacity: .9; }
.eager, .full-graph { min-width: 118px; white-space: normal; }
.note { color: #555; font-size: 12px; margin: 3px 0 0; }
.static { color: #8a4b00; }
table { border-collapse: collapse; font-size: 12px; margin: 4px 0 8px; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
"""


def write_page(path: str, runs: list[DumpedRun], dump_dir: str) -> None:
    with open(path, "w") as f:
        f.write(render_page(runs, dump_dir))


def render_page(runs: list[DumpedRun], dump_dir: str) -> str:
    """The whole page as text: title, legend, then each run's graphs and memory plans."""
    title = f"cgcompile split: {dump_dir}"
    body = [f"<h1>{_esc(title)}</h1>", _legend()]
    for run in runs:
        if run.name:
            body.append(f"<h2>run {_esc(run.name)}</h2>")
        body += [_graph(g) for g in run.graphs]
        body += [_plan(plan) for plan in run.plans]
        body += [f"<h2>breakable graphs</h2><pre>{_esc(text)}</pre>" for text in run.breakable]
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>"
            f"<style>{_CSS}{_kind_css()}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def _legend() -> str:
    items = "".join(f'<span><i class="{kind}"></i>{_esc(text)}</span>' for kind, (_, text) in KINDS.items())
    return f'<p class="legend">{items}</p>'


def _kind_css() -> str:
    return "".join(f".{kind} {{ background: {colour}; }}\n" for kind, (colour, _) in KINDS.items())


def _graph(graph: DumpedGraph) -> str:
    style = "note static" if graph.static else "note"
    notes = "".join(f'<p class="{style}">{_esc(line)}</p>' for line in graph.notes)
    boxes = "".join(_piece(p) for p in graph.pieces)
    return (f'<div class="graph"><h3>{_esc(graph.heading)}</h3>'
            f'<div class="strip" data-graph="{_esc(graph.label)}">{boxes}</div>{notes}</div>')


def _piece(piece: DumpedPiece) -> str:
    """One box: name, node count and short reason; the full reason and inputs on hover."""
    hover = [piece.label, f"{piece.kind}, {piece.nodes} node(s), code {os.path.basename(piece.code)}",
             *(piece.reason.split("; ") if piece.reason else []),
             "inputs: " + ", ".join(piece.inputs)]
    short = f"<small>{_esc(piece.short_reason)}</small>" if piece.short_reason else ""
    return (f'<div class="piece {piece.kind}" style="flex: {max(piece.nodes, _MIN_GROW)} 1 0" '
            f'title="{_esc(chr(10).join(hover))}"><b>{_esc(piece.label.rsplit(".", 1)[-1])}</b>'
            f"<small>{piece.nodes} node{'s' if piece.nodes != 1 else ''}</small>{short}</div>")


def _plan(plan: dict) -> str:
    """A memory plan as a table: size, graphs, pool after capturing it, captured."""
    rows = "".join(
        f"<tr><td>{_esc(row['size'])}</td><td>{_esc('?' if row['graphs'] is None else row['graphs'])}</td>"
        f"<td>{_mib(row['pool_bytes'])}</td><td>{'yes' if row['size'] in plan['captured'] else 'no'}</td></tr>"
        for row in plan["sizes"])
    budget = f", budget {_mib(plan['budget'])}" if plan.get("budget") is not None else ""
    return (f"<h2>memory plan: model {_esc(plan['name'])}{budget}</h2><table>"
            f"<tr><th>size</th><th>graphs</th><th>pool after</th><th>captured</th></tr>{rows}</table>")


def _mib(value) -> str:
    return "unknown" if value is None else f"{value / (1 << 20):.1f} MiB"


def _esc(value) -> str:
    return html.escape(str(value), quote=True)
