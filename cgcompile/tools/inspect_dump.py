"""`python -m cgcompile.inspect DUMP_DIR`: a table of every dumped graph's pieces (kind,
nodes, inputs, short reason) that fits 120 columns, the graph-memory plan of every model
(see `cgcompile.tools.memory_plan`), then what breakable graphs captured (`breakable_<k>.txt`,
see `BreakableGroup.describe`). `--piece` and `--verbose` print a piece's full reason,
inputs and code file; `--html OUT.html` draws the split as one self-contained page."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import html
import os
import re
import sys
import textwrap

from .dump import read_json
from ..errors import ArgumentError, CGCompileError, expect, expected
from .memory_plan import format_plan, plan_answers, read_plans

_HOW_TO_DUMP = "compile with Config(dump_dir=...) or CGCOMPILE_DUMP_DIR set"
_SUMMARY_KEYS = ("graph_index", "capture_dim", "pieces")
_PIECE_KEYS = ("piece", "capturable", "nodes", "inputs", "reason")
_GRAPH_FOLDER = re.compile(r"graph_(\d+)")
_RULE_TAG = re.compile(r"\[(\w+)\]$")
WIDTH = 120  # the table never grows wider; --piece and --verbose print the rest
STATIC_HINT = (  # two lines under WIDTH, printed under every static graph
    "why static: no graph input has a dynamic dimension 0 (Dynamo specialises a size of 1, e.g. batch 1)",
    "to capture by token count: Config(capture_input=..., capture_input_dim=...); "
    'docs/design.md, "The capture dimension"',
)
_SYMBOL = re.compile(r"\b[su]\d+\b")


@dataclasses.dataclass(frozen=True)
class DumpedPiece:
    """One row of a summary.json, named uniquely across the dump (`label`)."""

    label: str  # graph label and piece, e.g. "graph1.piece_3" or "run_b/graph0.piece_1"
    kind: str  # "capturable", "eager", or "full-graph": eager, but inside the graph's full graph
    nodes: int
    inputs: tuple[str, ...]
    reason: str  # why it runs eagerly (or why padding is unsafe); "" for a plain capturable piece
    code: str  # the piece's code file

    @property
    def short_reason(self) -> str:
        return short_reason(self.reason)

    @property
    def sizes(self) -> str:
        """The symbolic sizes in the input shapes ("s0 s53"), "-" where every shape is fixed."""
        return " ".join(dict.fromkeys(_SYMBOL.findall(" ".join(self.inputs)))) or "-"


@dataclasses.dataclass(frozen=True)
class DumpedGraph:
    label: str  # "graph<i>" from the folder name, prefixed by the run folder when there are several
    folder: str
    capture_dim: str | None  # None: static
    sizes: str  # the sizing line (sizes captured, padding), as the backend wrote it
    full_graph: str | None  # what a call must match to replay the whole graph; None: no capturable split op
    pieces: tuple[DumpedPiece, ...]

    @property
    def static(self) -> bool:
        return self.capture_dim is None

    @property
    def heading(self) -> str:
        """"graph1: capture dimension s0 ...; 5 pieces, 3 capturable (131 of 137 nodes)".

        Not "captured": a dump does not say whether CUDA graphs ran (on a CPU none do), only
        which nodes sit in pieces a capture would hold."""
        captured = sum(p.nodes for p in self.pieces if p.kind == "capturable")
        capturable = sum(p.kind == "capturable" for p in self.pieces)
        dim = "static (no capture dimension)" if self.static else f"capture dimension {self.capture_dim}"
        return (f"{self.label}: {dim}; {len(self.pieces)} pieces, {capturable} capturable "
                f"({captured} of {sum(p.nodes for p in self.pieces)} nodes)")

    @property
    def notes(self) -> tuple[str, ...]:
        """What to print under the heading: the sizing line (or why the graph is static and
        what to set), then what a call must match to replay the full graph."""
        notes = STATIC_HINT if self.static else (self.sizes,)
        return tuple(n for n in (*notes, self.full_graph) if n)


@dataclasses.dataclass(frozen=True)
class DumpedRun:
    """What one dump folder holds: DUMP_DIR itself, or one run's subfolder of it."""

    name: str  # "" for DUMP_DIR itself
    graphs: tuple[DumpedGraph, ...]
    plans: tuple[dict, ...]  # memory_plan.<name>.json, as written
    breakable: tuple[str, ...]  # the text of breakable_<k>.txt


