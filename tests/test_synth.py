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
