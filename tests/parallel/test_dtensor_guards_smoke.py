"""benchmarks/dtensor_guards.py runs on CPU (one gloo rank) and times all three variants."""

import pathlib
import subprocess
import sys

PROBE = pathlib.Path(__file__).parent.parent.parent / "benchmarks" / "dtensor_guards.py"


def test_dtensor_guards_smoke_on_cpu():
    result = subprocess.run([sys.executable, str(PROBE), "--layers", "2", "--calls", "20"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    header, row = result.stdout.strip().splitlines()[-2:]
    assert header.split()[:2] == ["layers", "params"]
    layers, params, *times = row.split()
    assert (layers, params) == ("2", "4") and len(times) == 3 and all(float(t) > 0 for t in times)
