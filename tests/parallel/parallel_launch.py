"""Start a script on 2 local ranks under torchrun, for the tests of tests/parallel."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).parents[2]
# NVLink multicast stays off in every multi-GPU program (it can take a shared host's GPUs down).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs")


def torchrun(script: pathlib.Path, *args: str, timeout: int = 120, nproc: int = 2) -> str:
    """Run `script` on `nproc` local ranks; kill the whole process group if it outlives `timeout`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script), *args]
    env = {**NO_MULTICAST, **os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{script.name} hung for {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    assert process.returncode == 0, out[-2000:] + err[-4000:]
    return out


def interpreted_ranks(world: int, dtype: str, *mode: str) -> str:
    """tests/parallel/lamport_interpret_worker.py on `world` forked ranks under Triton's CPU
    interpreter; its output, after checking that it finished."""
    worker = ROOT / "tests" / "parallel" / "lamport_interpret_worker.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(worker), str(world), dtype, *mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout
