"""Config.compile_sizes under CUDA graphs: graphs of a listed size replay the specialised code."""

import pytest
import torch

from cgcompile.compiler import SizeSpecialised

from cuda_helpers import compiled_toy_llama, dynamic_ids

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = (2, 4, 8, 16)


def _compiled(compiler: str, **fields):
    return compiled_toy_llama(compiler, SIZES, **fields)


def _specialised(backend) -> list[SizeSpecialised]:
    return [r.fn for rt in backend.runtimes for r in rt.runners if isinstance(r.fn, SizeSpecialised)]


class _Counting:
    """Wraps a compiled function and counts its calls (replays do not call it)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_graphs_of_a_compile_size_capture_the_specialised_code(compiler):
    torch.backends.cuda.matmul.allow_tf32 = False
    model, backend, compiled = _compiled(compiler, compile_sizes=(4,))
    for n in (3, 3, 4, 7, 7, 3):  # size 4: specialised; size 8: general; each captured once
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert backend.stats.specialised_compilations == 3  # three distinct pieces of four
    assert backend.stats.graphs_captured == 2 * 4
    for fn in _specialised(backend):
        assert set(fn.specialised) == {4}


def test_replays_do_not_call_the_specialised_code_again():
    model, backend, compiled = _compiled("inductor", compile_sizes=(4,))
    ids = dynamic_ids(3)
    compiled(ids)  # warm-up, specialised compile, capture, first replay
    counters = []
    for fn in _specialised(backend):
        fn.specialised[4] = _Counting(fn.specialised[4])
        counters.append(fn.specialised[4])
    for _ in range(3):
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert [c.calls for c in counters] == [0] * len(counters)


def test_ahead_of_time_capture_compiles_in_the_warm_up():
    model, backend, compiled = _compiled("inductor", compile_sizes=(2, 16))
    backend.capture(compiled, lambda size, warmup: (dynamic_ids(size),), progress=False)
    assert backend.stats.specialised_compilations == 6
    assert backend.stats.graphs_captured == 4 * len(SIZES)
    for n in (3, 2, 9, 16):
        ids = dynamic_ids(n)
        torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-3, atol=2e-3)
    assert backend.stats.specialised_compilations == 6
