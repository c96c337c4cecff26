"""`python -m cgcompile.fuzz`: the differential fuzzer, which lives in `cgcompile.testing.fuzz`."""

import sys

from .testing.fuzz import main

if __name__ == "__main__":
    sys.exit(main())