# -- reading ------------------------------------------------------------------------------


def read_dump(dump_dir: str) -> list[DumpedRun]:
    """DUMP_DIR and every subfolder of it that holds a dump (one per run, where runs keep
    their own folders), DUMP_DIR first, then by name; runs with nothing are left out.

    Raises ArgumentError when dump_dir is not a folder, holds no dump, or holds a file
    that is not one cgcompile wrote (naming it)."""
    expect(os.path.isdir(dump_dir), "dump_dir", "an existing folder", dump_dir, _HOW_TO_DUMP)
    subfolders = sorted(e for e in os.listdir(dump_dir)
                        if os.path.isdir(os.path.join(dump_dir, e)) and not _GRAPH_FOLDER.fullmatch(e))
    runs = [_read_run(dump_dir, name) for name in ["", *subfolders]]
    runs = [r for r in runs if r.graphs or r.plans or r.breakable]
    if not runs:
        raise ArgumentError(expected(
            "dump_dir", "graph_<i>/summary.json, memory_plan.<name>.json or breakable_<k>.txt files",
            f"no cgcompile dump in {dump_dir!r}", _HOW_TO_DUMP, raw=True))
    if len(runs) == 1 and runs[0].name:  # one run in a subfolder: labels need no prefix
        runs = [_read_run(dump_dir, runs[0].name, prefix="")]
    return runs


def _read_run(dump_dir: str, name: str, prefix: str | None = None) -> DumpedRun:
    folder = os.path.join(dump_dir, name) if name else dump_dir
    prefix = (f"{name}/" if name else "") if prefix is None else prefix
    return DumpedRun(name, tuple(summaries(folder, prefix)), tuple(read_plans(folder)),
                     tuple(breakable_descriptions(folder)))


def summaries(dump_dir: str, prefix: str = "") -> list[DumpedGraph]:
    """Every graph_<i>/summary.json directly under dump_dir, in the order of i.

    Labels come from the folder name, not the recorded graph index: several Backends
    dumping into one folder each number their graphs from 0, and the dump gives the
    second graph 0 the next free folder, so only the folder name is unique."""
    expect(os.path.isdir(dump_dir), "dump_dir", "an existing folder", dump_dir, _HOW_TO_DUMP)
    found = []
    for path in glob.glob(os.path.join(dump_dir, "graph_*", "summary.json")):
        match = _GRAPH_FOLDER.fullmatch(os.path.basename(os.path.dirname(path)))
        if match:
            found.append((int(match.group(1)), path))
    return [_graph(f"{prefix}graph{i}", path) for i, path in sorted(found)]


def _graph(label: str, path: str) -> DumpedGraph:
    summary = _read(path)
    folder = os.path.dirname(path)
    has_full_graph = str(summary.get("full_graph") or "").startswith("full graph")
    pieces = tuple(_piece(label, folder, p, has_full_graph) for p in summary["pieces"])
    capture_dim = summary["capture_dim"]
    return DumpedGraph(label, folder, None if capture_dim in (None, "None") else str(capture_dim),
                       summary.get("sizes") or "", summary.get("full_graph"), pieces)


def _piece(graph_label: str, folder: str, record: dict, has_full_graph: bool) -> DumpedPiece:
    local = str(record["piece"]).rsplit(".", 1)[-1]  # "piece_<k>", the name of its code file
    kind = "capturable" if record["capturable"] else "full-graph" if has_full_graph else "eager"
    reason = record["reason"] or (f"padding unsafe: {record['padding_unsafe']}" if record.get("padding_unsafe") else "")
    return DumpedPiece(f"{graph_label}.{local}", kind, int(record["nodes"]), tuple(record["inputs"]), reason,
                       os.path.join(folder, f"{local}.py"))


def _read(path: str) -> dict:
    summary = read_json(path, "a summary.json written by cgcompile", _SUMMARY_KEYS, "dump again")
    pieces = summary["pieces"]
    complete = isinstance(pieces, list) and all(isinstance(p, dict) and all(k in p for k in _PIECE_KEYS) for p in pieces)
    expect(complete, f"{path}: pieces", f"a list of pieces with keys {list(_PIECE_KEYS)}", pieces, "dump again")
    return summary


