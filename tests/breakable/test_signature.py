"""The signature rule of breakable graphs, as pure logic: which call replays, is captured,
observed or run eagerly (cgcompile/breakable_signature.py). No recording, no graphs."""

import logging

import pytest
import torch

from cgcompile.breakable.signature import (
    MAX_GRAPHS_PER_SIZE,
    Action,
    Signature,
    SignatureRule,
    StaticTensor,
    flatten_call,
    leaf_names,
    unflatten_call,
)
from cgcompile.run.capture import Mode


class Cache:  # stands in for a live object (a transformers cache)
    pass


def test_flatten_walks_plain_containers_only_and_round_trips():
    cache, x = Cache(), torch.zeros(2)
    args, kwargs = (x, [1, (2, x)]), {"mask": None, "emb": (x, x), "opts": {"a": 3}, "cache": cache}
    leaves, structure = flatten_call(args, kwargs)
    expected = [x, 1, 2, x, None, x, x, 3, cache]
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    assert unflatten_call(leaves, structure) == (args, kwargs)
    assert leaf_names(structure) == ["args[0]", "args[1][0]", "args[1][1][0]", "args[1][1][1]", "mask", "emb[0]",
                                     "emb[1]", "opts['a']", "cache"]
    assert flatten_call((x,), {"mask": x})[1] != flatten_call((x,), {"other": x})[1]
    assert flatten_call((x,), {})[1] == flatten_call((torch.ones(5),), {})[1]  # the structure holds no shapes


def decode_signature(hidden=(2, 1, 8)):
    """A decoder layer's decode call: hidden states read by captured ops, a mask only
    attention reads (live), a cache object (live) and a frozen flag."""
    structure = flatten_call((torch.zeros(hidden),), {"mask": torch.zeros(2, 5), "cache": Cache(), "flag": True})[1]
    return Signature(structure, (StaticTensor(0, hidden, torch.float32, True),), ((1, torch.float32, 2),),
                     ((2, Cache),), ((3, True),))


def call(hidden=(2, 1, 8), mask_len=5, flag=True, cache=None, dtype=torch.float32):
    leaves, structure = flatten_call((torch.zeros(hidden, dtype=dtype),),
                                     {"mask": torch.zeros(2, mask_len), "cache": cache or Cache(), "flag": flag})
    return leaves, structure, hidden[0]


def test_a_signature_fixes_what_captured_ops_read_and_frees_what_only_eager_steps_read():
    signature = decode_signature()
    for mask_len in (5, 6, 100):  # the mask grows with the cache: same signature
        assert signature.fits(*call(mask_len=mask_len))
    assert signature.fits(*call(cache=Cache()))  # a new cache object: live, passed to the eager steps
    assert not signature.fits(*call(hidden=(2, 7, 8)))  # a prefill: another shape for captured ops
    assert not signature.fits(*call(dtype=torch.float16))
    assert not signature.fits(*call(flag=False))  # a frozen Python value changed
    leaves, structure, n = call()
    leaves[1] = None  # the mask became None: not a tensor any more
    assert not signature.fits(leaves, structure, n)


def test_padded_rows_fit_when_they_follow_the_call():
    structure = flatten_call((torch.zeros(4, 8), torch.zeros(3, 3)), {})[1]
    signature = Signature(structure, (StaticTensor(0, (4, 8), torch.float32, True),
                                      StaticTensor(1, (3, 3), torch.float32, False)), (), (), ())
    for n in (3, 4):  # both pad to size 4
        assert signature.fits([torch.zeros(n, 8), torch.zeros(3, 3)], structure, n)
    assert not signature.fits([torch.zeros(3, 8), torch.zeros(4, 3)], structure, 3)  # a fixed shape changed


