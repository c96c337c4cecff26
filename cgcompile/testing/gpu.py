"""GPU test tools: which private memory pools exist, capture failures in a process of their
own, and a ToyLlama compiled on CUDA with dynamic ids for it."""

import subprocess
import sys

import torch

import cgcompile
from .models import SILLY_OP, ToyLlama


def private_pools() -> set[tuple[int, int]]:
    """Ids of the private pools (CUDA graph pools) that hold memory segments now; (0, 0) is the default pool."""
    return {
        tuple(seg["segment_pool_id"])
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    }


def capture_error_in_own_process(setup: str, capture: str) -> str:
    """Run `setup`, then the one statement `capture`, in a fresh Python; return its stdout.

    A capture that fails on an unjoined side-stream fork leaves the forked stream in capture
    mode for the rest of the process, so such a scenario must not run in the test process.
    `setup` runs after `import torch, cgcompile` and `side = torch.cuda.Stream()`; a
    CaptureError from `capture` is printed as "CaptureError: <message>", and it must name
    the side stream.
    """
    script = (
        f"import torch, cgcompile\nside = torch.cuda.Stream()\n{setup}\n"
        f"try:\n    {capture}\nexcept cgcompile.CaptureError as e:\n    print('CaptureError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "CaptureError:" in result.stdout, result.stdout + result.stderr
    assert "side stream" in result.stdout, result.stdout
    return result.stdout


def compiled_toy_llama(compiler: str, sizes: tuple[int, ...], n_layers: int = 3, **fields):
    """(model, backend, compiled): a seeded ToyLlama on CUDA, split at the silly op."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    # Frozen: an inference model. With gradients on, a graph whose parameters require grad
    # runs without CUDA graphs (tests/test_training.py).
    model = ToyLlama(n_layers, hidden=64, vocab=128).cuda().requires_grad_(False)
    config = cgcompile.Config(splitting_ops=(SILLY_OP,), compiler=compiler, capture_sizes=sizes, **fields)
    backend = cgcompile.Backend(config)
    return model, backend, torch.compile(model, backend=backend)


def dynamic_ids(n: int) -> torch.Tensor:
    """n token ids on CUDA, dim 0 marked dynamic (the capture dimension)."""
    ids = torch.randint(0, 128, (n,), device="cuda")
    torch._dynamo.mark_dynamic(ids, 0)
    return ids
