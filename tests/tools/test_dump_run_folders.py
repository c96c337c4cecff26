"""Two Backends sharing one dump folder: each Backend's memory plan lies beside its own
graphs (the second Backend's in run_1/, as examples/vision_encoder.py's decoder), so that
`python -m cgcompile.inspect` shows each plan under the run that made it."""

import os
import subprocess
import sys

import torch

import cgcompile
from cgcompile.testing.models import SILLY_OP, ToyLlama


def _compile_and_plan(dump_dir: str, name: str) -> cgcompile.Backend:
    torch.manual_seed(0)
    model = ToyLlama(2)
    config = cgcompile.Config(compiler="eager", splitting_ops=[SILLY_OP], capture_sizes=(2, 4, 8), dump_dir=dump_dir)
    backend = cgcompile.Backend(config)
    ids = torch.randint(0, 64, (5,))
    torch._dynamo.mark_dynamic(ids, 0)
    assert torch.equal(torch.compile(model, backend=backend)(ids), model(ids))
    backend.plan_memory(name=name)
    return backend


def test_each_backends_memory_plan_lies_beside_its_graphs(tmp_path):
    _compile_and_plan(str(tmp_path), "encoder")
    torch._dynamo.reset()  # the second model compiles its own graph, as a second process would
    _compile_and_plan(str(tmp_path), "decoder")
    top = set(os.listdir(tmp_path))
    assert {"graph_0", "memory_plan.encoder.json", "run_1"} <= top
    assert "memory_plan.decoder.json" not in top
    assert {"graph_0", "memory_plan.decoder.json"} <= set(os.listdir(tmp_path / "run_1"))

    result = subprocess.run([sys.executable, "-m", "cgcompile.inspect", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # The run_1 heading comes before the decoder's plan, after the encoder's.
    out = result.stdout
    assert out.index("model encoder:") < out.index("run run_1") < out.index("model decoder:"), out
