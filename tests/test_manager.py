"""Boundary resolution, the manager's path choice, and bad input: all on CPU."""

import logging

import pytest
import torch
from torch import nn

import cgcompile
from cgcompile.breakable.boundary import resolve_boundary
from cgcompile.testing.models import SILLY_OP, ToyLlama


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])


class CausalLM(nn.Module):  # model.model.layers, like LlamaForCausalLM
    def __init__(self):
        super().__init__()
        self.model = Stack()
        self.lm_head = nn.Linear(4, 8)


class VisionLanguage(nn.Module):  # model.language_model.layers
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.language_model = Stack()
        self.model.vision = nn.Linear(4, 4)


class GPT2Like(nn.Module):  # transformer.h
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList([nn.Linear(4, 4)])


def test_auto_boundary_finds_the_stack_in_common_layouts():
    lm, vl, gpt = CausalLM(), VisionLanguage(), GPT2Like()
    assert resolve_boundary(lm, "auto") is lm.model
    assert resolve_boundary(vl, "auto") is vl.model.language_model
    assert resolve_boundary(gpt, "auto") is gpt.transformer
    toy = ToyLlama(1)
    assert resolve_boundary(toy, "auto") is toy


def test_auto_boundary_without_a_stack_warns_once_and_names_the_fix(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        assert resolve_boundary(model, "auto") is model
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Sequential" in warnings[0].getMessage() and "boundary=" in warnings[0].getMessage()


def test_explicit_boundaries():
    lm = CausalLM()
    assert resolve_boundary(lm, "model") is lm.model
    assert resolve_boundary(lm, lm.model) is lm.model
    assert resolve_boundary(lm, None) is lm


def test_unknown_boundary_path_is_an_error_listing_children():
    with pytest.raises(cgcompile.ConfigError, match=r"got 'decoder', which names none; its children are \['model', 'lm_head'\]"):
        resolve_boundary(CausalLM(), "decoder")


def test_foreign_boundary_module_is_an_error():
    with pytest.raises(cgcompile.ConfigError, match="not part of it"):
        resolve_boundary(CausalLM(), nn.Linear(2, 2))


def test_manager_choice_comes_from_config_and_environment(monkeypatch, caplog):
    model = ToyLlama(1)
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    assert not cgcompile.GraphManager(model).use_breakable
    assert cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True)).use_breakable
    monkeypatch.setenv("CGCOMPILE_USE_BREAKABLE", "1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        manager = cgcompile.GraphManager(model)
    assert manager.use_breakable
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    monkeypatch.setenv("CGCOMPILE_USE_BREAKABLE", "yes")
    with pytest.raises(cgcompile.ConfigError, match="expected 0 or 1"):
        cgcompile.GraphManager(model)


def test_breakable_manager_on_cpu_warns_that_it_records_nothing(monkeypatch, caplog):
    monkeypatch.delenv("CGCOMPILE_USE_BREAKABLE", raising=False)
    model = ToyLlama(1)
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        manager = cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True))
        manager.run_pw_graph(model, (torch.randint(0, 64, (3,)),))
        manager.run_pw_graph(model, (torch.randint(0, 64, (3,)),))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no parameter on CUDA" in warnings[0] and 'segments="op_replay"' in warnings[0]
    assert "0 graphs" in manager.breakable.describe()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cgcompile"):  # off by the user's choice, or op_replay: no warning
        cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True, cudagraphs=False))
        cgcompile.GraphManager(model, cgcompile.Config(use_breakable=True), segments="op_replay")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]


def test_manager_without_graphs_runs_the_model_eagerly():
    model = ToyLlama(2)
    manager = cgcompile.GraphManager(model, cgcompile.Config(splitting_ops=(SILLY_OP,)))
    assert not manager.graphs_enabled
    ids = torch.randint(0, 64, (5,))
    assert torch.equal(manager.run_pw_graph(model, (ids,)), model(ids))
    with pytest.raises(cgcompile.CaptureError, match="GraphManager.capture: expected a CUDA device|expected CUDA graphs on"):
        manager.capture(lambda size, warmup: (torch.zeros(size, dtype=torch.long),))


def test_run_pw_graph_rejects_another_model():
    manager = cgcompile.GraphManager(ToyLlama(1))
    with pytest.raises(cgcompile.CGCompileError, match="one GraphManager per model"):
        manager.run_pw_graph(ToyLlama(1), (torch.zeros(2, dtype=torch.long),))


def test_capture_rejects_sizes_above_the_largest():
    manager = cgcompile.GraphManager(ToyLlama(1), cgcompile.Config(capture_sizes=(2, 4)))
    with pytest.raises(cgcompile.ArgumentError, match=r"sizes: expected sizes up to the largest capture size 4, got \[8\]"):
        manager.capture(lambda size, warmup: (torch.zeros(size, dtype=torch.long),), sizes=(8,))


def test_eager_break_is_transparent_outside_capture():
    calls = []

    @cgcompile.eager_break
    def double(x):
        calls.append(x.shape)
        return x * 2

    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == [torch.Size([3])]
    assert double.__name__ == "double"
