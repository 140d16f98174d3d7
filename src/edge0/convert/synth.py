"""`edge0 synth OUT_DIR`: a random-weight Qwen3-MoE of any shape, for benchmarks and tests.

`--format edge0` writes the edge0 directory directly (random int4 extents, no float
detour), so a realistically shaped model larger than memory costs only disk time.
`--format hf` writes a Hugging Face checkpoint (bf16, per-expert keys, sharded with an
index) for exercising `edge0 convert` at scale. The weights are random: such a model
measures speed and memory, never quality, and edge0.json says so (`"random_weights": true`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from edge0 import modeldir
from edge0.formats import int4_layout
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import INT4
from edge0.formats.writer import StreamingSafetensors
from edge0.modeldir.loader import build
from edge0.models import int4, qwen3_moe
from edge0.models.experts import ExpertSlot
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import LAYOUT_KEY, ExtentsWriter

STD = 0.02  # HF initializer_range
# With every weight at STD, random layers push all tokens' hidden states towards one shared
# direction and routing collapses: 6-14 of 128 experts per layer over 40 tokens of text. A
# trained model routes each token on its own. An embedding that dominates the residual stream
# keeps the routing token-dependent, so a decode bench reads what a real model would read.
EMBED_STD = 1.0


@dataclass
class Shape:
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 64
    top_k: int = 8
    expert_width: int = 512
    vocab: int = 8192

    def config(self) -> dict:
        return qwen3_moe.hf_config(
            vocab=self.vocab,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            experts=self.experts,
            top_k=self.top_k,
            expert_width=self.expert_width,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        )


def _resident_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    h, g, e, v = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["num_experts"],
        cfg["vocab_size"],
    )
    specs = [("model.embed_tokens.weight", (v, d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [
            (f"{p}.input_layernorm.weight", (d,)),
            (f"{p}.post_attention_layernorm.weight", (d,)),
            (f"{p}.self_attn.q_proj.weight", (h * hd, d)),
            (f"{p}.self_attn.k_proj.weight", (g * hd, d)),
            (f"{p}.self_attn.v_proj.weight", (g * hd, d)),
            (f"{p}.self_attn.o_proj.weight", (d, h * hd)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.mlp.gate.weight", (e, d)),
        ]
    specs += [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]
    return specs


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    std = EMBED_STD if name == "model.embed_tokens.weight" else STD
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def random_extent(layout: ExtentLayout, gen: torch.Generator) -> torch.Tensor:
    """Random q in [0, 15] with scale/bias giving weights of std ~STD and mean ~0."""
    buf = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen)
    t = layout.views(buf)
    step = STD / 4.6  # std of a uniform 0..15 level is ~4.6 steps
    for pairs in (t.p13, t.p2):
        pairs[..., 0].fill_(step)
        pairs[..., 1].fill_(-7.5 * step)
    return buf


def synth(
    out: Path,
    shape: Shape,
    fmt: str = "edge0",
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    progress: bool = True,
    resident: str = "int4",
) -> Path:
    if fmt not in ("edge0", "hf"):
        raise ValueError(f"--format must be edge0 or hf, not {fmt!r}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    cfg = shape.config()
    # validates the dims; random codes are equally random in any arrangement: use the host's
    layout = ExtentLayout(shape.hidden, shape.expert_width, int4_layout.host_layout())
    gen = torch.Generator().manual_seed(seed)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _tokenizer(out, tokenizer_dir, shape.vocab)
    if fmt == "hf":
        _write_hf(out, cfg, gen, progress)
        return out
    specs = _resident_specs(cfg)
    as_int4 = set()
    if resident == "int4":  # what convert stores as int4 (models/int4.py)
        model = build(qwen3_moe, qwen3_moe.Config.from_dict(cfg), ExpertSlot)
        as_int4 = model.int4_weights()
    declared = []
    for name, s in specs:
        if name in as_int4:
            module, groups = name.removesuffix(".weight"), (s[0], INT4.groups(s[1]))
            declared += [
                (name, torch.uint32, (s[0], s[1] // 8)),
                (f"{module}.scales", torch.bfloat16, groups),
                (f"{module}.biases", torch.bfloat16, groups),
            ]
        else:
            declared.append((name, torch.bfloat16, s))
    w = StreamingSafetensors(
        out / modeldir.RESIDENT_FILE,
        declared,
        metadata={"format": "pt", "edge0": "resident", "random_weights": "true"},
    )
    for name, s in specs:
        value = _random(name, s, gen)
        if name in as_int4:
            module = name.removesuffix(".weight")
            for suffix, t in zip(
                (".weight", ".scales", ".biases"), int4.quantize(value), strict=True
            ):
                w.write(module + suffix, t)
        else:
            w.write(name, value)
    w.close()
    ew = ExtentsWriter(
        out / EXPERTS_FILE,
        {i: shape.experts for i in range(shape.layers)},
        layout.nbytes,
        {"format": "edge0-extents", "random_weights": "true", LAYOUT_KEY: layout.int4.name},
    )
    table, offset = {}, ew.data_start
    for i in tqdm(
        range(shape.layers), desc="random int4 experts", unit="layer", disable=not progress
    ):
        table[i] = {"offset": offset, "count": shape.experts}
        for _ in range(shape.experts):
            ew.write(i, random_extent(layout, gen)[None])
        offset += shape.experts * layout.nbytes
    ew.close()
    manifest = modeldir.Manifest.new(
        family="qwen3_moe",
        layout=layout,
        num_experts=shape.experts,
        native_top_k=shape.top_k,
        layers=table,
        source={"random_weights": True, "seed": seed},
        resident=resident,
    )
    manifest.hash_files(out)
    manifest.save(out)
    return out


def _write_hf(out: Path, cfg: dict, gen: torch.Generator, progress: bool) -> None:
    """bf16 safetensors, per-expert keys, one shard per group of layers, with an index."""
    d, i_w, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    resident = dict(_resident_specs(cfg))
    per_layer = {i: [] for i in range(cfg["num_hidden_layers"])}
    for name, s in resident.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
        per_layer[layer].append((name, s))
    for i in per_layer:
        for x in range(e):
            p = f"model.layers.{i}.mlp.experts.{x}"
            per_layer[i] += [
                (f"{p}.gate_proj.weight", (i_w, d)),
                (f"{p}.up_proj.weight", (i_w, d)),
                (f"{p}.down_proj.weight", (d, i_w)),
            ]
    per_layer[0] = [x for x in per_layer[0] if x[0] not in ("model.norm.weight", "lm_head.weight")]
    per_layer[cfg["num_hidden_layers"] - 1] += [
        ("model.norm.weight", (d,)),
        ("lm_head.weight", resident["lm_head.weight"]),
    ]
    shards = [
        list(range(cfg["num_hidden_layers"]))[j : j + 4]
        for j in range(0, cfg["num_hidden_layers"], 4)
    ]
    weight_map = {}
    for j, layers in enumerate(tqdm(shards, desc="hf shards", disable=not progress)):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        specs = [x for i in layers for x in per_layer[i]]
        w = StreamingSafetensors(
            out / fname, [(n, torch.bfloat16, s) for n, s in specs], metadata={"format": "pt"}
        )
        for name, s in specs:
            w.write(name, _random(name, s, gen))
            weight_map[name] = fname
        w.close()
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def _tokenizer(out: Path, tokenizer_dir: Path | None, vocab: int) -> None:
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(f, out / f.name)
        return
    from edge0.text import corpus
    from edge0.text.tokenizer_train import train_bpe

    docs = [d.text for _, d in zip(range(200), corpus.documents("train"), strict=False)]
    train_bpe(docs, min(vocab, 4096), out)
