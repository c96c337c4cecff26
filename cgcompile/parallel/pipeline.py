"""Pipeline parallelism: each rank runs one stage (a slice of layers), and named tensors
cross from stage to stage through persistent intermediate buffers.

    stage = PipelineStage(receives={"hidden": TensorSpec((4096,), torch.bfloat16)},
                          sends={"tokens": TensorSpec((), torch.int64)},
                          max_rows=64, device="cuda", backend=backend)
    stage.connect()                         # every rank: checks the specs, makes communicators
    inputs = stage.exchange(outputs, rows)  # send to the next stage, receive from the previous

The stages form a ring: stage s sends to stage s+1 and the last stage sends to stage 0
(the sampled tokens of a decode step); a stage with nothing to pass on sends nothing.

Buffers. A stage owns one buffer per name it receives, `[max_rows, *row_shape]`, made
once (on CUDA in the backend's graph pool). A call with n rows receives into the first n
rows, and every capture size's buffer is a leading slice of the same memory, at the same
address: registered with the backend's capture session, the first piece's graph reads the
buffer in place, so a received tensor is never copied. Rows past n keep stale data, which
padding safety makes harmless (padding rows never reach real ones).

Sends read the tensors they are given, in place: with `Config(reuse_output_buffers=True)`
those are the last piece's static outputs. The current stream waits for every send and
receive of an exchange (on NCCL a stream wait, not a host wait), so the next replay can
neither overwrite a buffer still being sent nor read one still being received.

Checks. `connect` exchanges every stage's specs once and raises on every rank, naming
the tensor, when what a stage sends is not what the next receives. Every exchange first
sends a small header on the host (rows, a hash of the names, the sender), over a gloo
group, so a receiver learns of a mismatch before any payload moves and raises naming
the ranks; the sender checks the dict it sends (missing, unexpected or mis-shaped names).

Micro-batches. `exchange` posts its send and receive together (one batched P2P call),
so each stage can compute one micro-batch while its neighbours compute others: with S
stages and S micro-batches in a ring every stage is busy on every tick (see
`examples/pipeline_parallel.py`).

Timeouts: a peer that never reaches its exchange leaves this rank waiting in the header
exchange until the gloo group's timeout (the default group's, `init_process_group(timeout=...)`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import torch
import torch.distributed as dist

from ..compat import allocate_in_pool
from ..errors import ArgumentError, DistributedError, expect
from .distributed import check_backend, prepare_collectives, rank_name, require_group

log = logging.getLogger(__name__)

_MAGIC = 0x6367_7070  # "cgpp": a header that is not one is a protocol mix-up


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor that crosses a stage boundary: `[rows, *row_shape]` of `dtype`."""

    row_shape: tuple[int, ...]
    dtype: torch.dtype

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows, *self.row_shape)


