"""The native fused expert op: the engine decodes the same with it, and a machine that cannot
build it is told why and served by the pure-PyTorch path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from edge0 import builtin, native
from edge0.engine import EngineOptions, load_engine
from edge0.streaming.executors import FusedExperts, decode_experts, torch_experts

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel


def greedy_logits(kernel: str, no_prerouter: bool, steps: int = 12) -> torch.Tensor:
    opts = EngineOptions(io_mode="buffered", expert_kernel=kernel, no_prerouter=no_prerouter)
    engine = load_engine(builtin.model_dir(), opts)
    try:
        with engine.new_request() as req:
            logits = [engine.prefill(req, engine.tokenizer.encode("def read_config(path):"))]
            for _ in range(steps):
                logits.append(engine.step(req, int(logits[-1].argmax())))
        return torch.stack(logits)
    finally:
        engine.close()


@pytest.mark.parametrize("no_prerouter", [False, True], ids=["staged", "exact"])
def test_engine_decodes_bit_identically_with_either_kernel(no_prerouter):
    torch.manual_seed(0)
    assert torch.equal(greedy_logits("fused", no_prerouter), greedy_logits("torch", no_prerouter))


NO_COMPILER = """
import logging, sys
from pathlib import Path
from edge0 import native
from edge0.streaming.executors import decode_experts, torch_experts
logging.basicConfig(level=logging.WARNING, format="%(message)s")
cache = Path(sys.argv[1])
try:
    decode_experts("fused", cache)
    sys.exit("fused did not refuse")
except native.NativeUnavailable as e:
    print("REFUSED", e)
assert decode_experts("auto", cache) is torch_experts
assert not native.library_path(cache).exists()  # nothing half-built left to load
print("FELL BACK")
"""


def test_a_machine_without_a_compiler_is_told_and_falls_back(tmp_path):
    # a fresh process: this one may have the op registered already, and then uses it
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    out = subprocess.run(
        [sys.executable, "-c", NO_COMPILER, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED could not compile the fused expert kernel" in out.stdout
    assert "no-such-compiler" in out.stdout  # the reason is the compiler's failure
    assert "FELL BACK" in out.stdout and "pure-PyTorch" in out.stderr


def test_a_cache_folder_that_cannot_be_made_is_refused_not_raised(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(native.NativeUnavailable, match="cannot create"):
        native.build(blocker / "cache")


def test_kernel_choice_is_checked():
    assert decode_experts("torch") is torch_experts
    assert isinstance(decode_experts("auto"), FusedExperts)  # this machine has a compiler
    with pytest.raises(ValueError, match="expert_kernel must be one of auto, fused, torch"):
        decode_experts("fast")


@pytest.mark.slow
def test_the_op_compiles_from_source_into_an_empty_cache(tmp_path):
    """What `make`'s set-up does on a new machine (CI's cache may already hold a build)."""
    path = native.build(tmp_path)
    assert path == native.library_path(tmp_path) and path.stat().st_size > 0
    # loaded in a fresh process (this one has the cached build's op registered already)
    check = (
        "import sys, torch; torch.ops.load_library(sys.argv[1]); "
        "print(torch.ops.edge0.swiglu_int4_experts.default._schema)"
    )
    out = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "swiglu_int4_experts(Tensor x, Tensor[] w13" in out.stdout


def test_the_cli_names_the_reason_when_fused_cannot_be_built(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "edge0", "generate", "--prompt", "def", "--max-tokens", "2"]
        + ["--expert-kernel", "fused"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr
    assert "edge0: error: could not compile the fused expert kernel" in out.stderr
    assert "Traceback" not in out.stderr
