"""Qwen2-MoE (`model_type: qwen2_moe`): Qwen3-MoE's routing plus a sigmoid-gated shared expert.

Attention has q/k/v bias (`qkv_bias`) and no q/k norm. The shared expert is resident; only
routed experts stream.
Shape legend: B batch, T tokens, D hidden, K active experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edge0.models import qwen3_moe
from edge0.models.base import Forward, config_from_dict
from edge0.models.layers import MLP, Attention


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


class SparseMoeBlock(qwen3_moe.SparseMoeBlock):
    def __init__(self, cfg: Config, layer: int, experts: nn.Module):
        super().__init__(cfg, layer, experts)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, fwd: Forward) -> torch.Tensor:
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        weights, indices = self.route(h, fwd)
        y = (self.experts(h, indices) * weights[..., None].to(h.dtype)).sum(
            dim=1
        )  # [T, K, D] -> [T, D]
        y = y + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return y.view(b, t, d)


class Model(qwen3_moe.Model):
    @staticmethod
    def make_layer(cfg: Config, i: int, experts: Callable[[int], nn.Module]) -> nn.Module:
        attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qk_norm=False,
            qkv_bias=cfg.qkv_bias,
            eps=cfg.rms_norm_eps,
            layer=i,
        )
        mlp = (
            SparseMoeBlock(cfg, i, experts(i))
            if cfg.is_moe_layer(i)
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        return qwen3_moe.DecoderLayer(cfg, attn, mlp)


EXPERT_PREFIX = qwen3_moe.EXPERT_PREFIX
EXPERT_PROJ = qwen3_moe.EXPERT_PROJ
LORA_TARGETS = qwen3_moe.LORA_TARGETS + (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
)
