"""`edge0 synth OUT_DIR`: a random-weight model of any shape, for benchmarks and tests.

A qwen3_moe of any size (`Shape`), or a full-size tier (`--shape 35b-a3b`, convert/tiers.py)
of its own family with exactly the released tensor shapes. `--format edge0` writes the edge0
directory directly (random int4 extents, no float detour), so a realistically shaped model
larger than memory costs only disk time; the resident tensors are the family's own, as
convert would store them.
`--format hf` writes a Hugging Face checkpoint (bf16, per-expert keys, sharded with an
index) for exercising `edge0 convert` at scale. The weights are random: such a model
measures speed and memory, never quality, and edge0.json says so (`"random_weights": true`).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from edge0 import modeldir
from edge0.convert import expected_resident, write_model_dir
from edge0.convert.tiers import TIERS, tier_config
from edge0.formats.extents import ExtentLayout
from edge0.formats.writer import StreamingSafetensors
from edge0.modeldir.loader import build
from edge0.models import family, qwen3_moe
from edge0.models.experts import ExpertSlot

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


def _random(
    name: str, shape: tuple[int, ...], gen: torch.Generator, zero: set[str] = frozenset()
) -> torch.Tensor:
    """bf16 values a freshly initialised model of the family would hold, near enough to run
    stably: norms the identity, biases zero, decays in the family's range, matrices N(0, STD)
    and the embedding larger (see EMBED_STD)."""
    last = name.rsplit(".", 1)[-1]
    if name in zero or last in ("bias", "expert_bias", "e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith("norm.weight") or last == "dt_bias":
        return torch.ones(shape, dtype=torch.bfloat16)
    if last == "A_log":  # a decay rate per head in [1, 16], as transformers initialises it
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log().to(torch.bfloat16)
    std = EMBED_STD if name.endswith(("embed_tokens.weight", "word_embeddings.weight")) else STD
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def random_extent(layout: ExtentLayout, gen: torch.Generator) -> torch.Tensor:
    """Random q in [0, 15] with scale/bias giving weights of std ~STD and mean ~0 (random
    bytes drawn 8 at a time: one int64 per 8 bytes)."""
    words = torch.randint(-(2**63), 2**63 - 1, (layout.nbytes // 8,), generator=gen)
    buf = words.view(torch.uint8)
    t = layout.views(buf)
    step = STD / 4.6  # std of a uniform 0..15 level is ~4.6 steps
    for pairs in (t.p13, t.p2):
        pairs[..., 0].fill_(step)
        pairs[..., 1].fill_(-7.5 * step)
    return buf


def synth(
    out: Path,
    shape: Shape | str,
    fmt: str = "edge0",
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    progress: bool = True,
    resident: str = "int4",
    layers: int | None = None,
) -> Path:
    """Write a random model of `shape`: a `Shape` (a qwen3_moe of any size) or the name of a
    full-size tier (convert/tiers.py; `layers` cuts its depth, keeping every width). A tier
    also gets the reference's adapters: warm-started heads and a random LoRA."""
    if fmt not in ("edge0", "hf"):
        raise ValueError(f"--format must be edge0 or hf, not {fmt!r}")
    tier = None
    if isinstance(shape, str) and shape != "bench":
        tier, cfg = TIERS.get(shape), tier_config(shape, layers)
    else:
        shape = Shape() if isinstance(shape, str) else shape
        cfg = shape.config()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    fam = family(cfg["model_type"])
    if fmt == "hf" and fam is not qwen3_moe:
        raise ValueError(f"--format hf writes qwen3_moe shapes only, not {cfg['model_type']}")
    if fmt == "hf":
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _tokenizer(out, tokenizer_dir, cfg["vocab_size"])
        _write_hf(out, cfg, torch.Generator().manual_seed(seed), progress)
        return out
    config = fam.Config.from_dict(cfg)
    ckpt = RandomCheckpoint(fam, config, seed)
    sources = {i: RandomExperts(seed, i) for i in ckpt.moe_layers}

    def extra(tmp: Path) -> None:
        _tokenizer(tmp, tokenizer_dir, config.vocab_size)
        if tier is not None and tier.start_layer is not None:
            served = tier.served_top_k or config.num_experts_per_tok
            write_heads(tmp, ckpt, config, tier.start_layer, served, seed)
            write_lora(tmp, fam, ckpt, tier.lora_rank, tier.lora_alpha, seed)

    try:
        write_model_dir(
            None,
            out,
            fam,
            config,
            ckpt,
            sources,
            progress=progress,
            t0=time.perf_counter(),
            source={"random_weights": True, "seed": seed, "shape": shape if tier else "custom"},
            config=cfg,
            extra=extra,
            resident=resident,
        )
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if tier is not None and tier.served_top_k is not None:
        manifest = modeldir.Manifest.load(out)
        manifest.served_top_k = tier.served_top_k
        manifest.save(out)
    return out


