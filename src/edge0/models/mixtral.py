"""Mixtral (`model_type: mixtral`): GQA attention (optionally sliding-window) and a softmax-top-k
renormalised router over experts stored as `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up,
down); no shared expert, every layer MoE. `intermediate_size` is the expert width.
Shape legend: B batch, T tokens, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edge0.models import qwen3_moe
from edge0.models.base import Forward, config_from_dict
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, layer: int, experts: nn.Module):
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qk_norm=False,
            qkv_bias=False,
            eps=cfg.rms_norm_eps,
            layer=layer,
            window=cfg.sliding_window,
        )
        self.block_sparse_moe = qwen3_moe.SparseMoeBlock(cfg, layer, experts)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, fwd: Forward) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, fwd.cache)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x), fwd)


class Model(qwen3_moe.Model):
    @staticmethod
    def make_layer(cfg: Config, i: int, experts: Callable[[int], nn.Module]) -> nn.Module:
        return DecoderLayer(cfg, i, experts(i))

    def moe_block(self, layer: int) -> qwen3_moe.SparseMoeBlock:
        return self.backbone.layers[layer].block_sparse_moe


EXPERT_PREFIX = "model.layers.{layer}.block_sparse_moe.experts"
EXPERT_PROJ = ("w1", "w3", "w2")
LORA_TARGETS = qwen3_moe.LORA_TARGETS
