"""Run as a script by test_cuda_backend.py: do replays keep writing into a cuBLAS workspace
that was handed back to the allocator? Prints "clean" or "corrupted"; exits 0 either way.

    python tests/cublas_workspace_check.py [--without-fix]
"""

import sys

import torch

import cgcompile
import cgcompile.capture

if "--without-fix" in sys.argv:  # shows what the check detects when captures keep the old workspace
    cgcompile.capture.release_cublas_workspaces = lambda: None

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda().to(torch.bfloat16)
compiled = torch.compile(model, backend=cgcompile.Backend(cgcompile.Config(compiler="eager")))
x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    want = model(x)
    compiled(x)  # capture
    # What torch's CUDA graph trees do around each of their captures: cuBLAS's cached
    # workspaces go back to the allocator, and new tensors may be placed there.
    torch._C._cuda_clearCublasWorkspaces()
    sentinels = [torch.zeros(256 * 1024, device="cuda") for _ in range(256)]  # 256 MiB of 1 MiB blocks
    outputs = [compiled(x) for _ in range(3)]
    torch.cuda.synchronize()
clean = all(bool((s == 0).all()) for s in sentinels) and all(torch.equal(o, want) for o in outputs)
print("clean" if clean else "corrupted")
