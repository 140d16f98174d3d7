import sys
from pathlib import Path

import pytest
import torch

from edge0 import builtin
from edge0.convert.synth import Shape, synth

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


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    """A random qwen3_moe with int4 resident projections (the default format) and q/k norms
    per head, for the native decode ops' tests."""
    shape = Shape(
        layers=3, hidden=256, heads=4, kv_heads=2, experts=8, top_k=2, expert_width=128, vocab=512
    )
    out = tmp_path_factory.mktemp("int4") / "m"
    return synth(out, shape, tokenizer_dir=builtin.model_dir(), progress=False)
