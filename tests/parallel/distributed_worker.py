"""Scenarios of the pipeline API on 2 ranks over gloo, run by tests/parallel/test_distributed.py
through torchrun. Each scenario prints `<name>: ok` on the rank that checks it, or raises."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cgcompile  # noqa: E402
from cgcompile.parallel.distributed import check_same_rows  # noqa: E402
from cgcompile.errors import DistributedError  # noqa: E402
from cgcompile.parallel.pipeline import PipelineStage, TensorSpec  # noqa: E402

HIDDEN = {"hidden": TensorSpec((4,), torch.float32), "residual": TensorSpec((4,), torch.float32)}
TOKENS = {"tokens": TensorSpec((), torch.int64)}


def ring_stage(backend=None, **changes):
    rank = dist.get_rank()
    specs = dict(receives=TOKENS if rank == 0 else HIDDEN, sends=HIDDEN if rank == 0 else TOKENS)
    specs.update(changes)
    return PipelineStage(max_rows=8, device="cpu", backend=backend, **specs)


def buffers_are_persistent_and_received_in_place():
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager"))
    stage = ring_stage(backend)
    stage.connect()
    before = {name: b.data_ptr() for name, b in stage.buffers.items()}
    for rows in (3, 8, 1):
        if dist.get_rank() == 0:
            sent = {n: torch.full((rows, 4), float(rows + i)) for i, n in enumerate(sorted(HIDDEN))}
            got = stage.exchange(sent, rows)
            assert torch.equal(got["tokens"], torch.arange(rows) * rows), got
        else:
            got = stage.exchange({"tokens": torch.arange(rows) * rows}, rows)
            for i, name in enumerate(sorted(HIDDEN)):
                assert torch.equal(got[name], torch.full((rows, 4), float(rows + i))), (name, got[name])
                assert got[name].data_ptr() == stage.buffers[name].data_ptr()  # received in place
                assert backend.session.live.holds(got[name], (8, 4))  # graphs will read it in place
    assert {name: b.data_ptr() for name, b in stage.buffers.items()} == before
    assert all(b.shape[0] == 8 for b in stage.buffers.values())
    return "buffers"


def ring_mismatch_names_the_tensor():
    changes = {"receives": {"hidden": TensorSpec((4,), torch.float32)}} if dist.get_rank() == 1 else {}
    stage = ring_stage(**changes)
    with pytest.raises(DistributedError, match=r"rank \d: stage 0 sends to stage 1: tensor 'residual'"):
        stage.connect()
    return "ring mismatch"


def sender_checks_names_and_shapes():
    stage = ring_stage()
    stage.connect()
    if dist.get_rank() == 0:
        good = {n: torch.zeros(2, 4) for n in HIDDEN}
        cases = [({"hidden": good["hidden"]}, r"rank 0 \(stage 0\) sending to stage 1: .*missing \['residual'\]"),
                 ({**good, "extra": good["hidden"]}, r"unexpected \['extra'\]"),
                 ({**good, "residual": torch.zeros(2, 5)}, r"tensor 'residual': expected shape \(2, 4\)"),
                 ({**good, "residual": torch.zeros(2, 4, dtype=torch.float64)}, r"tensor 'residual'.*float32"),
                 ({**good, "residual": torch.zeros(2, 4, device="meta")}, r"tensor 'residual': expected a tensor on cpu")]
        for outputs, pattern in cases:
            with pytest.raises(DistributedError, match=pattern):
                stage.exchange(outputs, 2)
    return "sender checks"


def receiver_names_a_different_batch():
    stage = ring_stage()
    stage.connect()
    if dist.get_rank() == 0:
        stage.exchange({n: torch.zeros(2, 4) for n in HIDDEN}, None)  # sends 2 rows, is not blocked
    else:
        with pytest.raises(DistributedError, match=r"rank 1 \(stage 1\) receiving from stage 0: expected 3 rows "
                                                   r"\(this rank's call\), got 2 rows from rank 0"):
            stage.exchange(None, 3)
    dist.barrier()
    return "rows mismatch"


def uneven_rows_for_tensor_parallel():
    with pytest.raises(DistributedError, match=r"rank \d: tp: expected every rank to call with \d rows, as this rank does, got rank \d: \d; give every"):
        check_same_rows("tp", 4 + dist.get_rank())
    check_same_rows("tp", 4)
    return "same rows"


def exchange_before_connect_and_wrong_device():
    stage = ring_stage()
    with pytest.raises(DistributedError, match=r"rank \d: PipelineStage.exchange: expected a connected stage"):
        stage.exchange(None, 1)
    with pytest.raises(DistributedError, match=r"rank \d: PipelineStage: expected a process group with a backend for meta"):
        PipelineStage(receives={}, sends={}, max_rows=1, device="meta")
    return "connect first"


SCENARIOS = [buffers_are_persistent_and_received_in_place, ring_mismatch_names_the_tensor,
             sender_checks_names_and_shapes, receiver_names_a_different_batch, uneven_rows_for_tensor_parallel,
             exchange_before_connect_and_wrong_device]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for scenario in SCENARIOS:
        name = scenario()
        print(f"rank {dist.get_rank()}: {name}: ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()
