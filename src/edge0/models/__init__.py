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
    fam = family(raw.get("model_type"), str(path / "config.json"))
    try:
        return fam, fam.Config.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e
