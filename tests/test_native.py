"""The native fused expert op: the engine decodes the same with it, and a machine that cannot
build it is told why and served by the pure-PyTorch path."""

from __future__ import annotations

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


def test_a_machine_without_a_compiler_is_told_and_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(native.NativeUnavailable, match="could not compile"):
        native.build(tmp_path)
    with pytest.raises(native.NativeUnavailable):
        decode_experts("fused", tmp_path)
    assert decode_experts("auto", tmp_path) is torch_experts
    assert "pure-PyTorch" in caplog.text
    assert not native.library_path(tmp_path).exists()  # nothing half-built left to load


def test_kernel_choice_is_checked():
    assert decode_experts("torch") is torch_experts
    assert isinstance(decode_experts("auto"), FusedExperts)  # this machine has a compiler
    with pytest.raises(ValueError, match="expert_kernel must be one of auto, fused, torch"):
        decode_experts("fast")
