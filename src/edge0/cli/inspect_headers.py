"""What a checkpoint's safetensors headers say: its logical tensors by kind, counted, for
a Hugging Face, MLX or edge0 directory (`edge0 inspect`, inspect.py). No tensor data is read."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from edge0.formats.checkpoint import INDEX_NAME, is_adapter_file, read_header, read_json
from edge0.formats.mlx import QuantConfig, split_quantized

KINDS = (
    "attention",
    "embeddings",
    "lm_head",
    "shared_experts",
    "routers",
    "norms",
    "dense_mlp",
    "other",
)
NOT_SERVED = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "mtp")
_LAYER = re.compile(r"\blayers\.(\d+)\.")
_EXPERT = re.compile(r"\bexperts\.(\d+)\.")


@dataclass
class Count:
    params: int = 0
    bytes: int = 0
    tensors: int = 0

    def add(self, params: int, nbytes: int) -> None:
        self.params += params
        self.bytes += nbytes
        self.tensors += 1


@dataclass
class Tensor:
    """One logical tensor: name (module path for quantized weights), kind, counts."""

    name: str
    kind: str
    shape: tuple[int, ...]
    params: int
    bytes: int
    stored: int = 1  # tensors in the file: 3 for an MLX-quantized weight
    bits: int | None = None  # of a quantized weight


def kind_of(name: str) -> str:
    """routed / unused or one of KINDS, from a tensor (or module) name."""
    parts = name.split(".")
    if any(p in NOT_SERVED for p in parts[:3]):
        return "unused"
    if re.search(r"\.(experts|switch_mlp)\.", name):
        return "routed"
    if re.search(r"\.(gate|router)(\.|$)", name) or "shared_expert_gate" in parts:
        return "routers"
    if parts[-1] in ("e_score_correction_bias", "expert_bias"):
        return "routers"
    if "shared_expert" in parts or "shared_experts" in parts:
        return "shared_experts"
    if any(p in ("embed_tokens", "word_embeddings", "wte", "tok_embeddings") for p in parts):
        return "embeddings"
    if "lm_head" in parts:
        return "lm_head"
    module = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    if "norm" in module:
        return "norms"
    if any(p in ("self_attn", "linear_attn", "attention", "attn", "mixer") for p in parts):
        return "attention"
    if any(p in ("mlp", "feed_forward", "block_sparse_moe") for p in parts):
        return "dense_mlp"
    return "other"


def flat_config(raw: dict) -> dict:
    """config.json with a multimodal `text_config` lifted to the top level."""
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else dict(raw)


def config_value(cfg: dict, *keys, default=None):
    """The first of `keys` that cfg sets (not None), else `default`."""
    return next((cfg[k] for k in keys if cfg.get(k) is not None), default)


# -- reading a directory -----------------------------------------------------------------------


def weight_files(path: Path, fmt: str) -> list[Path]:
    if fmt == "edge0":
        return [path / "model.safetensors", path / "experts.safetensors"]
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index, "shard index").get("weight_map") or {}
        return [path / f for f in sorted(set(weight_map.values()))]
    return sorted(p for p in path.glob("*.safetensors") if not is_adapter_file(p))


def read_tensors(files: list[Path], qcfg: QuantConfig | None) -> list[Tensor]:
    """Logical tensors of safetensors files, from their headers."""
    out = []
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (listed for this directory)")
        table, _ = read_header(f)
        quantized, plain = split_quantized(table, qcfg, str(f))
        for module, qt in quantized.items():
            out.append(
                Tensor(module, kind_of(module), qt.shape, qt.numel, qt.nbytes, 3, qt.params.bits)
            )
        for key in plain:
            if key.endswith(".experts.xxh3"):  # an edge0 layer's extent checksums, not weights
                continue
            info = table[key]
            out.append(Tensor(key, kind_of(key), info.shape, math.prod(info.shape), info.nbytes))
    return out


class Tally:
    """Counts by kind, and per MoE layer the routed parameters and the number of experts."""

    def __init__(self):
        self.total, self.routed, self.unused = Count(), Count(), Count()
        self.resident = {k: Count() for k in KINDS}
        self.layer_params: dict[int, int] = {}
        self._experts: dict[int, set[int] | int] = {}  # expert indices seen, or a stack's E

    def add(self, t: Tensor, manifest: dict | None) -> None:
        if t.kind == "unused":
            self.unused.add(t.params, t.bytes)
            return
        params = t.params
        if t.kind == "routed":
            m = _LAYER.search(t.name)
            layer = int(m[1]) if m else -1
            if t.name.endswith(".extents"):  # edge0: U8 [E, extent bytes], 3*D*I params each
                ex = (manifest or {}).get("experts") or {}
                params = t.shape[0] * 3 * ex.get("hidden", 0) * ex.get("inter", 0)
                self._experts[layer] = t.shape[0]
            elif e := _EXPERT.search(t.name):  # per-expert keys: count distinct indices
                seen = self._experts.setdefault(layer, set())
                if isinstance(seen, set):
                    seen.add(int(e[1]))
            else:  # a stack [E, out, in] (HF fused, MLX switch_mlp)
                self._experts[layer] = t.shape[0]
            self.layer_params[layer] = self.layer_params.get(layer, 0) + params
            self.routed.add(params, t.bytes)
        else:
            self.resident[t.kind].add(params, t.bytes)
        self.total.add(params, t.bytes)

    def experts(self) -> dict[int, int]:
        return {k: len(v) if isinstance(v, set) else v for k, v in self._experts.items()}
