"""The per-call check that a graph's parameters are where its CUDA graphs read them."""

import logging

import torch

from cgcompile.run.weights import ParameterAddresses


def _watch(drops: list) -> ParameterAddresses:
    return ParameterAddresses("graph0", [1, 2], ["w", "b"], lambda: drops.append(1))


def test_the_same_parameters_replay():
    drops = []
    watch = _watch(drops)
    w, b = torch.zeros(3), torch.zeros(3)
    assert all(watch.allow(("x", w, b)) for _ in range(3))
    assert drops == [] and watch.calls_without_graphs == 0


def test_alternating_instances_never_replay_each_others_graphs(caplog):
    drops = []
    watch = _watch(drops)
    first, second = (torch.zeros(3), torch.zeros(3)), (torch.zeros(3), torch.zeros(3))
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        allowed = [watch.allow(("x", *params)) for params in (first, second, first, second, first)]
    assert allowed == [True, False, True, False, True]
    assert drops == [] and watch.calls_without_graphs == 2
    warnings = [r for r in caplog.records if "runs without CUDA graphs" in r.getMessage()]
    assert len(warnings) == 1 and "'w' is at" in warnings[0].getMessage()


def test_parameters_replaced_for_good_are_captured_again():
    drops = []
    watch = _watch(drops)
    w, b = torch.zeros(3), torch.zeros(3)
    assert watch.allow(("x", w, b))
    new_b = torch.ones(3)  # b replaced by a new tensor
    assert not watch.allow(("x", w, new_b))  # the first call with it: no graphs
    assert watch.allow(("x", w, new_b))  # the second: settled, graphs dropped and captured anew
    assert drops == [1] and watch.recaptures == 1
    assert watch.allow(("x", w, new_b)) and drops == [1]


class _Wrapper(torch.Tensor):
    """A wrapper subclass (as quantized weights are): no storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_tensors_without_storage_are_not_checked():
    from cgcompile.run.weights import has_address

    assert has_address(torch.nn.Parameter(torch.zeros(3)))
    assert not has_address(_Wrapper(torch.zeros(3)))
