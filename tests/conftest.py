import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernel tests run on CPU under Triton's interpreter; triton reads this when it is first imported,
    # which other tests (through torch) may do before tests/test_kernels.py is collected
    os.environ.setdefault("TRITON_INTERPRET", "1")

# calibration statistics go to a folder of this test process (inherited by the commands tests run), never to the
# user's cache: a test sees what this run collected, and tests of the cache point it elsewhere
_stats = tempfile.mkdtemp(prefix="lrkv-test-stats-")
atexit.register(shutil.rmtree, _stats, ignore_errors=True)
os.environ["LRKV_STATS_CACHE"] = _stats

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `-n auto`: the cores are shared out among the workers
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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
