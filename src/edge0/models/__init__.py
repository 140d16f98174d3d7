"""Model families, one module per Hugging Face `model_type`."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from edge0.formats.checkpoint import read_json
from edge0.models import (
    bailing_hybrid,
    deepseek_v3,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_5_moe_text,
    qwen3_moe,
)

FAMILIES: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "qwen3_5_moe": qwen3_5_moe,
    "qwen3_5_moe_text": qwen3_5_moe_text,
    "deepseek_v3": deepseek_v3,
    "olmoe": olmoe,
    "mixtral": mixtral,
    "bailing_hybrid": bailing_hybrid,
}


# config.json's `architectures[0]` -> model_type, for configs that name no model_type (the
# reference's 8B release: BailingMoeV3ForCausalLM, with auto_map to its own modeling file)
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "OlmoeForCausalLM": "olmoe",
    "MixtralForCausalLM": "mixtral",
    "BailingHybridForCausalLM": "bailing_hybrid",
    "BailingMoeV3ForCausalLM": "bailing_hybrid",
}


def model_type_of(raw: dict) -> str | None:
    """config.json's model_type, else the one its first `architectures` entry implies."""
    if raw.get("model_type"):
        return raw["model_type"]
    names = raw.get("architectures") or []
    return ARCHITECTURES.get(names[0]) if names else None


def family(model_type: str | None, source: str = "config.json") -> ModuleType:
    """The family module for a model_type; ValueError naming it and the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def load_config(path: Path):
    """(family module, config) from a directory's config.json."""
    raw = read_json(path / "config.json", "model configuration")
    model_type = model_type_of(raw)
    if model_type is None and raw.get("architectures"):
        raise ValueError(
            f"{path / 'config.json'}: no model_type, and architectures "
            f"{raw['architectures'][0]!r} is not one edge0 serves; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    fam = family(model_type, str(path / "config.json"))
    try:
        return fam, fam.Config.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e
