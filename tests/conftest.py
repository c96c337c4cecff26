"""Shared test set-up: GPU tests skip without CUDA; every test starts with fresh Dynamo caches."""

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
