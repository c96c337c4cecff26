"""Write what the backend did to disk, for people: graphs as code and a summary table.

Layout, one folder per Backend (DUMP_DIR itself for the first to dump there, then
DUMP_DIR/run_<n>, see `claim_run_folder`), and in it one folder per Dynamo graph:
  DUMP_DIR/graph_<i>/original.py   the graph Dynamo captured, before splitting
  DUMP_DIR/graph_<i>/split.py      the stitching graph that calls the pieces
  DUMP_DIR/graph_<i>/piece_<k>.py  each piece's code
  DUMP_DIR/graph_<i>/summary.json  one record per piece (read by `python -m cgcompile.inspect`)
  DUMP_DIR/graph_<i>/summary.txt   the same as a table

`show_to_debuggers` hands the same graphs to debuggers that hook torch (depyf).
"""

from __future__ import annotations

import glob
import json
import os

from torch._dynamo.utils import lazy_format_graph_code

from ..errors import ArgumentError, expect, expected
from ..stats import Piece

# reason: why eager, why compiled but never captured (gradients), or why unsafe to pad
SUMMARY_COLUMNS = ("piece", "capturable", "nodes", "inputs", "reason")


def _code(gm) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def write_graph_dump(dump_dir: str, graph_index: int, gm, split, pieces: list[Piece], capture_dim: str,
                     full_graph: str | None = None) -> str:
    folder = _new_folder(dump_dir, graph_index)
    _write(folder, "original.py", _code(gm))
    _write(folder, "split.py", _code(split.stitch))
    for piece in pieces:
        _write(folder, f"{piece.name.rsplit('.', 1)[-1]}.py", _code(piece.graph))
    summary = summarize(graph_index, pieces, capture_dim, full_graph)
    _write(folder, "summary.json", json.dumps(summary, indent=1))
    _write(folder, "summary.txt", format_summary(summary))
    return folder


def summarize(graph_index: int, pieces: list[Piece], capture_dim: str | None = None,
              full_graph: str | None = None) -> dict:
    """One graph's summary record: what summary.json holds and `format_summary` prints.

    full_graph: whether calls may replay one graph of the whole graph and what they must
    match (None: no split op is declared capturable)."""
    mine = [p for p in pieces if p.graph_index == graph_index]
    return {
        "graph_index": graph_index,
        "capture_dim": capture_dim,
        "sizes": mine[0].sizes if mine else "",
        "full_graph": full_graph,
        "pieces": [
            {
                "piece": p.name,
                "capturable": p.capturable,
                "nodes": p.node_count,
                "inputs": list(p.input_shapes),
                "reason": p.reason,
                "padding_unsafe": p.padding_unsafe,
                "uncaptured": p.uncaptured,
            }
            for p in mine
        ],
    }


def show_to_debuggers(split) -> None:
    """Pass the split graph and each piece to `torch._dynamo.utils.lazy_format_graph_code`.

    Dynamo and AOT autograd pass every graph they make through that function, and
    `depyf.prepare_debug` patches it to write each graph as a file beside Dynamo's own
    (`__compiled_fn_<n>.cgcompile_piece_<k>.<m>.py`). Outside depyf it returns a lazy
    string that is never formatted, so calling it for every graph costs nothing. The
    pieces' GraphModules alone are not enough: depyf sees their generated code too,
    but deletes it on exit as "wild" code that belongs to no compiled function.
    """
    lazy_format_graph_code("cgcompile split graph", split.stitch)
    for spec in split.pieces:
        lazy_format_graph_code(f"cgcompile {spec.name}", spec.graph)


def format_summary(summary: dict) -> str:
    """A fixed-width table of one graph's pieces."""
    rows = [
        (p["piece"], "yes" if p["capturable"] else "no", str(p["nodes"]), ", ".join(p["inputs"]),
         p["reason"] or p.get("uncaptured") or p.get("padding_unsafe") or "")
        for p in summary["pieces"]
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(SUMMARY_COLUMNS[:-1])]
    lines = [f"graph {summary['graph_index']}"]
    if summary["capture_dim"] is not None:
        lines[0] += f": capture dimension {summary['capture_dim']}"
    if summary.get("sizes"):
        lines[0] += f"; {summary['sizes']}"
    if summary.get("full_graph"):
        lines.append(summary["full_graph"])
    header = list(SUMMARY_COLUMNS)
    for row in [header] + [list(r) for r in rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


RUN_MARKER = ".cgcompile_run"  # DUMP_DIR's graphs belong to one Backend: the one that made this file


def claim_run_folder(dump_dir: str) -> str:
    """The folder one Backend dumps into, so that two runs never mix (nor their graph
    numbers: each Backend counts from graph_0): DUMP_DIR itself when no run has dumped
    there yet, else the first free DUMP_DIR/run_<n> (n >= 1). Both claims are atomic (a
    file made with O_EXCL, a folder made with mkdir), so processes sharing DUMP_DIR (ranks
    with one CGCOMPILE_DUMP_DIR) each get their own. `python -m cgcompile.inspect
    DUMP_DIR` reads every run, its graphs labelled by the run folder."""
    os.makedirs(dump_dir, exist_ok=True)
    if not glob.glob(os.path.join(dump_dir, "graph_*")):  # a dump from before the marker has no marker
        try:
            with open(os.path.join(dump_dir, RUN_MARKER), "x"):
                return dump_dir
        except FileExistsError:
            pass
    return _first_free_folder(dump_dir, "run", 1)


def _new_folder(dump_dir: str, graph_index: int) -> str:
    """graph_<k> for the first k >= graph_index not taken yet (only a Backend's own graphs
    are dumped in its folder, so k is graph_index but for a dump from before the marker)."""
    os.makedirs(dump_dir, exist_ok=True)
    return _first_free_folder(dump_dir, "graph", graph_index)


def _first_free_folder(parent: str, prefix: str, k: int) -> str:
    """Make and return parent/<prefix>_<k> for the first free k from `k` on (atomic: mkdir)."""
    while True:
        try:
            folder = os.path.join(parent, f"{prefix}_{k}")
            os.mkdir(folder)
            return folder
        except FileExistsError:
            k += 1


def _write(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)


def read_json(path: str, wanted: str, keys: tuple[str, ...], fix: str) -> dict:
    """A JSON object cgcompile wrote (a dump's summary, a memory plan), with `keys` in it;
    an ArgumentError naming the file, what it should be and `fix` otherwise."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgumentError(expected(path, wanted, f"{type(e).__name__}: {e}", fix, raw=True)) from e
    expect(isinstance(value, dict) and all(k in value for k in keys), path, f"{wanted}, with keys {list(keys)}",
           sorted(value) if isinstance(value, dict) else value, fix)
    return value

