"""What a full graph checks per call (`passes.full_graph_plan.FullGraphPlan.key`)."""

import torch
from torch.testing._internal.two_tensor import TwoTensor

from cgcompile.passes import FullGraphPlan
from cgcompile.passes.full_graph_plan import address


def _plan() -> FullGraphPlan:
    return FullGraphPlan(by_address=(0,), strides_checked=(), host_values=(), copied=(), names=("w", "x"))


def test_a_plain_input_is_checked_by_its_address():
    plan, w = _plan(), torch.zeros(4)
    assert plan.key((w, None)) == plan.key((w, None))
    moved = torch.zeros(4)
    assert plan.key((moved, None)) != plan.key((w, None))
    assert plan.difference(plan.key((moved, None)), plan.key((w, None))).startswith("the address of input 'w' is 0x")


def test_a_wrapper_subclass_is_checked_by_what_it_wraps():
    """Its own data_ptr is 0 whatever it wraps: the key reads the inner tensors' addresses,
    so a replaced one never replays a graph that writes or reads the old one."""
    plan = _plan()
    a, b = torch.zeros(4), torch.ones(4)
    w = TwoTensor(a, b)
    assert w.data_ptr() == 0 and address(w) == (a.data_ptr(), b.data_ptr())
    assert plan.key((TwoTensor(a, b), None)) == plan.key((w, None))  # a new wrapper of the same tensors
    replaced = TwoTensor(a, torch.ones(4))
    assert plan.key((replaced, None)) != plan.key((w, None))
    said = plan.difference(plan.key((replaced, None)), plan.key((w, None)))
    assert said.startswith("the address of input 'w' is (0x") and ", 0x" in said
