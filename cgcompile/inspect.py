"""`python -m cgcompile.inspect DUMP_DIR`: print the split summary of every dumped graph,
the graph-memory plan of every model (sizes, graphs, bytes; see `cgcompile.memory_plan`),
then what breakable graphs captured (`breakable_<k>.txt`, see `BreakableGroup.describe`)."""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

from .dump import format_summary, read_json
from .errors import ArgumentError, CGCompileError, expect, expected
from .memory_plan import format_plan, read_plans

_HOW_TO_DUMP = "compile with Config(dump_dir=...) or CGCOMPILE_DUMP_DIR set"
_SUMMARY_KEYS = ("graph_index", "capture_dim", "pieces")
_PIECE_KEYS = ("piece", "capturable", "nodes", "inputs", "reason")


def summaries(dump_dir: str) -> list[dict]:
    """Every graph_<i>/summary.json under dump_dir, in the order of i.

    Raises ArgumentError when dump_dir is not a folder, or names the summary that is not
    one cgcompile wrote. Folders not named graph_<i> are not summaries and are skipped.
    """
    expect(os.path.isdir(dump_dir), "dump_dir", "an existing folder", dump_dir, _HOW_TO_DUMP)
    found = []
    for path in glob.glob(os.path.join(dump_dir, "graph_*", "summary.json")):
        match = re.fullmatch(r"graph_(\d+)", os.path.basename(os.path.dirname(path)))
        if match:
            found.append((int(match.group(1)), path))
    return [_read(path) for _, path in sorted(found)]


def _read(path: str) -> dict:
    summary = read_json(path, "a summary.json written by cgcompile", _SUMMARY_KEYS, "dump again")
    pieces = summary["pieces"]
    complete = isinstance(pieces, list) and all(isinstance(p, dict) and all(k in p for k in _PIECE_KEYS) for p in pieces)
    expect(complete, f"{path}: pieces", f"a list of pieces with keys {list(_PIECE_KEYS)}", pieces, "dump again")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgcompile.inspect", description=__doc__)
    parser.add_argument("dump_dir", help="the folder given as Config.dump_dir or CGCOMPILE_DUMP_DIR")
    args = parser.parse_args(argv)
    try:
        found = summaries(args.dump_dir)
        plans = read_plans(args.dump_dir)
        breakable = breakable_descriptions(args.dump_dir)
        if not found and not plans and not breakable:
            raise ArgumentError(expected(
                "dump_dir", "graph_<i>/summary.json, memory_plan.<name>.json or breakable_<k>.txt files",
                f"no cgcompile dump in {args.dump_dir!r}", _HOW_TO_DUMP, raw=True))
    except CGCompileError as e:  # a command line prints the message, not a traceback
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1
    for summary in found:
        print(format_summary(summary))
    if plans:
        print("graph memory plan")
    for plan in plans:
        print(format_plan(plan))
    for text in breakable:
        print(f"breakable graphs\n{text}")
    return 0


def breakable_descriptions(dump_dir: str) -> list[str]:
    """The text of every breakable_<k>.txt under dump_dir, in the order of k."""
    found = []
    for path in glob.glob(os.path.join(dump_dir, "breakable_*.txt")):
        match = re.fullmatch(r"breakable_(\d+)\.txt", os.path.basename(path))
        if match:
            with open(path) as f:
                found.append((int(match.group(1)), f.read().rstrip("\n")))
    return [text for _, text in sorted(found)]


if __name__ == "__main__":
    sys.exit(main())