class RandomCheckpoint:
    """Random values for every resident tensor of a model, under our names (the view
    `write_model_dir` reads). Each tensor's values depend on the seed and its name only."""

    def __init__(self, fam, cfg, seed: int):
        from edge0.convert.mlx import zero_centred_norms

        model = build(fam, cfg, ExpertSlot)
        self.expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self.zero = zero_centred_norms(model)  # (1 + w) norms: w = 0 is the identity
        self.moe_layers = list(model.moe_layers)
        self.routers = {i: f"{model.moe_block_path(i)}.gate.weight" for i in self.moe_layers}
        self.seed = seed
        self.path, self.files = Path("random-weights"), []

    def keys(self) -> list[str]:
        return list(self.expected)

    def __contains__(self, key: str) -> bool:
        return key in self.expected

    def shape(self, key: str) -> list[int]:
        return list(self.expected[key])

    def get(self, key: str) -> torch.Tensor:
        return _random(key, self.expected[key], _generator(self.seed, key), self.zero)

    def hashes(self) -> dict[str, str]:
        return {}


class RandomExperts:
    """One layer's random int4 experts: random codes with scale and bias giving weights of
    std ~STD (no float detour, so a model larger than memory costs only disk time)."""

    def __init__(self, seed: int, layer: int):
        self.gen = _generator(seed, f"experts.{layer}")

    def keys(self) -> list[str]:
        return []

    def extent(self, e: int, layout: ExtentLayout) -> torch.Tensor:
        return random_extent(layout, self.gen)

    def release(self) -> None:
        pass


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def write_heads(folder: Path, ckpt: RandomCheckpoint, cfg, start: int, k: int, seed: int):
    """The paper's warm start: each head's linear_init is the next layer's router, fc2 zero."""
    from edge0.prerouter.head import Prerouter, Wiring

    if start > ckpt.moe_layers[-1]:  # a tier cut to fewer layers: route all it has
        start = ckpt.moe_layers[1]
    pre = Prerouter(Wiring.default(ckpt.moe_layers, start), cfg.hidden_size, cfg.num_experts)
    pre.warm_start({c: ckpt.get(ckpt.routers[c]) for c in pre.wiring.consumers}, seed)
    pre.save(folder / modeldir.PREROUTER_FILE, {"K": str(k), "random_weights": "true"})


def write_lora(folder: Path, fam, ckpt: RandomCheckpoint, rank: int, alpha: int, seed: int):
    """A random fp16 LoRA of rank `rank` on every target the family serves, in every layer."""
    from safetensors.torch import save_file

    targets = tuple(getattr(fam, "LORA_TARGETS", ()))
    tensors = {}
    for key, shape in ckpt.expected.items():
        m = re.fullmatch(r".*\blayers\.\d+\.(.+)\.weight", key)
        if m is None or m[1] not in targets or len(shape) != 2:
            continue
        module, gen = key.removesuffix(".weight"), _generator(seed, "lora." + key)
        n_out, n_in = shape
        tensors[f"{module}.lora_A"] = (torch.randn(rank, n_in, generator=gen) * STD).half()
        tensors[f"{module}.lora_B"] = (torch.randn(n_out, rank, generator=gen) * STD).half()
    modules = sorted(k.removesuffix(".lora_A") for k in tensors if k.endswith(".lora_A"))
    meta = {"kind": "lora", "r": str(rank), "alpha": str(alpha), "random_weights": "true"}
    meta["targets"] = json.dumps(modules)
    save_file(tensors, str(folder / modeldir.LORA_FILE), metadata=meta)


def _write_hf(out: Path, cfg: dict, gen: torch.Generator, progress: bool) -> None:
    """bf16 safetensors, per-expert keys, one shard per group of layers, with an index."""
    d, i_w, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    resident = expected_resident(qwen3_moe, qwen3_moe.Config.from_dict(cfg))
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
