"""Replay steps hand results to each other as values: `step(live, results)`, per replay."""

import torch
from torch import nn

import cgcompile
from cgcompile.breakable.record import EagerStep, Recorder, replay_steps
from cgcompile.breakable.segments import OpReplay
from cgcompile.breakable.signature import flatten_call
from cgcompile.testing.models import SILLY_OP


@cgcompile.eager_break
def grow(x):
    """An eager break whose result only the next eager break reads."""
    return torch.cat([x, x])


@cgcompile.eager_break
def fold(x, grown):
    """Reads the previous break's result: a live value of the replay, not the captured one."""
    return x + grown[: x.shape[0]] * 2


class TwoBreaks(nn.Module):
    def forward(self, x):
        y = x * 3
        return fold(y, grow(y)) + 1


def _record(model: nn.Module, x: torch.Tensor):
    leaves, structure = flatten_call((x,), {})
    split_ops = cgcompile.Config(splitting_ops=(SILLY_OP,)).split_ops
    recorder = Recorder("TwoBreaks[size 4]", OpReplay(), split_ops, leaves, structure, model, {0})
    with recorder:
        outputs = model(*leaves)
    return leaves, recorder.finish(outputs)


def test_an_eager_step_reads_an_earlier_steps_result_from_the_replays_results():
    model = TwoBreaks()
    leaves, recording = _record(model, torch.randn(4, 3))
    eager = [s for s in recording.steps if isinstance(s, EagerStep)]
    assert [s.label for s in eager] == ["grow", "fold"]
    grow_at = recording.steps.index(eager[0])
    assert eager[0].keep and not eager[1].keep  # only grow's result is read by a later step
    assert any(step == grow_at for _, step, _ in eager[1].subs)  # fold reads it by grow's position
    assert not hasattr(eager[0], "last")  # no channel kept on the step between calls

    fresh = torch.randn(4, 3)
    leaves[0].copy_(fresh)  # the static input the segments read
    replay_steps(recording.steps, leaves)
    torch.testing.assert_close(recording.outputs, model(fresh))


def test_each_replay_gets_its_own_results():
    model = TwoBreaks()
    leaves, recording = _record(model, torch.randn(4, 3))
    for _ in range(2):
        fresh = torch.randn(4, 3)
        leaves[0].copy_(fresh)
        replay_steps(recording.steps, leaves)
        torch.testing.assert_close(recording.outputs, model(fresh))
