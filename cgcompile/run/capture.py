"""Capture state shared by every CUDA graph runner of one owner, and the capture primitive.

Memory sharing invariant. All graphs of a session live in one pool. During the call
that captures a graph, its outputs are ordinary (owning) tensors, so Python refcounts
keep each output alive exactly until its last consumer in that call has been captured;
only then can a later capture reuse its memory. After the call, runners keep
non-owning aliases (`weak_alias`) of their static tensors. Replaying the graphs of one
size in capture order then never lets a graph overwrite memory that a later graph of
the same step still has to read, while graphs of different sizes, which never run in
the same step, reuse each other's memory: the pool for all sizes stays close to the
pool for the largest one.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import warnings
import weakref
from typing import Any, Callable

import torch

from .buffers import LiveBuffers, PaddingTable
from ..compat import end_pool_allocation, release_cublas_workspaces, reset_generators_after_failed_capture
from ..errors import CaptureError, describe
from ..passes import tensors_in

log = logging.getLogger(__name__)


class Mode(enum.Enum):
    LAZY = "lazy"  # first call of a size: warm up, then capture
    WARMUP = "warmup"  # ahead-of-time warm-up run: run padded, capture nothing
    CAPTURE = "capture"  # ahead-of-time capture run: capture without another warm-up


class _DeviceArray:
    """Exposes a device pointer through __cuda_array_interface__, owning nothing."""

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


_INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def weak_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that views `tensor`'s memory without keeping that memory alive.

    A tensor off the GPU (graphs faked on CPU, `CaptureSession.graphs`) has no CUDA array
    interface to alias: it is returned as it is."""
    size = tensor.element_size()
    if tensor.numel() == 0 or size not in _INT_TYPESTR or tensor.device.type != "cuda":
        return tensor
    interface = {
        "shape": tuple(tensor.shape),
        "typestr": _INT_TYPESTR[size],
        "data": (tensor.data_ptr(), False),
        "strides": tuple(s * size for s in tensor.stride()),
        "version": 2,
    }
    # A normal tensor even when captured under inference_mode: replays outside it must
    # still be able to copy into the graph's input buffers.
    with torch.inference_mode(False):
        alias = torch.as_tensor(_DeviceArray(interface), device=tensor.device)
        return alias.view(tensor.dtype)


class HostTensorError(CaptureError):
    """A piece about to be captured hands a CPU tensor across its boundary.

    The split rule (`cgcompile.passes.split_rule`, rule cpu_tensor) runs every op that
    reads or makes a CPU tensor eagerly, so this is a cgcompile bug. Caught before the
    graph is kept: a capture that went through would replay the host value it was
    captured with, a silent wrong result. It is a `CaptureError`, so a piece armed with
    capture recovery (`recovery.PieceRecovery`) runs eagerly instead, with a warning that
    quotes this message; elsewhere the user sees it."""


def refuse_host_tensors(name: str, role: str, values) -> None:
    """Raise `HostTensorError` naming the first of `values` (a piece's inputs or outputs)
    that is, or holds, a CPU tensor."""
    for i, value in enumerate((values,) if isinstance(values, torch.Tensor) else values):
        if any(t.device.type == "cpu" for t in tensors_in(value)):
            raise HostTensorError(
                f"{name}: expected every tensor {role} of a captured piece on the GPU, got {role} {i}: "
                f"{describe(value)}; a CUDA graph would replay the value it was captured with. "
                f"The split rule should have run the op that {'reads' if role == 'input' else 'makes'} "
                f"it eagerly: this is a cgcompile bug, please report it with the model"
            )


class EmptyGraph:
    """What a capture that recorded no GPU work leaves (a piece of views and host-side
    values only): replaying it launches nothing, so `replay` does nothing, and costs no
    graph launch. The captured graph is kept, so the pool lives as long as it would."""

    __slots__ = ("graph",)

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph

    def replay(self) -> None:
        pass

    def reset(self) -> None:
        self.graph.reset()


_EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"


