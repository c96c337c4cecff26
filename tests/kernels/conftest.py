"""Shared by the kernel tests: a worker script run under Triton's interpreter."""

import os
import subprocess
import sys

import pytest


@pytest.fixture
def run_interpreted():
    """run_interpreted("worker.py") -> its stdout, after checking that it exited 0. The worker
    runs in its own process with TRITON_INTERPRET=1, which Triton reads at import."""
    pytest.importorskip("triton")

    def run(worker: str) -> str:
        path = os.path.join(os.path.dirname(__file__), worker)
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    return run
