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
    # scaled RoPE, each type as transformers computes it; the prompt's 32 tokens and 16 more
    # run past the original context (16, or 20) where a type depends on the length
    "rope_yarn": dict(
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        max_position_embeddings=64,
    ),
    "rope_linear": dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    "rope_dynamic": dict(  # serves 2 x 20 positions; scales from the 21st
        rope_scaling=dict(rope_type="dynamic", factor=2.0), max_position_embeddings=20
    ),
    "rope_llama3": dict(
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        max_position_embeddings=128,
    ),
    "rope_longrope": dict(
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            long_factor=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
            original_max_position_embeddings=16,
        ),
        max_position_embeddings=64,
    ),
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
    # the exact option: int8 activations' ~2x rounding can flip a greedy token where
    # transformers' own top-2 margin on a random model is ~0.01 (docs/kernels.md)
    engine = load_engine(tmp_path / "e0", EngineOptions(int4_activations="bf16"))
    prompt = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(2))
    try:
        got = engine.generate(prompt.tolist(), 16, SamplingParams(temperature=0)).drain().tokens
    finally:
        engine.close()
    with torch.no_grad():
        assert got == greedy_hf(hf, prompt, 16)


@pytest.mark.int4
@pytest.mark.parametrize("case", ["qwen3_moe", "rope_yarn", "rope_dynamic", "rope_longrope"])
def test_a_scaled_rope_model_serves_as_transformers_computes_it(tmp_path, case):
    """Converted and served by the engine, a model with a scaled RoPE gives transformers'
    logits on the weights served, teacher-forced along transformers' greedy tokens (40
    positions: past the original 16 and past 32), to the engine's own rounding (the bound
    that holds with default RoPE, the first case). The projections stay bf16 here: with an
    int4 floor, this random model's attention (weights scaled 4x) turns the int4 kernels'
    bf16 activations into logit errors up to 0.08 under YaRN's attention factor, against 0.01
    without it, the same with any RoPE code. Greedy text is not compared: its top-two margins
    go down to 0.004. The module path is compared exactly above."""
    path = make_hf_model(tmp_path / "hf", scale=4.0, **CASES[case])
    convert(path, tmp_path / "e0", progress=False, resident="bf16")
    _, deq = load_edge0_model(tmp_path / "e0", experts="dequantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.load_state_dict(deq.state_dict(), strict=True)
    prompt = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ids = prompt.tolist() + greedy_hf(hf, prompt, 16)  # 40 positions: past 16 and 32
        # a token at a time with transformers' cache, as it generates, on a fresh model (its
        # dynamic RoPE keeps the longest length it has seen): a dynamic RoPE's keys keep the
        # frequencies of the length they were computed at
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        hf.load_state_dict(deq.state_dict(), strict=True)
        out = hf.eval()(prompt[None], use_cache=True)
        want = [out.logits[0, -1]]
        for t in ids[len(prompt) :]:
            out = hf(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            want.append(out.logits[0, -1])
        want = torch.stack(want)
    # keys and values kept in fp32, as transformers' cache keeps them: the bound is the
    # engine's arithmetic, not the default bf16 storage's rounding; the exact option's bf16
    # activations, whose rounding the bound is set for
    opts = EngineOptions(
        io_mode="buffered", max_context=48, kv_dtype=torch.float32, int4_activations="bf16"
    )
    engine = load_engine(tmp_path / "e0", opts)
    try:
        with engine.new_request() as req:
            got = [engine.prefill(req, prompt.tolist())]
            got += [engine.step(req, t) for t in ids[len(prompt) :]]
    finally:
        engine.close()
    diff = (torch.stack(got) - want).abs().max().item()
    print(f"{case}: engine logits max |diff| = {diff:.3f} of {want.abs().max().item():.1f}")
    assert diff <= 0.01 * want.abs().max().item()
