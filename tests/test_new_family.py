"""A family with Qwen3-MoE's architecture under other tensor names takes a config and a
`sanitize` (the example in docs/families.md), and then converts and serves like Qwen3-MoE."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

from safetensors.torch import load_file, save_file

from edge0 import models
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.sampling import SamplingParams
from edge0.models import qwen3_moe
from helpers import make_hf_model


@dataclass
class Config(qwen3_moe.Config):
    model_type: str = "renamed_moe"


NAMES = [  # (the checkpoint's fragment, the model's), applied in this order
    ("transformer.h.", "model.layers."),
    (".attn.", ".self_attn."),
    (".moe.router.", ".mlp.gate."),
    (".moe.experts.", ".mlp.experts."),
    (".ln1.", ".input_layernorm."),
    (".ln2.", ".post_attention_layernorm."),
    ("transformer.", "model."),
]


def sanitize(cfg: Config, key: str) -> str | None:
    for theirs, ours in NAMES:
        key = key.replace(theirs, ours)
    return key


FAMILY = SimpleNamespace(Config=Config, Model=qwen3_moe.Model, sanitize=sanitize)


def renamed_checkpoint(hf, out):
    """`hf` saved under the new family's names (the inverse of sanitize)."""
    out.mkdir()
    for f in hf.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for key, t in load_file(str(hf / "model.safetensors")).items():
        name = key
        for theirs, ours in NAMES:
            name = name.replace(ours, theirs)
        assert sanitize(None, name) == key
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, model_type="renamed_moe")))


def test_a_renamed_checkpoint_converts_and_serves(tmp_path, monkeypatch):
    hf = make_hf_model(tmp_path / "hf", scale=4.0)
    renamed_checkpoint(hf, tmp_path / "renamed")
    monkeypatch.setitem(models.FAMILIES, "renamed_moe", FAMILY)
    convert(tmp_path / "renamed", tmp_path / "e0-renamed", progress=False)
    convert(hf, tmp_path / "e0", progress=False)
    out = []
    for path in (tmp_path / "e0-renamed", tmp_path / "e0"):
        engine = load_engine(path)
        try:
            greedy = SamplingParams(temperature=0)
            out.append(engine.generate(list(range(5, 25)), 12, greedy).drain().tokens)
        finally:
            engine.close()
    assert out[0] == out[1] and len(out[0]) == 12
