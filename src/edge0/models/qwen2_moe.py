"""Qwen2-MoE (`model_type: qwen2_moe`): Qwen3-MoE's routing plus a sigmoid-gated shared expert.

Attention has q/k/v bias (`qkv_bias`) and no q/k norm. The shared expert is resident; only
routed experts stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import nn

from edge0.models import qwen3_moe
from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory, MoEBlock
from edge0.models.layers import MLP, Attention, RMSNorm
from edge0.models.routing import SoftmaxTopK


@dataclass
class Config(qwen3_moe.Config):
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = True
    model_type: str = "qwen2_moe"

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise ValueError("config.json: qwen2_moe with use_sliding_window is not supported")

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        return config_from_dict(cls, raw, aliases={"num_local_experts": "num_experts"})


def attention(cfg: Config, layer: int) -> Attention:
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qk_norm=None,
        qkv_bias=cfg.qkv_bias,
        eps=cfg.rms_norm_eps,
        layer=layer,
    )


def moe(cfg, layer: int, experts: nn.Module) -> MoEBlock:
    """Softmax-top-k routed experts plus the shared expert, scaled by sigmoid(its gate)."""
    d = cfg.hidden_size
    return MoEBlock(
        layer,
        nn.Linear(d, cfg.num_experts, bias=False),
        SoftmaxTopK(cfg.norm_topk_prob),
        experts,
        cfg.num_experts_per_tok,
        shared=("shared_expert", MLP(d, cfg.shared_expert_intermediate_size)),
        shared_gate=nn.Linear(d, 1, bias=False),
    )


class Model(CausalLM):
    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        mlp = (
            moe(cfg, i, experts(i))
            if cfg.is_moe_layer(i)
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        return DecoderLayer(("self_attn", attention(cfg, i)), ("mlp", mlp), norm)


sanitize = qwen3_moe.sanitize
LORA_TARGETS = qwen3_moe.LORA_TARGETS + (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
)
