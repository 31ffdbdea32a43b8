import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo(request):
    """Each test compiles its own models: start from an empty Dynamo cache so earlier graphs never leak in.
    Tests marked keep_dynamo_state run as a user would, with whatever Dynamo state the process has."""
    if request.node.get_closest_marker("keep_dynamo_state"):
        yield
        return
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
