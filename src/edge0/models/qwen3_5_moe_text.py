"""Qwen3.5/3.6-MoE saved as a text-only model (`model_type: qwen3_5_moe_text`).

The same network as `qwen3_5_moe`; only the checkpoint layout differs: the text model sits
directly under `model.` (no `language_model.` level, no vision tower).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge0.models import qwen3_5_moe


@dataclass
class Config(qwen3_5_moe.Config):
    model_type: str = "qwen3_5_moe_text"


class Model(qwen3_5_moe.Model):
    nest = None  # -> model.*


sanitize = qwen3_5_moe.sanitize
LORA_TARGETS = qwen3_5_moe.LORA_TARGETS
