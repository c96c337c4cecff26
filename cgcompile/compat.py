"""Every torch-version-dependent lookup lives here, so the rest of the code reads one API."""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def cudagraph_unsafe_tag():
    """`torch.Tag.cudagraph_unsafe` where this torch has it, else None."""
    return getattr(torch.Tag, "cudagraph_unsafe", None)


def free_symbols(value) -> set:
    """Sympy symbols that a fake tensor's sizes/strides or a SymInt depend on."""
    from torch.fx.experimental.symbolic_shapes import free_symbols as _free_symbols

    return set(_free_symbols(value))


def is_static_address(tensor) -> bool:
    """True for the tensors Dynamo marks as living at a fixed address (parameters, buffers)."""
    from torch._dynamo.utils import get_static_address_type

    return isinstance(tensor, torch.nn.Parameter) or get_static_address_type(tensor) is not None


def detect_fake_mode(values):
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list):
    """Compile one piece with Inductor for the (symbolic) shapes of its fake example inputs."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def release_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces; the next matmul allocates a new one."""
    torch._C._cuda_clearCublasWorkspaces()


def stop_pool_allocation_after_failed_capture(pool) -> None:
    """A capture whose cudaStreamEndCapture fails leaves the caching allocator sending the
    capture stream's allocations to the graph's pool (torch ends that only after a
    successful end) and the pool's use count raised. End both, where capture_end did not."""
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:
        return  # capture_end got past that point itself; the graph's reset releases the pool
    torch._C._cuda_releasePool(device, pool)


def new_memory_pool():
    """A pool id that stays valid while the returned owner lives, whether or not any graph
    uses it: `torch.cuda.MemPool` holds a use count, so dropping every graph of a pool
    while its tensors are still alive cannot leave the allocator a pool with none, which
    the next capture into it would trip over."""
    owner = torch.cuda.MemPool()
    return owner, owner.id


def reset_generators_after_failed_capture() -> None:
    """A capture that fails in cudaStreamEndCapture skips the CUDA generators' capture
    epilogue, leaving them in capture mode (every later random op then fails). Swap in a
    copy of each generator's state, which is not capturing."""
    for generator in torch.cuda.default_generators:
        if hasattr(generator, "graphsafe_set_state"):
            generator.graphsafe_set_state(generator.clone_state())
