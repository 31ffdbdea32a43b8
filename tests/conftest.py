import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: start from an empty Dynamo cache so earlier graphs never leak in."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
