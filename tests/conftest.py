"""Shared test set-up: GPU tests skip without CUDA; every test starts with fresh Dynamo caches;
fixtures a module opts into with `pytestmark = pytest.mark.usefixtures(...)`."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
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
