"""OLMoE (`model_type: olmoe`): softmax-top-k routed experts, no shared expert, every layer MoE.

Attention normalises q and k over the whole projection (not per head) before splitting heads,
and may clip q/k/v to +-clip_qkv. `intermediate_size` is the expert width.
Shape legend: B batch, T tokens, D hidden, H heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edge0.models import qwen3_moe
from edge0.models.base import config_from_dict
from edge0.models.layers import Attention, KVCache, RMSNorm, apply_rotary, attend


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


class OlmoeAttention(Attention):
    def __init__(self, cfg: Config, layer: int):
        super().__init__(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qk_norm=False,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            eps=cfg.rms_norm_eps,
            layer=layer,
        )
        self.q_norm = RMSNorm(self.heads * self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_heads * self.head_dim, cfg.rms_norm_eps)
        self.clip = cfg.clip_qkv

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, G, T, Dh]
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        return self.o_proj(attend(q, k, v, self.head_dim**-0.5))


class Model(qwen3_moe.Model):
    @staticmethod
    def make_layer(cfg: Config, i: int, experts: Callable[[int], nn.Module]) -> nn.Module:
        mlp = qwen3_moe.SparseMoeBlock(cfg, i, experts(i))
        return qwen3_moe.DecoderLayer(cfg, OlmoeAttention(cfg, i), mlp)


EXPERT_PREFIX = qwen3_moe.EXPERT_PREFIX
EXPERT_PROJ = qwen3_moe.EXPERT_PROJ
LORA_TARGETS = qwen3_moe.LORA_TARGETS
