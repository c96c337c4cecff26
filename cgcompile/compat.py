"""Every torch-version-dependent lookup lives here, so the rest of the code reads one API."""

from __future__ import annotations

import sys

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


def end_pool_allocation(pool) -> None:
    """After a capture whose cudaStreamEndCapture failed: torch ends the allocator's
    routing of allocations to the pool only after a successful end, so end it here. The
    pool keeps a capture's bookkeeping on the host side that no public call ends: never
    capture into a pool again after a failed capture into it (`CaptureSession.abandon`)."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except (RuntimeError, AttributeError):
        pass  # capture_end got past that point itself, or this torch names it otherwise


def reset_generators_after_failed_capture() -> None:
    """A capture that fails in cudaStreamEndCapture skips the CUDA generators' capture
    epilogue, leaving them in capture mode (every later random op then fails). Swap in a
    copy of each generator's state, which is not capturing."""
    for generator in torch.cuda.default_generators:
        if hasattr(generator, "graphsafe_set_state"):
            generator.graphsafe_set_state(generator.clone_state())


def _torch_compile_wrapper_type():
    """The class torch.compile builds once per call to hold a string backend and its options."""
    return getattr(torch, "_TorchCompileWrapper", None)


def torch_compile_call_on_stack(depth: int = 8):
    """The per-call object of the `torch.compile(...)` whose backend is running now, or None.

    Dynamo calls a string backend through that object's `__call__` (a frame or two above
    the backend); no argument of the backend names it.
    """
    wrapper = _torch_compile_wrapper_type()
    if wrapper is None:
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is wrapper.__call__.__code__:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def torch_compile_call_of(compiled):
    """The per-call object behind what torch.compile returned (a module or a function),
    or behind a module compiled in place with `module.compile(...)`; None if not found."""
    wrapper = _torch_compile_wrapper_type()
    if wrapper is None:
        return None
    candidates = [getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)]
    for fn in (compiled, getattr(compiled, "_compiled_call_impl", None)):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                candidates.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
    for candidate in candidates:
        for _ in range(8):  # Dynamo's callbacks name what they wrap in _torchdynamo_orig_backend
            if isinstance(candidate, wrapper):
                return candidate
            candidate = getattr(candidate, "_torchdynamo_orig_backend", None)
    return None