def end_capture(graph: torch.cuda.CUDAGraph) -> bool:
    """`graph.capture_end()`; returns whether the graph recorded no work.

    torch warns about an empty graph ("... usually means that the graph was attempted to
    be captured on wrong device or stream"). cgcompile captures on its own stream, so an
    empty graph here is a piece that launches no kernels on the capture's device (float()
    of a float32 tensor, say); the caller says so in its own words. Other warnings pass
    through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.capture_end()
    empty = False
    for w in caught:
        if str(w.message).startswith(_EMPTY_GRAPH_WARNING):
            empty = True
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return empty


class CudaGraphs:
    """How every session warms up and captures, and where graphs can run: with
    `torch.cuda.CUDAGraph`, on the session's capture stream.

    The one seam for running graph pieces without a GPU: `CaptureSession.graphs` holds an
    instance, and `cgcompile.testing.fake_graphs` swaps in graphs that rerun the captured
    function on CPU, so the pieces' logic (static buffers, padding, replay order) is tested
    there as it runs on the GPU."""

    def runs_on(self, device: torch.device) -> bool:
        """Whether tensors on `device` can be captured (the analysis's default for
        `Config.cudagraphs=None`)."""
        return device.type == "cuda"

    def warm_up(self, session: "CaptureSession", fn: Callable, *args, **kwargs) -> Any:
        with session.on_capture_stream():
            return fn(*args, **kwargs)

    def capture(self, session: "CaptureSession", name: str, fn: Callable, make_args: Callable[[], tuple]):
        """`CaptureSession.capture`, in `session`."""
        with session.on_capture_stream(), gc_paused():
            graph = session.begin_graph()
            try:
                args = make_args()
                refuse_host_tensors(name, "input", args)
                outputs = fn(*args)
                refuse_host_tensors(name, "output", outputs)
            except HostTensorError:
                session.abandon(graph)
                raise
            except Exception as e:
                session.abandon(graph)
                raise CaptureError(f"capturing {name} failed: {e}") from e
            if session.end_graph(graph, name):
                log.info("cgcompile: %s launches no GPU work (views and host-side values only); "
                         "its replays launch nothing", name)
                graph = EmptyGraph(graph)
        return graph, args, outputs


# Every session alive in this process, for `release_all_graphs`.
_LIVE_SESSIONS: "weakref.WeakSet[CaptureSession]" = weakref.WeakSet()


def release_all_graphs() -> int:
    """Drop the CUDA graphs of every live session (they recapture on their next call);
    returns how many sessions had graphs. Needed before an NCCL process group is torn
    down: ncclCommDestroy waits while graphs that captured the communicator's collectives
    exist (pytorch#115388)."""
    released = 0
    for session in list(_LIVE_SESSIONS):
        if session.graphs_captured and torch.cuda.is_available() and torch.cuda.is_initialized():
            session.release_graphs()
            released += 1
    gc.collect()  # graphs still referenced only from cycles are destroyed now, not at exit
    return released


class CaptureSession:
    """Pool, capture stream, mode and the buffers graphs read in place.

    One session per owner (a Backend or a manager); every runner gets it explicitly.
    live: outputs of graphs captured in the current call and persistent buffers (a
        pipeline stage's): a graph piece captured with one as an input reads it in place
        (`buffers.LiveBuffers`).
    """

    graphs = CudaGraphs()  # how graphs are captured, and on which devices: the seam fake graphs replace

    def __init__(self, capture_sizes: tuple[int, ...], *, pool: GraphPool | None = None,
                 error_mode: str = "global", check_addresses: bool = False):
        self.padding = PaddingTable(capture_sizes)
        self.error_mode = error_mode
        self.check_addresses = check_addresses
        self.mode = Mode.LAZY
        # False after a capture under a memory budget: a call that finds no graph for its
        # size runs without one instead of capturing it lazily (see `cgcompile.tools.memory_plan`).
        self.lazy_capture = True
        self.graphs_captured = 0
        self._plans: "weakref.WeakSet" = weakref.WeakSet()  # runtimes' replay plans (`graphs_changed`)
        self._pool = pool
        self._pool_given = pool is not None  # a shared pool outlives clear()
        self._retired: list[GraphPool] = []  # pools a capture failed in: never captured into again
        self._stream: torch.cuda.Stream | None = None
        self._runners: list[weakref.ref] = []
        self._graphs: "weakref.WeakSet[torch.cuda.CUDAGraph]" = weakref.WeakSet()  # every graph begun here
        self._anchor: tuple[tuple, torch.cuda.CUDAGraph] | None = None  # (pool handle, graph): `_anchor_pool`
        self.live = LiveBuffers()
        _LIVE_SESSIONS.add(self)

    @classmethod
    def for_config(cls, config, *, pool=None, sizes: tuple[int, ...] | None = None) -> "CaptureSession":
        """The session a Config asks for (its sizes unless `sizes`), on `pool` if given."""
        return cls(
            sizes or config.sizes.capture_sizes,
            pool=as_pool(pool),
            error_mode=config.graphs.capture_error_mode,
            check_addresses=config.debug.check_addresses,
        )

    @property
    def pool(self) -> GraphPool:
        if self._pool is None:
            self._pool = GraphPool()
        return self._pool

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def graph_memory(self) -> int:
        """Bytes the pool holds now, with pools retired after a failed capture (0 before
        anything was captured)."""
        if not self.graphs_captured:
            return 0
        return sum(p.bytes_reserved() for p in (self.pool, *self._retired))

    def abandon(self, graph: torch.cuda.CUDAGraph) -> None:
        """End a capture that failed midway; later captures go to a new pool."""
        try:
            graph.capture_end()
        except RuntimeError:
            pass
        self._after_failed_capture()

    def _after_failed_capture(self) -> None:
        """Leave the allocator and the generators usable, and retire the pool.

        A failed capture leaves the pool marked as being captured into (on the host
        allocator's side too), and the next capture into it would fail. The graphs
        already in it keep replaying from it; new graphs go to a fresh pool, which
        shares no memory with the old one, so no graph can overwrite another's data.
        """
        end_pool_allocation(self.pool.handle)
        reset_generators_after_failed_capture()
        release_cublas_workspaces()
        if self._pool_given:
            log.warning("cgcompile: a capture into the pool you passed failed; "
                        "later graphs go to a pool of their own")
        self._anchor = None  # the retired pool is freed once its graphs are gone
        self._retired.append(self.pool)
        self._pool, self._pool_given = None, False

    def _anchor_pool(self) -> None:
        """Keep the pool alive with an empty graph of its own.

        torch releases a pool when its last graph goes (graphs dropped after their
        weights moved, an empty segment's graph, a size captured and then given up) and
        then fails an internal assertion (use_count > 0) on the next capture into it.
        With the anchor alive, graphs captured again go into the same pool and reuse the
        memory the dropped ones gave back, instead of a new pool per recapture whose
        predecessors stay reserved until an allocation fails.
        """
        handle = tuple(self.pool.handle)
        if self._anchor is None or self._anchor[0] != handle:  # a new pool's anchor replaces the old one's
            anchor = torch.cuda.CUDAGraph()
            anchor.capture_begin(pool=self.pool.handle, capture_error_mode=self.error_mode)
            end_capture(anchor)  # empty by design: no warning
            self._anchor = (handle, anchor)

    def register(self, runner) -> None:
        self._runners.append(weakref.ref(runner))

    @contextlib.contextmanager
    def mode_as(self, mode: Mode):
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous

    def warm_up(self, fn: Callable, *args, **kwargs) -> Any:
        """Run once on the capture stream, so lazy initialisation (cuBLAS handles for that
        stream, autotuning, allocator warm-up) happens before and outside capture."""
        return self.graphs.warm_up(self, fn, *args, **kwargs)

    def begin_graph(self) -> torch.cuda.CUDAGraph:
        """Start capturing a new graph into the pool, on the capture stream (already entered).

        cuBLAS keeps one workspace per (handle, stream) and a graph replays matmuls that
        write into the workspace they were captured with. A workspace left over from the
        warm-up lives outside the pool, and whoever clears cuBLAS workspaces later (torch's
        own CUDA graph trees do, before and after each of their captures) hands it back to
        the allocator while our graphs still write into it: replays then corrupt other
        tensors or fault. So the workspaces are dropped around every capture, and the one
        a captured matmul allocates comes from the pool and lives as long as it.
        """
        release_cublas_workspaces()
        self._anchor_pool()
        graph = torch.cuda.CUDAGraph()
        self._graphs.add(graph)
        graph.capture_begin(pool=self.pool.handle, capture_error_mode=self.error_mode)
        return graph

    def end_graph(self, graph: torch.cuda.CUDAGraph, name: str) -> bool:
        """End the capture of `graph`; returns whether it recorded no GPU work."""
        try:
            empty = end_capture(graph)
            release_cublas_workspaces()  # eager matmuls after this must not reuse the pool's
        except RuntimeError as e:
            self._after_failed_capture()
            raise CaptureError(
                f"capturing {name} failed at the end of capture: {e}. If {name} forks work onto a "
                f"side stream, join it before the piece ends or the next break "
                f"(torch.cuda.current_stream().wait_stream(side_stream))"
            ) from e
        self.graphs_captured += 1
        return empty

    @contextlib.contextmanager
    def on_capture_stream(self):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, name: str, fn: Callable, make_args: Callable[[], tuple]):
        """Capture `fn(*make_args())` into a new graph in the pool.

        make_args runs inside the capture, so the buffers it allocates come from the pool.
        Returns (graph, args, outputs); outputs are owning tensors, valid after a replay.
        A capture that recorded no GPU work returns an `EmptyGraph`, whose replay is free.
        A CPU tensor among the inputs or outputs raises `HostTensorError` (see there).
        """
        return self.graphs.capture(self, name, fn, make_args)

    def add_plans(self, plans) -> None:
        """Have `plans` (a `replay_plan.ReplayPlans`) forgotten at every `graphs_changed`."""
        self._plans.add(plans)

    def graphs_changed(self) -> None:
        """A graph was captured or dropped, or a runner replaced: every replay plan, which
        binds graphs and runners, is made anew at its next call (and lets go of dropped
        graphs now, so that their memory returns to the pool)."""
        for plans in list(self._plans):
            plans.clear()

    def release_graphs(self) -> None:
        """Reset every graph begun here, then `clear`. Resetting the graphs themselves, not
        only dropping the runners' references, matters where a graph is kept alive
        elsewhere (a traceback, a user's variable): it would still hold its memory and any
        communicator whose collectives it captured."""
        for graph in list(self._graphs):
            graph.reset()
        self._anchor = None  # nothing else holds it: dropping it releases its use of the pool
        if self._pool_given:  # no anchor keeps it alive now: torch may have released it
            log.info("cgcompile: graphs captured after release_graphs go to a pool of their own, "
                     "not the one you passed")
            self._pool, self._pool_given = None, False
        self.clear()

    def clear(self) -> None:
        """Drop every runner's graphs, then the pool itself, and return its memory."""
        for ref in self._runners:
            runner = ref()
            if runner is not None:
                runner.clear()
        self.live.clear_outputs()
        self._retired.clear()
        self.lazy_capture = True
        self.padding.use(self.padding.configured)
        if not self._pool_given:  # a pool passed in stays alive, anchored, for later captures
            self._pool, self._anchor = None, None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def keep_only(self, sizes) -> None:
        """Pad calls to `sizes` from now on and capture no graph lazily (a capture under a
        memory budget, `cgcompile.tools.memory_plan`); `clear` lifts both."""
        self.padding.use(sizes)
        self.lazy_capture = False

    @contextlib.contextmanager
    def probe(self):
        """This session, capturing into a temporary pool of its own meanwhile: what a
        capture costs is measured there (`cgcompile.tools.memory_plan`). On leaving, every graph
        captured meanwhile is dropped, the temporary pool released, and the session
        captures into its own pool again, with its counts and settings as before.

        The runners keep the session they were built with: a probe changes where it
        captures, not who captures, so nothing is registered again and the replay plans
        are dropped with the graphs as usual. Enter it with no graphs held."""
        saved = (self._pool, self._pool_given, self._anchor, self._retired, self.graphs_captured,
                 self.lazy_capture, self.padding.sizes)
        self._pool, self._pool_given, self._anchor, self._retired, self.graphs_captured = None, False, None, [], 0
        self.lazy_capture = True  # as after `clear`, which a probe needs before it (no graphs held)
        try:
            yield self
        finally:
            self.clear()  # drops the probe's graphs (every runner is registered here) and its pool
            (self._pool, self._pool_given, self._anchor, self._retired, self.graphs_captured,
             self.lazy_capture, sizes) = saved
            self.padding.use(sizes)