def breakable_descriptions(dump_dir: str) -> list[str]:
    """The text of every breakable_<k>.txt under dump_dir, in the order of k."""
    found = []
    for path in glob.glob(os.path.join(dump_dir, "breakable_*.txt")):
        match = re.fullmatch(r"breakable_(\d+)\.txt", os.path.basename(path))
        if match:
            with open(path) as f:
                found.append((int(match.group(1)), f.read().rstrip("\n")))
    return [text for _, text in sorted(found)]


# -- formatting ---------------------------------------------------------------------------


def short_reason(reason: str) -> str:
    """The rule tags of a reason in order, then its first node: "dynamic_shape, split_op at
    keys (+2)". A reason is "node: detail [rule]" joined by "; " (`SplitReason`)."""
    if not reason or reason.startswith("padding unsafe"):
        return "padding unsafe" if reason else ""
    parts = reason.split("; ")
    tags = list(dict.fromkeys(m.group(1) for m in map(_RULE_TAG.search, parts) if m))
    if not tags:
        return reason
    node = parts[0].split(": ", 1)[0]
    more = f" (+{len(parts) - 1})" if len(parts) > 1 else ""
    return f"{', '.join(tags)} at {node}{more}"


def format_graph(graph: DumpedGraph) -> str:
    """The graph's heading, sizing, and one row per piece, each at most WIDTH characters."""
    lines = [_fit(graph.heading)]
    lines += [line for note in graph.notes for line in textwrap.wrap(note, WIDTH, initial_indent="  ",
                                                                      subsequent_indent="    ")]
    name_width = max([len("piece"), *(len(p.label) for p in graph.pieces)])
    size_width = min(16, max([len("sizes"), *(len(p.sizes) for p in graph.pieces)]))
    lines.append(f"  {'piece':<{name_width}}  {'kind':<10}  {'nodes':>5}  {'inputs':>6}  {'sizes':<{size_width}}  reason")
    for p in graph.pieces:
        sizes = p.sizes if len(p.sizes) <= size_width else p.sizes[:size_width - 3] + "..."
        lines.append(_fit(f"  {p.label:<{name_width}}  {p.kind:<10}  {p.nodes:>5}  {len(p.inputs):>6}  "
                          f"{sizes:<{size_width}}  {p.short_reason}".rstrip()))
    return "\n".join(lines)


def format_piece(piece: DumpedPiece) -> str:
    """Everything about one piece: kind, nodes, full reason, every input, the code file."""
    nodes = f"{piece.nodes} node{'s' if piece.nodes != 1 else ''}"
    lines = [f"{piece.label}: {piece.kind}, {nodes}, code {piece.code}"]
    for part in (piece.reason.split("; ") if piece.reason else []):
        lines += textwrap.wrap(part, WIDTH, initial_indent="  reason: ", subsequent_indent="    ")
    lines += [f"  input {i}: {shape}" for i, shape in enumerate(piece.inputs)]
    return "\n".join(lines)


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 3] + "..."


def find_pieces(runs: list[DumpedRun], wanted: str) -> list[DumpedPiece]:
    """Pieces named `wanted` ("graph0.piece_3", with its run prefix where there are
    several), or, for a number k, piece_k of every graph."""
    every = [p for run in runs for g in run.graphs for p in g.pieces]
    if wanted.isdigit():
        return [p for p in every if p.label.endswith(f".piece_{int(wanted)}")]
    return [p for p in every if p.label == wanted or p.label.endswith(f"/{wanted}")]


# -- the command line ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgcompile.inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump_dir", help="the folder given as Config.dump_dir or CGCOMPILE_DUMP_DIR")
    parser.add_argument("--piece", metavar="N|NAME",
                        help="one piece in full: piece_N of every graph, or a name such as graph0.piece_3")
    parser.add_argument("--verbose", "-v", action="store_true", help="every piece in full after the tables")
    parser.add_argument("--html", metavar="OUT.html", help="also write the split as one self-contained HTML page")
    args = parser.parse_args(argv)
    bad_page = args.html and _unwritable_page(args.html)
    if bad_page:  # checked before the tables, so the error is not lost under them
        print(f"{parser.prog}: --html: {bad_page}", file=sys.stderr)
        return 2
    try:
        runs = read_dump(args.dump_dir)
        chosen = find_pieces(runs, args.piece) if args.piece else []
        expect(not args.piece or bool(chosen), "--piece", "a piece of the dump (see the table)", args.piece)
    except CGCompileError as e:  # a command line prints the message, not a traceback
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    print("\n\n".join(format_piece(p) for p in chosen) if chosen else format_runs(runs, args.verbose))
    if args.html:
        write_page(args.html, runs, args.dump_dir)
        print(f"wrote {args.html}")
    return 0


