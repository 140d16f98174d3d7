"""`edge0 bench --profile`: every op lands in one category, and the parts add up to the step."""

from __future__ import annotations

import json

import pytest

from edge0.bench import profile
from edge0.convert import convert
from helpers import make_hf_model


@pytest.mark.parametrize(
    "op, category",
    [
        ("aten::_weight_int4pack_mm_for_cpu", "int4 matmul kernel"),
        ("edge0::swiglu_int4_gemv", "int4 matmul kernel"),  # the native ops' own kernels
        ("edge0::int4_gemv", "int4 matmul kernel"),
        ("aten::addmm", "dense matmul"),
        ("aten::scaled_dot_product_attention", "attention (sdpa)"),
        ("aten::to", "dtype casts, copies"),
        ("aten::t", profile.VIEWS),  # not "aten::to", not "aten::topk"
        ("aten::topk", "routing: softmax, top-k, one-hot"),
        ("aten::softmax", "routing: softmax, top-k, one-hot"),  # the router's, not attention's
        ("edge0::softmax_topk", "routing: softmax, top-k, one-hot"),
        ("edge0::rms_norm", "norms"),  # the native ops' loops are not matmuls
        ("edge0::rotary", "elementwise (silu, mul, add, rotary, weighted sum, ...)"),
        ("edge0::moe_combine", "elementwise (silu, mul, add, rotary, weighted sum, ...)"),
        ("edge0::attention_rows", "the native layer op's own work (checks, conversions)"),
        ("aten::silu", "elementwise (silu, mul, add, rotary, weighted sum, ...)"),
        ("aten::lerp", profile.OTHER_OPS),
    ],
)
def test_ops_are_categorized_by_name(op, category):
    assert profile.categorize(op)[0] == category


def test_the_parts_add_up_to_the_profiled_step(tmp_path):
    make_hf_model(tmp_path / "hf", scale=4.0)
    convert(tmp_path / "hf", tmp_path / "e0", progress=False)
    r = profile.measure(tmp_path / "e0", tokens=4, warmup=1)
    parts = r["categories_ms"]
    assert parts["int4 matmul kernel"] > 0 and r["matmul_ms"] > 0
    # the Python part is the step's wall time not spent in ops (none if ops on other threads
    # added up to more)
    if parts[profile.PYTHON] > 0:
        assert sum(parts.values()) == pytest.approx(r["step_ms"], rel=1e-6)
    else:
        assert sum(parts.values()) >= r["step_ms"]
    assert r["op_calls_per_step"] > 0 and r["unprofiled_step_ms_median"] > 0
    assert "step / matmuls" in profile.report(r)


def test_the_floor_counts_what_a_step_reads(tmp_path):
    make_hf_model(tmp_path / "hf", scale=4.0)
    convert(tmp_path / "hf", tmp_path / "e0", progress=False)
    r = profile.measure(tmp_path / "e0", tokens=4, warmup=1, bandwidth_bytes=64 << 20)
    cfg = json.loads((tmp_path / "e0" / "config.json").read_text())
    manifest = json.loads((tmp_path / "e0" / "edge0.json").read_text())
    parts = r["step_bytes"]
    layers = cfg["num_hidden_layers"]
    # K whole extents a MoE layer (every layer of this model is one)
    assert r["top_k"] == cfg["num_experts_per_tok"]
    assert parts["experts"] == layers * r["top_k"] * manifest["experts"]["extent_bytes"]
    # bf16 keys and values of every position fed so far: the prompt and every step
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_position = layers * 2 * cfg["num_key_value_heads"] * head_dim * 2
    assert parts["keys and values"] == r["context"] * per_position > 0
    # the resident weights less the embedding table's other rows: under the floor's file
    weights = (tmp_path / "e0" / "model.safetensors").stat().st_size
    embedding = cfg["vocab_size"] * cfg["hidden_size"] // 2  # int4 codes at least
    assert 0 < parts["resident weights"] < weights - embedding
    assert r["floor_ms"] == pytest.approx(1e3 * sum(parts.values()) / r["read_bandwidth"])
    assert r["read_bandwidth"] > 1e8
    slowest, fastest = r["read_bandwidth_passes"]
    assert slowest <= r["read_bandwidth"] <= fastest  # the median of the passes
    assert "x the floor" in profile.report(r)


def test_the_profile_pool_holds_every_expert_by_default(tmp_path):
    """`bench --profile` sizes its pool to every expert, not to the serving plan's share of
    free memory (a third of a 30B-class model's experts here), so preloading them works."""
    from edge0.engine.load import load_engine
    from edge0.engine.options import EngineOptions

    make_hf_model(tmp_path / "hf", scale=4.0)
    convert(tmp_path / "hf", tmp_path / "e0", progress=False)
    every = profile.every_expert_bytes(tmp_path / "e0")
    extent = json.loads((tmp_path / "e0" / "edge0.json").read_text())["experts"]["extent_bytes"]
    engine = load_engine(tmp_path / "e0", EngineOptions(expert_cache=every, no_prerouter=True))
    try:
        extents = len(engine.moe_layers) * engine.config.num_experts
        assert every == extents * extent == engine.plan.experts_bytes
        assert engine.plan.holds_every_expert
        engine.preload_experts()
    finally:
        engine.close()
