"""Our model implementations against transformers on tiny random configs, fp32."""

from __future__ import annotations

import pytest
import torch
import transformers

from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.modeldir.loader import load_edge0_model, load_hf_model
from helpers import greedy_hf, greedy_ours, make_hf_model

CASES = {
    "qwen3_moe": dict(family="qwen3_moe"),
    "qwen3_moe_nonorm_dense": dict(family="qwen3_moe", norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe_sparse_step": dict(family="qwen3_moe", decoder_sparse_step=2),
    "qwen2_moe": dict(family="qwen2_moe"),
    "qwen2_moe_nobias_norm": dict(family="qwen2_moe", qkv_bias=False, norm_topk_prob=True),
}


@pytest.mark.parametrize("case", CASES)
def test_fp32_parity_with_transformers(tmp_path, case):
    kw = dict(CASES[case])
    path = make_hf_model(tmp_path / "hf", scale=4.0, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_hf_model(path)
    prompt = torch.randint(0, 384, (32,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(prompt[None]).logits
        got = ours(prompt[None])
        diff = (ref - got).abs().max().item()
        print(f"{case}: logits max |diff| = {diff:.2e}")
        assert diff <= 1e-4
        assert greedy_ours(ours, prompt, 16) == greedy_hf(hf, prompt, 16)


@pytest.mark.int4
@pytest.mark.parametrize("resident", ["int4", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_int4_engine_matches_transformers_on_dequantized_weights(tmp_path, family, resident):
    path = make_hf_model(tmp_path / "hf", family=family, scale=4.0)
    convert(path, tmp_path / "e0", progress=False, resident=resident)
    # transformers runs exactly the weights we serve: bf16 resident + dequantized int4 experts
    _, deq = load_edge0_model(tmp_path / "e0", experts="dequantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.load_state_dict(deq.state_dict(), strict=True)
    engine = load_engine(tmp_path / "e0", EngineOptions())
    prompt = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(2))
    try:
        got = engine.generate(prompt.tolist(), 16, SamplingParams(temperature=0)).drain().tokens
    finally:
        engine.close()
    with torch.no_grad():
        assert got == greedy_hf(hf, prompt, 16)
