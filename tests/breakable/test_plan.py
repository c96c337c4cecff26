"""Breakable replay plans (`cgcompile.breakable.plan`), on the CPU with segments="op_replay".

A plan replays a graph without the generic path's flattening and rule; it must do what
the generic path does for the calls it takes, and take no other call. The tests compare
against eager and against the same runner with plans turned off, and check that a call
the plan does not fit (another size, another frozen value, moved weights, a warm-up run)
goes the generic way.
"""

import random

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.capture import Mode
from cgcompile.testing.models import SILLY_OP, ToyLlama

pytestmark = pytest.mark.usefixtures("one_thread")


def manager_for(model, **config):
    fields = dict(splitting_ops=(SILLY_OP,), capture_sizes=(2, 4, 8), use_breakable=True, padding=True) | config
    return cgcompile.GraphManager(model, cgcompile.Config(**fields), boundary=None, segments="op_replay")


def runner_of(manager):
    (runner,) = manager.breakable.runners
    return runner


def no_generic_path(monkeypatch, runner):
    """From now on a call that does not go through a plan fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the call went the generic way")

    monkeypatch.setattr(runner.rule, "decide", refuse)


def warmed_toy(n: int = 4):
    """(model, manager, runner) after observe, capture and one generic replay at n rows."""
    torch.manual_seed(0)
    model = ToyLlama(2, hidden=32, vocab=64)
    manager = manager_for(model)
    for _ in range(3):
        manager.run_pw_graph(model, (torch.randint(0, 64, (n,)),))
    return model, manager, runner_of(manager)


def test_a_graph_that_replayed_gets_a_plan_that_serves_the_next_calls(monkeypatch):
    model, manager, runner = warmed_toy()
    assert list(runner.plans.by_size) == [4] and runner.plans.current is runner.plans.by_size[4]
    no_generic_path(monkeypatch, runner)
    for _ in range(3):
        ids = torch.randint(0, 64, (4,))
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))


def test_calls_the_plan_does_not_fit_go_the_generic_way_and_back():
    model, manager, runner = warmed_toy()
    decided = []
    decide = runner.rule.decide
    runner.rule.decide = lambda *a: decided.append(a[0]) or decide(*a)
    for n in (3, 4, 5, 4, 4):  # padded into 4: not the plan's; size 8; 4 again: the plan of size 4
        ids = torch.randint(0, 64, (n,))
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))
    assert decided == [4, 8]  # n=3 (padded) and n=5 went the generic way; each n=4 the plan's


@pytest.mark.parametrize("seed", range(4))
def test_plans_replay_what_the_generic_path_replays(seed):
    """Two runners of the same weights, one without plans, over one random walk of sizes."""
    torch.manual_seed(seed)
    model = ToyLlama(2, hidden=32, vocab=64)
    with_plans, without = manager_for(model), manager_for(model)
    without.breakable.runners[0]._use_plan = lambda size, entry: None
    walk = random.Random(seed)
    for _ in range(24):
        ids = torch.randint(0, 64, (walk.choice((1, 2, 3, 4, 6, 8)),))
        expected = model(ids)
        got = with_plans.run_pw_graph(model, (ids,))
        assert torch.equal(got, without.run_pw_graph(model, (ids,)))
        torch.testing.assert_close(got, expected)
    assert with_plans.breakable.runners[0].plans.by_size  # the walk did go through plans


class Scaled(nn.Module):
    """A frozen Python value (`double`) that selects the computation."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, double: bool):
        h = torch.ops.cgcompile_testing.silly_attention(self.a(x), x, x)
        return h * 2 if double else h


def test_another_frozen_value_is_a_miss_and_only_the_first_graph_of_a_size_gets_a_plan():
    torch.manual_seed(0)
    model = Scaled()
    manager = manager_for(model)
    runner = runner_of(manager)
    for double in (True, True, True, False, False, False, True, False):
        x = torch.randn(4, 8)
        torch.testing.assert_close(manager.run_pw_graph(model, {"x": x, "double": double}), model(x, double))
    assert runner.graph_count() == 2
    (plan,) = runner.plans.by_size.values()
    assert runner.rule.graphs(4)[0].signature.values[0][1] is True  # the plan is the first graph's


def test_moved_weights_run_eagerly_then_capture_again_and_drop_the_plans():
    model, manager, runner = warmed_toy()
    old_plan = runner.plans.current
    with torch.no_grad():
        model.layers[0].up.weight = nn.Parameter(model.layers[0].up.weight * 0.5)
    graphs_before = runner.graph_count()
    for call in range(4):  # eager (moved), settled: graphs dropped, observe, capture...
        ids = torch.randint(0, 64, (4,))
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))
        if call == 0:
            assert runner.graph_count() == graphs_before  # the first call with new weights only runs eagerly
    assert runner.plans.current is not old_plan


def test_a_warm_up_run_is_a_miss():
    model, manager, runner = warmed_toy()
    ids = torch.randint(0, 64, (4,))
    with manager.session.mode_as(Mode.WARMUP):
        torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))


def test_graphs_changed_in_the_session_drops_every_plan():
    model, manager, runner = warmed_toy()
    manager.session.graphs_changed()
    assert runner.plans.current is None and not runner.plans.by_size
    ids = torch.randint(0, 64, (4,))
    torch.testing.assert_close(manager.run_pw_graph(model, (ids,)), model(ids))  # generic, then a plan again
    assert runner.plans.current is not None


def test_a_plan_s_source_reads_as_the_steps_it_replays():
    _, _, runner = warmed_toy()
    source = runner.plans.current.source
    assert source.startswith("def plan(args, kwargs):")
    assert source.count("launch") == 3 and source.count("eager") == 2  # two attentions between three segments