@contextlib.contextmanager
def gc_paused():
    """No garbage collection while a graph is being captured.

    A collection can start at any allocation and run the destructors of unrelated objects
    that earlier work left in reference cycles; a destructor that calls into CUDA is not
    allowed while a stream captures. Seen on the GPU machine: lazy breakable captures
    that failed after earlier tests had run (cuBLAS internal error, invalidated capture)
    and pass with collection paused; tests/breakable/test_runner.py fails the same way
    without it. Garbage made during capture is collected after it.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --------------------------------------------------------------------------------------
# The memory pool that every CUDA graph of one owner (a Backend, a manager) shares.
#
# Sharing is safe because of one invariant: graphs that share a pool replay in the order
# they were captured within one step, and a graph's memory is only reused by graphs
# captured after the last reader of that memory was captured (Python refcounts decide it
# during the capturing call). See `capture.CaptureSession`.


class GraphPool:
    """Owns one CUDA graph pool handle; pass it to other graph users to share memory."""

    def __init__(self, device: torch.device | int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
        self.handle = torch.cuda.graph_pool_handle()

    def bytes_reserved(self) -> int:
        """Bytes of device memory the pool holds now (its segments, used or cached)."""
        return sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", ())) == tuple(self.handle)
        )


def as_pool(pool) -> GraphPool | None:
    """Accept a GraphPool, a raw handle from torch.cuda.graph_pool_handle(), or None."""
    if pool is None or isinstance(pool, GraphPool):
        return pool
    wrapped = GraphPool.__new__(GraphPool)
    wrapped.device = torch.device("cuda", torch.cuda.current_device())
    wrapped.handle = tuple(pool)
    return wrapped
