"""Shared test set-up: GPU tests skip without CUDA, slow ones without --run-slow; every test starts with fresh Dynamo caches;
fixtures a module opts into with `pytestmark = pytest.mark.usefixtures(...)`."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    if not config.getoption("--run-slow"):
        skips["slow"] = pytest.mark.skip(reason="a heavy case another CI test covers; pass --run-slow")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Forget compiled frames, so that a test's graph counts do not depend on test order."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """Tiny models: intra-op threads only add contention (SDPA took 16 ms a call with 2 threads, 9 us with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def exact_fp32_matmuls():
    """No TF32 for the test (`cgcompile.testing.numerics.exact_fp32_matmuls`)."""
    from cgcompile.testing import numerics  # on use: the conftest itself loads only torch and pytest

    with numerics.exact_fp32_matmuls():
        yield


@pytest.fixture
def bench_main(monkeypatch):
    """`bench_main("decode_bench", argv)` runs benchmarks/decode_bench.py's `main(argv)` in this
    process, as `python benchmarks/decode_bench.py ...` would, and returns what it returns (the
    script's exit status). A subprocess would spend most of its time importing torch again. The
    torch settings a benchmark sets for its run (threads, Dynamo's recompile limit, TF32) are
    put back afterwards."""
    import importlib
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "benchmarks"))
    threads, recompile_limit = torch.get_num_threads(), torch._dynamo.config.recompile_limit
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield lambda name, argv: importlib.import_module(name).main(list(argv))
    torch.set_num_threads(threads)
    torch._dynamo.config.recompile_limit = recompile_limit
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
