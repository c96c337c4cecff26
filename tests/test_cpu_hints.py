"""What cgcompile tells a newcomer on CPU: Inductor pieces there warm up slowly and replay no graphs."""

import logging

import torch

import cgcompile
from cgcompile.build import phases


def _double(x):
    return torch.relu(x) * 2


def test_inductor_on_cpu_hints_at_the_eager_compiler_once(caplog):
    phases._hint_eager_on_cpu.cache_clear()
    with caplog.at_level(logging.WARNING, logger="cgcompile.build.phases"):
        for size in (3, 5):  # two Dynamo graphs: one hint
            torch._dynamo.reset()
            torch.compile(_double, backend=cgcompile.Backend())(torch.ones(size))
    hints = [r.getMessage() for r in caplog.records if "warms up" in r.getMessage()]
    assert hints == ["cgcompile: a graph on CPU with Inductor pieces (the default, compiler='inductor'). CPU has no "
                     "CUDA graphs, and compiler='eager' warms up several times faster there: pass "
                     "options={'compiler': 'eager'} to torch.compile, or cgcompile.Config(compiler='eager')"]


def test_the_eager_compiler_on_cpu_gives_no_hint(caplog):
    phases._hint_eager_on_cpu.cache_clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="cgcompile.build.phases"):
        torch.compile(_double, backend=cgcompile.Backend(cgcompile.Config(compiler="eager")))(torch.ones(3))
    assert not [r for r in caplog.records if "warms up" in r.getMessage()]
