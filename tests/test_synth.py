"""`edge0 synth`: random-weight models of a given shape, for the decode bench and convert."""

from __future__ import annotations

import collections
import json

from edge0 import builtin
from edge0.bench.ab import replay_tokens
from edge0.cli import main as cli
from edge0.convert.synth import Shape, synth
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions

SHAPE = Shape(
    layers=4,
    hidden=256,
    heads=4,
    kv_heads=2,
    head_dim=64,
    experts=32,
    top_k=8,
    expert_width=128,
    vocab=8192,
)


def routed_experts(model_dir, steps: int) -> dict[int, collections.Counter]:
    """Experts the engine requests per layer while decoding held-out text (read as routed: a
    preloaded pool serves resident experts without a request)."""
    engine = load_engine(model_dir, EngineOptions(top_k=4, no_prerouter=True, preload=False))
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    request = engine.pool.request

    def spy(layer, experts):
        seen[layer].update(experts)
        return request(layer, experts)

    engine.pool.request = spy
    tokens = replay_tokens(model_dir, steps + 1)
    with engine.new_request() as req:
        engine.prefill(req, tokens[:1])
        for t in tokens[1:]:
            engine.step(req, t)
    engine.close()
    return seen


def test_synth_model_is_marked_random_and_routes_like_a_real_one(tmp_path):
    out = synth(tmp_path / "m", SHAPE, tokenizer_dir=builtin.model_dir(), progress=False)
    manifest = json.loads((out / "edge0.json").read_text())
    assert manifest["source"]["random_weights"] is True
    seen = routed_experts(out, 40)
    assert sorted(seen) == list(range(SHAPE.layers))
    # 40 tokens x top-4 per layer: a token-dependent router spreads them over most of the 32
    # experts (the all-0.02 initialisation used 6-14 of 128 per layer on the 30B shape).
    for layer, counts in seen.items():
        assert len(counts) >= 16, (layer, len(counts))


def test_synth_hf_format_converts_and_generates(tmp_path, capsys):
    hf = synth(tmp_path / "hf", SHAPE, fmt="hf", tokenizer_dir=builtin.model_dir(), progress=False)
    assert cli.main(["convert", str(hf), str(tmp_path / "e0")]) == 0
    code = cli.main(
        [
            "generate",
            str(tmp_path / "e0"),
            "--prompt",
            "import os",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "generated 8 tok" in err


# -- full-size tiers ---------------------------------------------------------------------------


def test_the_35b_tier_has_the_released_tensor_shapes():
    """Tensor for tensor against the header fixture built from the audit and the inventory
    (tests/test_inspect.py), the vision tower aside: synth writes what the engine serves."""
    from edge0.convert import expected_resident
    from edge0.convert.tiers import tier_config
    from edge0.modeldir.loader import build, expert_prefixes
    from edge0.models import qwen3_5_moe
    from edge0.models.experts import ExpertSlot
    from test_inspect import tensors_35b_hf

    cfg = qwen3_5_moe.Config.from_dict(tier_config("35b-a3b"))
    ours = expected_resident(qwen3_5_moe, cfg)
    prefixes = set(expert_prefixes(build(qwen3_5_moe, cfg, ExpertSlot)).values())
    e, i, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fixture = [t for t in tensors_35b_hf()[0] if not t[0].startswith("model.visual.")]
    plain = {}
    for name, dtype, shape in fixture:
        assert dtype == "BF16"
        if name.endswith("experts.gate_up_proj"):
            assert name.removesuffix(".gate_up_proj") in prefixes and shape == [e, 2 * i, d]
        elif name.endswith("experts.down_proj"):
            assert name.removesuffix(".down_proj") in prefixes and shape == [e, d, i]
        else:
            plain[name] = tuple(shape)
    assert ours == plain
    assert len(prefixes) == 40 and cfg.layer_types.count("full_attention") == 10


def test_a_4_layer_35b_tier_counts_as_the_fixture_and_serves_with_its_adapters(tmp_path, capsys):
    """Every width of the 35B tier, 4 layers deep (3 Gated DeltaNet, 1 gated attention): its
    parameters count as the audit's header fixture cut to the same layers, its adapters have
    the reference's shapes, and it decodes with heads and LoRA under a budget that makes the
    prerouter route."""
    from safetensors import safe_open

    from edge0.cli.inspect import inspect_dir
    from edge0.engine.sampling import SamplingParams
    from edge0.modeldir import Manifest
    from test_inspect import tensors_35b_mlx, write_checkpoint

    out = tmp_path / "35b-4"
    assert cli.main(["synth", str(out), "--shape", "35b-a3b", "--layers", "4", "--quiet"]) == 0
    assert "RANDOM-WEIGHT qwen3_5_moe" in capsys.readouterr().out
    shards, quant = tensors_35b_mlx()
    keep = [
        t
        for s in shards
        for t in s
        if not t[0].startswith("language_model.model.layers.") or int(t[0].split(".")[3]) < 4
    ]
    config = json.loads((out / "config.json").read_text())
    write_checkpoint(tmp_path / "fixture", [keep], dict(config, quantization=quant))
    ours, theirs = inspect_dir(out, top_k=4), inspect_dir(tmp_path / "fixture", top_k=4)
    assert ours.total.params == theirs.total.params
    assert ours.routed_experts.params == theirs.routed_experts.params
    assert {k: c.params for k, c in ours.resident.items()} == {
        k: c.params for k, c in theirs.resident.items()
    }
    assert ours.active == theirs.active and ours.per_expert == theirs.per_expert
    manifest = Manifest.load(out)
    assert manifest.served_top_k == 4 and manifest.source["random_weights"] is True
    with safe_open(str(out / "prerouter.safetensors"), "pt") as f:
        assert f.metadata()["K"] == "4" and json.loads(f.metadata()["owners"]) == [0, 1, 2]
        assert f.get_slice("layers.0.fc1.weight").get_shape() == [512, 2048 + 2 * 256]
    with safe_open(str(out / "lora.safetensors"), "pt") as f:
        assert f.metadata()["r"] == "16" and f.metadata()["alpha"] == "32"
        assert len(json.loads(f.metadata()["targets"])) == 3 * 8 + 7  # the 35B's 310 / 40 layers
    # a pool of 200 of the 1,024 extents: the heads stage each step's experts
    opts = EngineOptions(expert_cache=200 * 1_769_472, max_context=256)
    engine = load_engine(out, opts)
    try:
        assert engine.plan.prerouter and engine.lora_meta
        gen = engine.generate([5, 6, 7, 8, 9], 6, SamplingParams(temperature=0)).drain()
        assert len(gen.tokens) == 6
        assert engine.prerouter.stats.consumed > 0 and engine.prerouter.stats.dropped == 0
    finally:
        engine.close()


def test_the_30b_tier_counts_as_qwen3_30b_a3b_is_published():
    """Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated (8 of 128 experts; the
    card's 3.3 is 3.35 cut, not rounded, with both embeddings counted whole)."""
    import math

    from edge0.convert import expected_resident
    from edge0.convert.tiers import tier_config
    from edge0.models import qwen3_moe

    cfg = qwen3_moe.Config.from_dict(tier_config("30b-a3b"))
    resident = sum(math.prod(s) for s in expected_resident(qwen3_moe, cfg).values())
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    layers = cfg.num_hidden_layers
    assert round((resident + layers * cfg.num_experts * expert) / 1e9, 1) == 30.5
    assert math.floor((resident + layers * cfg.num_experts_per_tok * expert) / 1e8) == 33
