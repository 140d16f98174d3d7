"""Mixtral (`model_type: mixtral`): GQA attention (optionally sliding-window) and a softmax-top-k
renormalised router over experts stored as `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up,
down); no shared expert, every layer MoE. `intermediate_size` is the expert width.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

from edge0.models import qwen3_moe
from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory
from edge0.models.layers import Attention, RMSNorm


@dataclass
class Config(qwen3_moe.Config):
    norm_topk_prob: bool = True  # the router always renormalises its top-k
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    model_type: str = "mixtral"

    def __post_init__(self):
        self.use_sliding_window = self.sliding_window is not None
        super().__post_init__()

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        return config_from_dict(
            cls,
            raw,
            aliases={
                "num_local_experts": "num_experts",
                "intermediate_size": "moe_intermediate_size",
            },
        )


def attention(cfg: Config, layer: int) -> Attention:
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qk_norm=None,
        qkv_bias=False,
        eps=cfg.rms_norm_eps,
        layer=layer,
        window=cfg.sliding_window,
    )


class Model(CausalLM):
    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        moe = qwen3_moe.moe(cfg, i, experts(i))
        return DecoderLayer(("self_attn", attention(cfg, i)), ("block_sparse_moe", moe), norm)


_EXPERT = re.compile(r"(.+\.block_sparse_moe\.experts\.\d+)\.w([123])\.weight")
_PROJ = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


def sanitize(cfg: Config, key: str) -> str | None:
    """Experts' w1/w3/w2 are the gate/up/down projections every family's experts have."""
    m = _EXPERT.fullmatch(key)
    return f"{m[1]}.{_PROJ[m[2]]}.weight" if m else key


LORA_TARGETS = qwen3_moe.LORA_TARGETS
