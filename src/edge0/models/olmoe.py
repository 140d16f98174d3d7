"""OLMoE (`model_type: olmoe`): softmax-top-k routed experts, no shared expert, every layer MoE.

Attention normalises q and k over the whole projection (not per head) before splitting heads,
and may clip q/k/v to +-clip_qkv. `intermediate_size` is the expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from edge0.models import qwen3_moe
from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory
from edge0.models.layers import Attention, RMSNorm


@dataclass
class Config(qwen3_moe.Config):
    clip_qkv: float | None = None
    rms_norm_eps: float = 1e-5
    model_type: str = "olmoe"

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        data = dict(raw)
        if data.get("num_key_value_heads") is None:  # null means one kv head per query head
            data["num_key_value_heads"] = data.get("num_attention_heads")
        return config_from_dict(
            cls,
            data,
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
        qk_norm="full",
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        eps=cfg.rms_norm_eps,
        layer=layer,
        clip=cfg.clip_qkv,
    )


class Model(CausalLM):
    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        mlp = qwen3_moe.moe(cfg, i, experts(i))
        return DecoderLayer(("self_attn", attention(cfg, i)), ("mlp", mlp), norm)


sanitize = qwen3_moe.sanitize
LORA_TARGETS = qwen3_moe.LORA_TARGETS
