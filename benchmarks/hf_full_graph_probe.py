"""Why a static-cache generate() step runs piecewise: the full-graph log at INFO level.

    python benchmarks/hf_full_graph_probe.py [--new-tokens 16] [--device cuda]

Runs benchmarks/hf_bench.py's cgcompile-static variant (a static cache, attention declared
capturable) once at batch 1 with the cgcompile loggers at INFO, so the first call of each
piecewise reason prints which input differed from the captured one.
"""

import logging
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
    logging.getLogger("cgcompile").setLevel(logging.INFO)
    args = sys.argv[1:] or ["--new-tokens", "16"]
    sys.path.insert(0, str(HERE))
    sys.argv = ["hf_bench.py", "--variants", "cgcompile-static", "--batches", "1", "--rounds", "1", *args]
    runpy.run_path(str(HERE / "hf_bench.py"), run_name="__main__")


if __name__ == "__main__":
    main()
