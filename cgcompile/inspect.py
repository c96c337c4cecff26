"""`python -m cgcompile.inspect DUMP_DIR [--html OUT.html]`: what a dump folder holds, read
back (every graph's pieces, one piece in full, the memory plans). This module is the
command; the reading and the tables are `cgcompile.tools.inspect_dump`."""

import sys

from .tools.inspect_dump import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
