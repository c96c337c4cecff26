import pytest
import torch


@pytest.fixture(autouse=True)
def inference():
    """Breakable graphs serve inference: a call that needs gradients runs the eager module
    (tests/test_training.py), so these tests run as inference does, under no_grad."""
    with torch.no_grad():
        yield
