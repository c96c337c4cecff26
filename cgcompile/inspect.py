"""`python -m cgcompile.inspect DUMP_DIR`: print the split summary of every dumped graph."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from .dump import format_summary


def summaries(dump_dir: str) -> list[dict]:
    paths = glob.glob(os.path.join(dump_dir, "graph_*", "summary.json"))
    paths.sort(key=lambda p: int(os.path.basename(os.path.dirname(p)).split("_")[1]))
    result = []
    for path in paths:
        with open(path) as f:
            result.append(json.load(f))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgcompile.inspect", description=__doc__)
    parser.add_argument("dump_dir", help="the folder given as Config.dump_dir or CGCOMPILE_DUMP_DIR")
    args = parser.parse_args(argv)
    found = summaries(args.dump_dir)
    if not found:
        print(f"no cgcompile dump in {args.dump_dir!r}: expected graph_<i>/summary.json there; "
              f"compile with Config(dump_dir=...) or CGCOMPILE_DUMP_DIR set", file=sys.stderr)
        return 1
    for summary in found:
        print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
