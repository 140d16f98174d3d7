"""How the KV cache stores keys and values (`--kv-dtype`): bf16 by default whatever the compute
dtype, float32, or int8 codes with an fp16 scale per 32 channels.

The int8 codes are the same on every CPU kernel (elementwise IEEE arithmetic; `make test`
repeats these under each), a round trip stays within half a step of its block's scale, the
engine decodes the same bits on the native and the PyTorch paths for each storage, a
conversation reused through the prefix cache gives the same tokens from an int8 cache, and the
plan prices each storage as the cache allocates it.
"""

from __future__ import annotations

import pytest
import torch

from edge0 import builtin
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.plan import plan_for_dir
from edge0.engine.sampling import SamplingParams
from edge0.models.layers import KV_BLOCK, KV_DTYPES, KVCache, KVSpec, dequantize_kv, quantize_kv
from test_native import greedy_logits

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

# channels spanning five decades, so blocks get very different scales
GEN = torch.Generator().manual_seed(7)
X = torch.randn(2, 3, 5, 64, generator=GEN) * torch.logspace(-3, 2, 64)


def test_int8_round_trip_is_within_half_a_step_of_each_blocks_scale():
    codes, scale = quantize_kv(X)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16
    assert scale.shape == (*X.shape[:-1], 64 // KV_BLOCK)
    back = dequantize_kv(codes, scale, torch.float32)
    step = scale.float().repeat_interleave(KV_BLOCK, dim=-1)
    assert ((back - X).abs() <= step / 2 * (1 + 1e-3)).all()
    # the block's largest value maps to +-127 (its scale is rounded to fp16, so within one)
    peak = codes.unflatten(-1, (2, KV_BLOCK)).abs().amax(-1)
    assert (peak >= 126).all()


def test_int8_keeps_zeros_and_a_head_narrower_than_a_block():
    zero = torch.zeros(1, 1, 2, 64)
    codes, scale = quantize_kv(zero)
    assert not codes.any() and not scale.any()
    assert torch.equal(dequantize_kv(codes, scale, torch.float32), zero)
    narrow = X[..., :24]  # 24 channels: one scale for the whole head
    codes, scale = quantize_kv(narrow)
    assert scale.shape[-1] == 1
    assert torch.allclose(dequantize_kv(codes, scale, torch.float32), narrow, atol=0.5, rtol=0.01)


def test_int8_codes_are_the_same_under_every_cpu_kernel():
    """The vectorized codes and scales equal a scalar reference's, bit for bit, under each
    kernel `make test` selects."""
    codes, scale = quantize_kv(X)
    ref_codes, ref_scale = _reference_quantize(X)
    assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)


def _reference_quantize(x):
    """quantize_kv one block at a time in Python floats (round half to even, as torch)."""
    flat = x.reshape(-1, KV_BLOCK).tolist()
    codes, scales = [], []
    for block in flat:
        s = float(torch.tensor(max(abs(v) for v in block) / 127, dtype=torch.float32).half())
        scales.append(s)
        sf = float(torch.tensor(s, dtype=torch.float32))
        codes.append(
            [
                0 if s == 0 else max(-127, min(127, round(float(torch.tensor(v / sf)))))
                for v in block
            ]
        )
    return (
        torch.tensor(codes, dtype=torch.int8).view(x.shape),
        torch.tensor(scales, dtype=torch.float16).view(*x.shape[:-1], -1),
    )


def test_the_cache_hands_keys_back_in_the_dtype_they_were_computed_in():
    spec = [KVSpec(heads=2, k_dim=64, v_dim=64)]
    k, v = X[:1, :2, :5], X[:1, :2, :5] * 2
    for name, kv in KV_DTYPES.items():
        cache = KVCache(spec, 8, torch.float32, kv_dtype=kv)
        ck, cv = cache.update(0, k, v)
        assert ck.dtype == cv.dtype == torch.float32 and ck.shape == k.shape, name
        if name == "float32":
            assert torch.equal(ck, k)
        elif name == "bfloat16":
            assert torch.equal(ck, k.bfloat16().float())
        else:
            assert torch.equal(ck, dequantize_kv(*quantize_kv(k), torch.float32))
        first = ck.clone()
        ck, _ = cache.update(0, k[:, :, :1], v[:, :, :1])  # one more after the first five
        assert ck.shape[2] == 6 and torch.equal(ck[:, :, :5], first), name


def greedy(kv: str, backend: str) -> torch.Tensor:
    return greedy_logits(backend, True, steps=10, kv_dtype=KV_DTYPES[kv])


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_the_engine_decodes_the_same_bits_on_either_path_for_each_storage(kv):
    native = greedy(kv, "native")
    assert torch.equal(native, greedy(kv, "torch"))
    if kv != "float32":  # the storage is what changed the numbers, and only a little
        exact = greedy("float32", "torch")
        assert not torch.equal(native, exact)
        assert torch.equal(native.argmax(-1), exact.argmax(-1))


def test_a_conversation_reused_from_an_int8_cache_gives_the_same_tokens():
    opts = dict(io_mode="buffered", max_context=512, kv_dtype=torch.int8)
    reuse = load_engine(builtin.model_dir(), EngineOptions(prefix_cache=None, **opts))
    fresh = load_engine(builtin.model_dir(), EngineOptions(prefix_cache=0, **opts))
    greedy_params = SamplingParams(temperature=0)
    try:
        outs = []
        for engine in (reuse, fresh):
            context, turns = [], []
            for text in ("def add(a, b):", "\n\ndef sub(a, b):", "\n\ndef mul(a, b):"):
                context += engine.tokenizer.encode(text)
                gen = engine.generate(context, 8, greedy_params).drain()
                turns.append((gen.tokens, gen.stats.prefix_tokens))
                context += gen.tokens
            outs.append(turns)
        assert [t for t, _ in outs[0]] == [t for t, _ in outs[1]]
        assert outs[0][-1][1] > 0 and outs[1][-1][1] == 0  # the last turn was restored
    finally:
        reuse.close()
        fresh.close()


def test_the_plan_prices_each_storage_as_the_cache_allocates_it():
    path = builtin.model_dir()
    states = {}
    for name, kv in KV_DTYPES.items():
        opts = EngineOptions(io_mode="buffered", max_context=1024, kv_dtype=kv, no_prerouter=True)
        plan = plan_for_dir(path, opts)
        engine = load_engine(path, opts)
        try:
            with engine.new_request() as req:
                assert plan.floor.state == req.cache.nbytes(), name
                assert req.cache.kv_dtype == kv and req.cache.k[0].dtype == kv
                assert plan.kv_dtype == name
        finally:
            engine.close()
        states[name] = plan.floor.state
    # the built-in model's state is all keys and values: bf16 half of fp32, int8 a byte a
    # channel plus an fp16 scale per 32 channels
    assert states["bfloat16"] * 2 == states["float32"]
    assert states["int8"] == states["bfloat16"] // 2 * (KV_BLOCK + 2) // KV_BLOCK
