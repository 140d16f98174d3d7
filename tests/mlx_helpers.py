"""MLX-format fixtures built from float weights with MLX's documented affine math.

Written independently of edge0's reader: quantization per group of `group` along the input,
words packed LSB-first (element j of a row in bits [bits * (j % (32/bits)), +bits) of word
j // (32/bits)), scales and biases bf16. `hf_to_mlx` turns a tiny Hugging Face checkpoint into
an MLX directory and into the "equivalent full-precision" HF directory: resident weights are
the MLX-dequantized values, experts the original floats.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from edge0.formats.checkpoint import Checkpoint, ExpertSource, ServedCheckpoint
from edge0.models import FAMILIES

GROUP = 64
ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


def mlx_quantize(w: torch.Tensor, bits: int, group: int = GROUP):
    """float [..., out, in] -> (u32 words [..., out, in*bits/32], scales bf16, biases bf16)."""
    g = w.float().unflatten(-1, (-1, group))
    w_max, w_min = g.amax(-1), g.amin(-1)
    n_bins = float(2**bits - 1)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    nz = q0 != 0
    scale = torch.where(nz, edge / torch.where(nz, q0, 1.0), scale)
    bias = torch.where(nz, edge, torch.zeros_like(edge))
    q = torch.round((g - bias[..., None]) / scale[..., None]).clamp(0, n_bins)
    q = q.flatten(-2).to(torch.int64).numpy().astype(np.uint64)
    per = 32 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    words = np.zeros(q.shape[:-1], dtype=np.uint64)
    for j in range(per):
        words |= q[..., j] << np.uint64(bits * j)
    packed = torch.from_numpy(words.astype(np.uint32))
    return packed, scale.to(torch.bfloat16), bias.to(torch.bfloat16)


def mlx_unpack(packed: torch.Tensor, bits: int) -> np.ndarray:
    words = packed.numpy().astype(np.uint64)
    shifts = np.arange(0, 32, bits, dtype=np.uint64)
    q = (words[..., None] >> shifts) & np.uint64(2**bits - 1)
    return q.reshape(*words.shape[:-1], -1)


def mlx_dequantize(packed, scales, biases, bits: int, group: int = GROUP) -> torch.Tensor:
    """fp32 scale * q + bias straight from the words."""
    q = torch.from_numpy(mlx_unpack(packed, bits).astype(np.float32))
    g = q.unflatten(-1, (-1, group))
    return (scales.float()[..., None] * g + biases.float()[..., None]).flatten(-2)


def _family_names(family: str):
    """(mlx name, equivalent-HF name) for a text-model key `model.x` / `lm_head.weight`."""
    if family == "qwen3_5_moe":  # MLX: language_model.model.*, HF: model.language_model.*
        return (
            lambda k: "language_model." + k,
            lambda k: k if k.startswith("lm_head") else "model.language_model." + k[6:],
        )
    return (lambda k: k), (lambda k: k)


def hf_to_mlx(
    hf_dir: Path,
    mlx_dir: Path,
    equiv_dir: Path,
    *,
    prefix: str = "",
    router_bits: int = 8,
    shards: int = 1,
    family: str = "qwen3_moe",
    stack: str = "switch_mlp",
) -> dict:
    """Write an MLX directory and its full-precision equivalent from a float HF checkpoint.

    family "qwen3_5_moe" reads a qwen3_5_moe_text checkpoint and writes the multimodal layout
    (text_config, `language_model.` nesting) with MLX's sanitize applied: conv1d as [C, W, 1]
    and zero-centred norms stored as 1 + w. `stack` names where a layer's stacked experts go
    (mlx-lm's `switch_mlp`; the 8B release's `experts`). Returns the MLX tensors written.
    """
    raw = json.loads((hf_dir / "config.json").read_text())
    src_fam = "qwen3_5_moe_text" if family == "qwen3_5_moe" else family
    fam = FAMILIES[src_fam]
    cfg = fam.Config.from_dict(raw)
    ckpt = ServedCheckpoint(Checkpoint(hf_dir), fam, cfg)
    to_mlx, to_hf = _family_names(family)
    mlx: dict[str, torch.Tensor] = {}
    equiv: dict[str, torch.Tensor] = {}
    expert_keys: set[str] = set()
    quant = {"group_size": GROUP, "bits": 4}
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        src = ExpertSource(ckpt, f"model.layers.{layer}.mlp.experts", cfg.num_experts)
        expert_keys.update(src.keys())
        experts = [src.expert(e) for e in range(cfg.num_experts)]
        stacked = {
            "gate_proj": torch.stack([g for g, _, _ in experts]),
            "up_proj": torch.stack([u for _, u, _ in experts]),
            "down_proj": torch.stack([d for _, _, d in experts]),
        }
        base = to_mlx(prefix + f"model.layers.{layer}.mlp.{stack}")
        for proj, w in stacked.items():
            packed, s, b = mlx_quantize(w, 4)
            mlx[f"{base}.{proj}.weight"], mlx[f"{base}.{proj}.scales"] = packed, s
            mlx[f"{base}.{proj}.biases"] = b
        for e, (g, u, d) in enumerate(experts):
            for proj, w in zip(("gate_proj", "up_proj", "down_proj"), (g, u, d), strict=True):
                equiv[to_hf(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")] = w
    for key in ckpt.keys():
        if key in expert_keys:
            continue
        w = ckpt.get(key)
        name = to_mlx(prefix + key)
        module = name.removesuffix(".weight")
        if key.endswith(".weight") and w.dim() == 2 and w.shape[-1] % GROUP == 0:
            bits = (
                router_bits if key.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else 4
            )
            if bits != 4:
                quant[module] = {"group_size": GROUP, "bits": bits}
            packed, s, b = mlx_quantize(w, bits)
            mlx[name], mlx[f"{module}.scales"], mlx[f"{module}.biases"] = packed, s, b
            equiv[to_hf(key)] = mlx_dequantize(packed, s, b, bits).to(torch.bfloat16)
            continue
        value = w.to(torch.bfloat16)
        if family == "qwen3_5_moe" and key.endswith("conv1d.weight"):
            mlx[name] = value.transpose(1, 2).contiguous()  # MLX [C, W, 1]
        elif family == "qwen3_5_moe" and (key.endswith(ZERO_CENTRED) or key == "model.norm.weight"):
            mlx[name] = (value.float() + 1.0).to(torch.bfloat16)  # MLX stores 1 + w
            value = (mlx[name].float() - 1.0).to(torch.bfloat16)  # what MLX effectively uses
        else:
            mlx[name] = value
        equiv[to_hf(key)] = value
    mlx_cfg, hf_cfg = dict(raw), dict(raw)
    if family == "qwen3_5_moe":
        text = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
        mlx_cfg = hf_cfg = {
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        }
    mlx_cfg = dict(mlx_cfg, quantization=quant, quantization_config=quant)
    for path, config in ((mlx_dir, mlx_cfg), (equiv_dir, hf_cfg)):
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config, indent=2))
        for f in hf_dir.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy2(f, path / f.name)
    _save_shards(mlx_dir, mlx, shards)
    save_file(equiv, str(equiv_dir / "model.safetensors"))
    return mlx


def _save_shards(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "mlx"})
        return
    keys = list(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(path / name), metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))