def test_prefill_runs_eagerly_and_decode_is_captured_on_its_second_call():
    rule, prefill, decode = SignatureRule("layer"), decode_signature((2, 7, 8)), decode_signature()

    def step(signature_call, learned=None):
        decision = rule.decide(2, *signature_call, Mode.LAZY)
        if decision.action is Action.OBSERVE:
            rule.observed(2, learned)
        elif decision.action is Action.CAPTURE:
            rule.captured(2, learned, "graph")
        return decision.action

    first_generate = [step(call((2, 7, 8)), prefill), step(call(mask_len=8), decode), step(call(mask_len=9), decode),
                      step(call(mask_len=10))]
    assert first_generate == [Action.OBSERVE, Action.OBSERVE, Action.CAPTURE, Action.REPLAY]
    second_generate = [step(call((2, 7, 8))), step(call(mask_len=8)), step(call(mask_len=9))]
    assert second_generate == [Action.EAGER, Action.REPLAY, Action.REPLAY]  # the prefill never follows itself
    assert rule.graph_count() == 1


def test_each_size_keeps_its_own_history():
    rule, signature = SignatureRule("layer"), decode_signature()
    rule.observed(2, signature)
    leaves, structure, n = call()
    assert rule.decide(2, leaves, structure, n, Mode.LAZY).action is Action.CAPTURE  # the previous call of size 2
    assert rule.decide(4, leaves, structure, n, Mode.LAZY).action is Action.OBSERVE  # nothing known at size 4


def test_graphs_per_size_are_bounded_and_the_limit_is_logged_once(caplog):
    rule = SignatureRule("layer")
    for k in range(MAX_GRAPHS_PER_SIZE):
        rule.captured(2, decode_signature((2, k + 1, 8)), f"graph {k}")
    extra = decode_signature((2, 99, 8))
    rule.observed(2, extra)
    with caplog.at_level(logging.WARNING, logger="cgcompile"):
        for _ in range(3):
            assert rule.decide(2, *call((2, 99, 8)), Mode.LAZY).action is Action.EAGER
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "MAX_GRAPHS_PER_SIZE" in warning.getMessage() and "run eagerly" in warning.getMessage()


def test_an_uncapturable_signature_runs_eagerly_and_says_why_once(caplog):
    rule = SignatureRule("layer")
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        rule.observed(2, decode_signature())
        rule.uncapturable(2, Signature(*dataclass_fields(decode_signature()), uncapturable="host code read X"))
        actions = [rule.decide(2, *call(), Mode.LAZY).action for _ in range(3)]
    assert actions == [Action.EAGER] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "host code read X" in warnings[0]


def dataclass_fields(signature: Signature) -> tuple:
    return signature.structure, signature.static, signature.live_tensors, signature.live_objects, signature.values


def test_ahead_of_time_modes_override_the_rule():
    rule, signature = SignatureRule("layer"), decode_signature()
    leaves, structure, n = call()
    assert rule.decide(2, leaves, structure, n, Mode.WARMUP).action is Action.OBSERVE
    assert rule.decide(2, leaves, structure, n, Mode.CAPTURE).action is Action.CAPTURE  # without observing first
    rule.captured(2, signature, "graph")
    assert rule.decide(2, leaves, structure, n, Mode.CAPTURE).action is Action.REPLAY  # already captured
    assert rule.decide(2, leaves, structure, n, Mode.WARMUP).action is Action.EAGER


def test_a_new_signature_is_logged_once_for_all_runners_of_a_group(caplog):
    logged: set = set()
    layers = [SignatureRule("Layer x3", logged) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="cgcompile"):
        for rule in layers:
            rule.observed(2, decode_signature())
            rule.observed(2, decode_signature())  # seen again: not a new signature
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("cgcompile: Layer x3: new call signature at size 2 [args[0] (2, 1, 8) float32;")
    assert "live: mask, cache" in messages[0]


@pytest.mark.parametrize("value, other, same", [(1, 1, True), (1, 2, False), (None, None, True),
                                                (torch.float16, torch.float16, True)])
def test_frozen_values_compare_by_identity_then_plain_equality(value, other, same):
    structure = flatten_call((value,), {})[1]
    signature = Signature(structure, (), (), (), ((0, value),))
    assert signature.fits([other], structure, 0) is same