Specs = dict[str, TensorSpec]


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The layers stage `stage` of `num_stages` runs: contiguous, sizes differing by at most one
    (the earlier stages get the extra layers)."""
    expect(0 < num_stages <= num_layers, "stage_layers: num_stages", f"between 1 and {num_layers} layers",
           num_stages, "use at most one stage per layer")
    expect(0 <= stage < num_stages, "stage_layers: stage", f"0..{num_stages - 1}", stage)
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def spec_digest(specs: Specs) -> int:
    """A 62-bit hash of names, row shapes and dtypes, the same on every rank."""
    text = ";".join(f"{name}:{spec.row_shape}:{spec.dtype}" for name, spec in sorted(specs.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


class PipelineStage:
    """This rank's stage: its persistent input buffers and its exchanges with its neighbours.

    receives / sends: the named tensors that arrive from the previous stage and leave for
    the next one ({} for none). max_rows: the largest call (the largest capture size).
    backend: the cgcompile.Backend that compiles this stage's model; its graphs then read
    the buffers in place (optional: without it the graphs copy what they receive).
    """

    def __init__(self, *, receives: Specs, sends: Specs, max_rows: int, device, group=None, backend=None):
        self.group = require_group("PipelineStage", group)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.prev, self.next = (self.rank - 1) % self.world, (self.rank + 1) % self.world
        # P2P ops name peers by global rank: the group's own ranks only match on the default group.
        self._prev_global = dist.get_global_rank(self.group, self.prev)
        self._next_global = dist.get_global_rank(self.group, self.next)
        self.device = torch.device(device)
        self.receives, self.sends = _checked_specs("receives", receives), _checked_specs("sends", sends)
        expect(isinstance(max_rows, int) and max_rows > 0, "PipelineStage: max_rows", "a positive int", max_rows)
        self.max_rows = max_rows
        check_backend("PipelineStage", self.group, self.device)
        self.buffers = self._allocate(backend)
        self._header_group = None

    # -- set-up ------------------------------------------------------------------------------

    def _allocate(self, backend) -> dict[str, torch.Tensor]:
        """One [max_rows, *row_shape] buffer per received name, registered with the backend."""
        def make():
            return {name: torch.zeros(spec.shape(self.max_rows), dtype=spec.dtype, device=self.device)
                    for name, spec in self.receives.items()}

        session = getattr(backend, "session", None)
        self._pool_use = None  # held as long as the buffers: see compat.PoolUse
        if self.device.type == "cuda" and session is not None:
            buffers, self._pool_use = allocate_in_pool(session.pool.handle, make)
        else:
            buffers = make()
        for buffer in buffers.values():
            if session is not None:
                session.live.add_persistent(buffer)
        return buffers

    def connect(self) -> None:
        """Collective over the group: check that each stage sends what the next receives,
        make the header group and the communicators. Call on every rank before the first
        exchange (and before any CUDA graph capture)."""
        prepare_collectives(self.device, self.group)
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, (self.receives, self.sends), group=self.group)
        _check_ring(everyone, self.rank)
        ranks = dist.get_process_group_ranks(self.group)
        # Only this group's ranks call here: with pipelines over sub-groups (tensor parallel
        # inside each stage) the other ranks make their own header groups at the same time.
        self._header_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._exchange_payload(self._zeros(self.sends, 1), 1 if self.receives else None)  # P2P set-up

    # -- every step ------------------------------------------------------------------------

    def input_buffers(self, rows: int) -> dict[str, torch.Tensor]:
        """The persistent buffers narrowed to `rows` (to fill them locally, on stage 0)."""
        self._check_rows(rows)
        return {name: buffer[:rows] for name, buffer in self.buffers.items()}

    def exchange(self, outputs: dict[str, torch.Tensor] | None, rows: int | None) -> dict[str, torch.Tensor] | None:
        """Send `outputs` to the next stage and receive `rows` rows from the previous one.

        outputs None: this stage sends nothing this tick; rows None: it receives nothing.
        Returns the received tensors (views of the persistent buffers) or None.
        """
        expect(self._header_group is not None, f"{rank_name()}: PipelineStage.exchange", "a connected stage",
               "one whose connect() was not called", "call stage.connect() on every rank first",
               DistributedError, raw=True)
        if outputs is not None:
            self._check_outputs(outputs)
        if rows is not None:
            self._check_rows(rows)
        header = self._exchange_headers(outputs, rows)
        try:
            self._check_header(header, rows)
        except DistributedError:
            if header[0] == _MAGIC and header[2] == spec_digest(self.receives) and 0 < header[1] <= self.max_rows:
                self._exchange_payload(outputs, header[1])  # take what the peer sends: it does not hang
            raise
        return self._exchange_payload(outputs, rows)

    # -- checks ----------------------------------------------------------------------------

    def _check_rows(self, rows: int) -> None:
        expect(isinstance(rows, int) and 0 < rows <= self.max_rows, f"{rank_name()}: rows",
               f"an int in 1..{self.max_rows} (max_rows)", rows, error=ArgumentError)

    def _check_outputs(self, outputs: dict) -> None:
        where = f"{rank_name()} (stage {self.rank}) sending to stage {self.next}"
        expect(isinstance(outputs, dict), where, "a dict of tensors by name", outputs)
        missing = sorted(set(self.sends) - set(outputs))
        unexpected = sorted(set(outputs) - set(self.sends))
        expect(not missing and not unexpected, where, f"the tensors {sorted(self.sends)}",
               f"{sorted(outputs)} (missing {missing}, unexpected {unexpected})",
               "send exactly the names given as `sends`", DistributedError, raw=True)
        rows = None
        for name, spec in self.sends.items():
            tensor = outputs[name]
            ok = isinstance(tensor, torch.Tensor) and tensor.dim() >= 1
            rows = rows if rows is not None or not ok else tensor.shape[0]
            ok = ok and tuple(tensor.shape) == spec.shape(rows) and tensor.dtype == spec.dtype
            expect(ok, f"{where}: tensor {name!r}", f"shape {spec.shape(rows or 0)} {spec.dtype} "
                   f"(the rows of the first tensor)", _describe(tensor), error=DistributedError, raw=True)
            expect(tensor.device == self.device, f"{where}: tensor {name!r}", f"a tensor on {self.device}",
                   f"one on {tensor.device}", "move it to the stage's device", DistributedError, raw=True)
        self._check_rows(rows)

    # -- transport ---------------------------------------------------------------------------

    def _exchange_headers(self, outputs, rows) -> list[int] | None:
        """Host-side headers over gloo: [magic, rows, spec digest, sender]; no GPU wait.
        Returns the header received (None when this stage receives nothing)."""
        ops, incoming = [], None
        if outputs is not None:
            rows_out = next(iter(outputs.values())).shape[0]
            header = torch.tensor([_MAGIC, rows_out, spec_digest(self.sends), self.rank], dtype=torch.int64)
            ops.append(dist.P2POp(dist.isend, header, self._next_global, self._header_group))
        if rows is not None:
            incoming = torch.zeros(4, dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, incoming, self._prev_global, self._header_group))
        _wait_all(ops)
        return incoming.tolist() if incoming is not None else None

    def _check_header(self, header: list[int] | None, rows: int | None) -> None:
        if header is None:
            return
        where = f"{rank_name()} (stage {self.rank}) receiving from stage {self.prev}"
        expect(header[0] == _MAGIC, where, "a cgcompile pipeline header", header,
               "every rank must call exchange() in the same order", DistributedError)
        expect(header[2] == spec_digest(self.receives), where, f"the tensors {sorted(self.receives)}",
               "a different set of names, shapes or dtypes", "give the stages matching specs",
               DistributedError, raw=True)
        expect(header[1] == rows, where, f"{rows} rows (this rank's call)", f"{header[1]} rows from rank {header[3]}",
               "every stage must exchange the same micro-batch size in the same order",
               DistributedError, raw=True)

    def _exchange_payload(self, outputs, rows) -> dict[str, torch.Tensor] | None:
        """One batched P2P call; the current stream then waits for all of it."""
        ops, received = [], None
        for name in sorted(self.sends) if outputs is not None else ():
            ops.append(dist.P2POp(dist.isend, outputs[name].contiguous(), self._next_global, self.group))
        if rows is not None:
            received = {name: buffer[:rows] for name, buffer in self.buffers.items()}
            ops += [dist.P2POp(dist.irecv, received[name], self._prev_global, self.group) for name in sorted(received)]
        _wait_all(ops)
        return received

    def _zeros(self, specs: Specs, rows: int) -> dict[str, torch.Tensor] | None:
        if not specs:
            return None
        return {name: torch.zeros(spec.shape(rows), dtype=spec.dtype, device=self.device) for name, spec in specs.items()}


def _wait_all(ops: list) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _checked_specs(culprit: str, specs) -> Specs:
    expect(isinstance(specs, dict), f"PipelineStage: {culprit}", "a dict of name -> TensorSpec", specs,
           "write {'hidden': TensorSpec((4096,), torch.bfloat16)}, or {} for none")
    for name, spec in specs.items():
        expect(isinstance(name, str) and isinstance(spec, TensorSpec), f"PipelineStage: {culprit}[{name!r}]",
               "a TensorSpec under a str name", spec)
    return dict(specs)


def _check_ring(everyone: list, rank: int) -> None:
    """Each stage's `sends` must be the next stage's `receives`; raise naming the tensor."""
    world = len(everyone)
    for stage, (_, sends) in enumerate(everyone):
        nxt = (stage + 1) % world
        receives = everyone[nxt][0]
        where = f"rank {rank}: stage {stage} sends to stage {nxt}"
        for name in sorted(set(sends) | set(receives)):
            got = sends.get(name)
            want = receives.get(name)
            expect(got == want, f"{where}: tensor {name!r}",
                   f"{want} (what stage {nxt} receives)" if want else f"nothing (stage {nxt} does not receive it)",
                   got if got else "nothing (it is not sent)", "give both stages the same spec",
                   DistributedError, raw=True)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {value.dtype}"
    return f"a {type(value).__name__}"


@dataclasses.dataclass(frozen=True)
class Tick:
    """What one stage does on one tick of the ring schedule.

    item: the work item it computes (None: idle this tick); receive: whether it receives
    from the previous stage after computing (that stage computes on this tick)."""

    item: int | None
    receive: bool


def ring_schedule(num_stages: int, stage: int, num_items: int) -> list[Tick]:
    """Stage `stage`'s ticks when `num_items` items flow through `num_stages` stages in a ring.

    Stage s computes item k - s on tick k; item i is micro-batch i % M at step i // M with
    M = num_stages micro-batches, so the first stage's input for item i (the last
    stage's result for item i - M) arrives on the tick before it is needed and every
    stage is busy on every tick once the pipeline is full.
    """
    ticks = []
    for k in range(num_items + num_stages - 1):
        item = k - stage if 0 <= k - stage < num_items else None
        producer = (stage - 1) % num_stages  # it computes item k - producer on this tick
        receive = 0 <= k - producer < num_items
        ticks.append(Tick(item, receive))
    return ticks