def _unwritable_page(path: str) -> str:
    """Why the page cannot be written at path ("" when it can): a folder, or a file under a
    folder that does not exist."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return (f"expected a file path for the page, got the folder {path!r}; "
                f"pass a file name in it, e.g. --html {os.path.join(path, 'split.html')}")
    if not os.path.isdir(folder):
        return (f"expected a file path in an existing folder, got {path!r}, whose folder {folder!r} "
                f"does not exist; create it first or pass a path in an existing folder")
    return ""


def format_runs(runs: list[DumpedRun], verbose: bool = False) -> str:
    return "\n\n".join(_format_run(run, verbose) for run in runs)


def _format_run(run: DumpedRun, verbose: bool) -> str:
    blocks = [f"run {run.name}"] if run.name else []
    blocks += [format_graph(g) for g in run.graphs]
    if verbose:
        blocks += [format_piece(p) for g in run.graphs for p in g.pieces]
    if run.plans:
        blocks.append("graph memory plan\n" + "\n".join(format_plan(plan) for plan in run.plans))
    blocks += [f"breakable graphs\n{text}" for text in run.breakable]
    return "\n\n".join(blocks)



# --------------------------------------------------------------------------------------
# `python -m cgcompile.inspect DUMP_DIR --html OUT.html`: the split as one page.
#
# Each Dynamo graph is a horizontal strip of its pieces in replay order, as wide as their
# node counts (with a floor, so a one-node attention piece stays visible), coloured by kind;
# hovering a piece shows its full reason and input shapes (the title attribute). Under the
# strips: the capture dimension and sizing line of each graph, and the memory plan of each
# model where the dump holds one. The page is self-contained (inline CSS, no scripts, no
# external URLs), so it can be attached to an issue or opened from a CI artifact.

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
        body += [_graph_html(g) for g in run.graphs]
        body += [_plan(plan) for plan in run.plans]
        body += [f"<h2>breakable graphs</h2><pre>{_esc(text)}</pre>" for text in run.breakable]
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>"
            f"<style>{_CSS}{_kind_css()}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def _legend() -> str:
    items = "".join(f'<span><i class="{kind}"></i>{_esc(text)}</span>' for kind, (_, text) in KINDS.items())
    return f'<p class="legend">{items}</p>'


def _kind_css() -> str:
    return "".join(f".{kind} {{ background: {colour}; }}\n" for kind, (colour, _) in KINDS.items())


def _graph_html(graph: DumpedGraph) -> str:
    style = "note static" if graph.static else "note"
    notes = "".join(f'<p class="{style}">{_esc(line)}</p>' for line in graph.notes)
    boxes = "".join(_piece_html(p) for p in graph.pieces)
    return (f'<div class="graph"><h3>{_esc(graph.heading)}</h3>'
            f'<div class="strip" data-graph="{_esc(graph.label)}">{boxes}</div>{notes}</div>')


def _piece_html(piece: DumpedPiece) -> str:
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
    verb, answers = plan_answers(plan)
    rows = "".join(
        f"<tr><td>{_esc(row['size'])}</td><td>{_esc('?' if row['graphs'] is None else row['graphs'])}</td>"
        f"<td>{_mib(row['pool_bytes'])}</td><td>{_esc(answer)}</td></tr>"
        for row, answer in zip(plan["sizes"], answers))
    budget = f", budget {_mib(plan['budget'])}" if plan.get("budget") is not None else ""
    return (f"<h2>memory plan: model {_esc(plan['name'])}{budget}</h2><table>"
            f"<tr><th>size</th><th>graphs</th><th>pool after</th><th>{_esc(verb)}</th></tr>{rows}</table>")


def _mib(value) -> str:
    return "unknown" if value is None else f"{value / (1 << 20):.1f} MiB"


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


if __name__ == "__main__":
    sys.exit(main())
