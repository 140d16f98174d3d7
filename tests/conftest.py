import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """`edge0 ... --threads N` run in-process sets torch's global thread count; later tests
    must not inherit it (a different count changes float summation order, and with it any
    result a test calibrated)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _relayout_cache(tmp_path_factory):
    """Repacked copies of models made during the tests go to a temporary cache, not ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()
