"""Every torch-version-dependent lookup lives here, so the rest of the code reads one API."""

from __future__ import annotations

import sys

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def cudagraph_unsafe_tag():
    """`torch.Tag.cudagraph_unsafe` where this torch has it, else None."""
    return getattr(torch.Tag, "cudagraph_unsafe", None)


def is_static_address(tensor) -> bool:
    """True for the tensors Dynamo marks as living at a fixed address (parameters, buffers)."""
    from torch._dynamo.utils import get_static_address_type

    return isinstance(tensor, torch.nn.Parameter) or get_static_address_type(tensor) is not None


def detect_fake_mode(values):
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None):
    """Compile one piece with Inductor for the shapes of its example inputs: fake ones with
    symbolic sizes, or real ones (every size an int). `options` patch Inductor's config
    for this compile only. Programmatic dependent launch, where on, keeps stream order
    (`build.dependent_launch`)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .build.dependent_launch import kept_in_order, waiting_first

    with kept_in_order(options) as options:  # Inductor's PDL, if on, waiting before every access
        return compile_fx(gm, static_fakes(example_inputs), inner_compile=waiting_first(compile_fx_inner),
                          config_patches=_with_cacheable_functions(options))


_MARKED = "unsafe_marked_cacheable_functions"


def _with_cacheable_functions(options: dict | None) -> dict | None:
    """`options`, plus the functions cgcompile's rewrites insert marked cacheable (where
    this torch has the setting), so that AOTAutograd's cache keeps graphs that call them."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, _MARKED):
        return dict(options) if options else None
    from .passes.cacheable import cacheable_functions

    patches = dict(options or {})
    patches[_MARKED] = {**getattr(inductor_config, _MARKED), **patches.get(_MARKED, {}), **cacheable_functions()}
    return patches


def static_fakes(example_inputs: list) -> list:
    """Real example inputs as fake tensors of the same shapes and strides, under a fake mode
    with a shape environment (no symbols: every size static); fake ones as they are.

    Inductor's FX graph cache keys a compile by its shape environment and skips the cache
    ("No shape env") for inputs without one, so a compile at real shapes (a whole-graph or
    a per-size compile) was never found in the cache by the next process."""
    if detect_fake_mode([x for x in example_inputs if isinstance(x, torch.Tensor)]) is not None:
        return example_inputs
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]


def inductor_option_types() -> dict:
    """Every key Inductor's config accepts (dotted for nested ones: "triton.cudagraphs"), with the type it declares (a type or a union,
    e.g. `bool` or `int | None`); `object` where this torch records none."""
    import torch._inductor.config as inductor_config

    entries = getattr(inductor_config, "_config", {})
    return {name: getattr(entries.get(name), "value_type", object) for name in inductor_config.get_config_copy()}


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


class PoolUse:
    """One use of a CUDA graph pool, held while buffers allocated in it outside any capture
    live. The allocator frees a pool whose uses drop to zero once its blocks are free, and
    asserts (`use_count > 0`, torch 2.11) when a capture joins a pool that has blocks but
    no uses: exactly the state buffers allocated before the first capture would leave."""

    def __init__(self, pool, device: int):
        self.pool, self.device, self._held = pool, device, True

    def release(self) -> None:
        if self._held:
            self._held = False
            torch._C._cuda_releasePool(self.device, self.pool)

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the allocator may be gone already
            pass


def allocate_in_pool(pool, allocate):
    """(allocate(), PoolUse): allocate() with this thread's CUDA allocations routed to the
    graph pool `pool` (a handle from torch.cuda.graph_pool_handle), as torch.cuda.use_mem_pool
    does for a MemPool. The pool keeps the use this raises until the PoolUse is released or
    collected: keep it as long as the buffers."""
    device = torch.cuda.current_device()
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
    use = PoolUse(pool, device)
    try:
        return allocate(), use
    finally:
        torch._C._cuda_endAllocateToPool(device, pool)


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


def shape_env_of(values):
    """The ShapeEnv behind the fake tensors or SymInts in `values`, or None (all static)."""
    for value in values:
        if isinstance(value, torch.SymInt):
            return value.node.shape_env
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    return fake_mode.shape_env if fake_mode is not None else None


def size_facts(shape_env, symbols: set) -> tuple[dict, list]:
    """What `shape_env` assumes about `symbols`: each one's value range, and the guards
    and deferred runtime asserts that mention only these symbols (as sympy expressions)."""
    ranges = {s: shape_env.var_to_range.get(s) for s in symbols}
    facts = [g.expr for g in shape_env.guards]
    facts += [a.expr for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts]
    return ranges, [e for e in facts if e.free_symbols and e.free_symbols <= symbols]


def free_unbacked_symbols(value) -> set:
    """The symbols in `value` with no hint (sizes from data, `.item()`): never guarded."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as _free_unbacked

    return set(_free_unbacked(value))


def fresh_inductor_cache():
    """A context with empty, private Inductor and AOTAutograd caches (for tests)."""
    import torch._inductor.utils as inductor_utils

    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    return fresh()


def value_range_within(inner, outer) -> bool:
    """True when the ValueRanges `inner` lies within `outer`."""
    return inner.issubset(outer)


def graph_input_sources(gm: torch.fx.GraphModule) -> list:
    """The Dynamo source (`L['self']._modules['q']._parameters['weight']`) each placeholder
    of a graph Dynamo hands a backend was read from, or None where it has none."""
    return [getattr(n.meta.get("grapharg"), "source", None) for n in gm.graph.nodes if n.op == "placeholder"]


def drop_frame_guards(drop) -> int | None:
    """Remove the guards `drop(guard)` picks from those Dynamo will build the check of the
    frame being compiled from; how many, or None where no frame is being compiled (a
    backend called outside Dynamo). Only a backend may call this: Dynamo calls it before it
    builds that check, in the tracing context that holds the guards. Where this torch keeps
    them elsewhere, nothing is removed (0): Dynamo keeps checking."""
    from collections import defaultdict

    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None:
        return None
    guards = _frame_guard_set(context)
    if guards is None:
        return 0
    kept = [guard for guard in guards.inner if not drop(guard)]
    dropped = len(guards.inner) - len(kept)
    if dropped:
        guards.inner = type(guards.inner)(kept)
        if hasattr(guards, "source_to_guards"):  # an index by source (torch >= 2.12): built again
            guards.source_to_guards = defaultdict(list)
            for guard in kept:
                guards.track_guard_by_source(guard)
    return dropped


def _frame_guard_set(context):
    """The guard set (`torch._guards.GuardsSet`) a tracing context holds for the frame being
    compiled, or None where this torch keeps its guards otherwise."""
    guards = getattr(getattr(context, "guards_context", None), "dynamo_guards", None)
    return guards if hasattr(guards, "inner") else None
