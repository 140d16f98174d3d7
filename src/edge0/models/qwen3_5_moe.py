"""Qwen3.5/3.6-MoE (`model_type: qwen3_5_moe`), the text part: a gated DeltaNet + gated
attention hybrid with softmax-top-k routed experts and a sigmoid-gated shared expert.

`layer_types` says which layers use linear attention (a recurrent state of fixed size per
request) and which use full attention (a KV cache; partial rotary, an output gate). Every layer
is MoE. The checkpoint nests the text model under `model.language_model.`, keeps `lm_head` at
the top and may carry a vision tower (`model.visual.*`) and MTP layers (`mtp.*`): those are not
served. Norms other than the linear-attention output norm are stored zero-centred (1 + w).
Shape legend: B batch, T tokens, D hidden, H heads, G kv heads, Dh head dim,
Hk / Hv linear key / value heads, Dk / Dv their dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edge0.models import qwen2_moe
from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory
from edge0.models.delta_rule import causal_conv, gated_delta, recurrent_state
from edge0.models.layers import (
    Attention,
    GatedRMSNorm,
    KVCache,
    StateSpec,
    ZeroCenteredRMSNorm,
)

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # a scaled RoPE's parameters (None: default)
    max_position_embeddings: int | None = None  # the positions it was trained for
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True  # the router always renormalises its top-k
    model_type: str = "qwen3_5_moe"

    def __post_init__(self):
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = [
                LAYER_TYPES[(i + 1) % n == 0] for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types: {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        """config.json, nested (`text_config` of the multimodal model) or text-only."""
        data = dict(raw.get("text_config") or raw)
        data["model_type"] = raw.get("model_type", cls.model_type)
        if "tie_word_embeddings" in raw:  # the outer model owns lm_head
            data["tie_word_embeddings"] = raw["tie_word_embeddings"]
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if "partial_rotary_factor" in rope and "partial_rotary_factor" not in data:
            data["partial_rotary_factor"] = rope["partial_rotary_factor"]
        return config_from_dict(cls, data)

    def is_moe_layer(self, i: int) -> bool:
        return True


class GatedDeltaNet(nn.Module):
    """Linear attention: causal conv over [q|k|v], then the gated delta rule per value head."""

    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.layer = layer
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        d, kd, vd = cfg.hidden_size, self.hk * self.dk, self.hv * self.dv
        self.in_proj_qkv = nn.Linear(d, 2 * kd + vd, bias=False)
        self.in_proj_z = nn.Linear(d, vd, bias=False)
        self.in_proj_b = nn.Linear(d, self.hv, bias=False)
        self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        c, w = 2 * kd + vd, cfg.linear_conv_kernel_dim
        self.conv = w
        self.conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)  # weight [C, 1, W]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, F.silu)
        self.out_proj = nn.Linear(vd, d, bias=False)

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        window, state = recurrent_state(cache, self.layer)
        qkv, window = causal_conv(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight, window)
        q, k, v = qkv.transpose(1, 2).split(
            [self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], -1
        )
        rep = self.hv // self.hk  # each key head serves `rep` consecutive value heads
        q = q.reshape(b, t, self.hk, self.dk).repeat_interleave(rep, dim=2).transpose(1, 2)
        k = k.reshape(b, t, self.hk, self.dk).repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v.reshape(b, t, self.hv, self.dv).transpose(1, 2)  # [B, Hv, T, Dv]
        beta = torch.sigmoid(self.in_proj_b(x)).transpose(1, 2)  # [B, Hv, T]
        # log decay per value head: -exp(A) * softplus(a + dt_bias) <= 0
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out, state = gated_delta(q, k, v, g.transpose(1, 2)[..., None], beta, state)
        if cache is not None:
            cache.update_state(self.layer, (window, state), t)
        z = self.in_proj_z(x).view(b, t, self.hv, self.dv)
        return self.out_proj(self.norm(out.transpose(1, 2), z).reshape(b, t, -1))

    def cache_spec(self) -> StateSpec:
        conv = (2 * self.hk * self.dk + self.hv * self.dv, self.conv - 1)
        return StateSpec((conv, (self.hv, self.dk, self.dv)), (False, True))


def attention(cfg: Config, layer: int) -> Attention:
    """GQA with per-head zero-centred q/k norm, partial rotary and a sigmoid output gate."""
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qk_norm="head",
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        eps=cfg.rms_norm_eps,
        layer=layer,
        output_gate=True,
        norm=ZeroCenteredRMSNorm,
    )


class Model(CausalLM):
    """Causal LM over the text model; `experts(layer)` builds each layer's routed experts."""

    nest = "language_model"  # -> model.language_model.*

    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        if cfg.layer_types[i] == "linear_attention":
            mixer = ("linear_attn", GatedDeltaNet(cfg, i))
        else:
            mixer = ("self_attn", attention(cfg, i))
        norm = partial(ZeroCenteredRMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        return DecoderLayer(mixer, ("mlp", qwen2_moe.moe(cfg, i, experts(i))), norm)

    def final_norm(self, cfg: Config) -> nn.Module:
        return ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rotary_dim(self, cfg: Config) -> int:
        return cfg.rotary_dim


def sanitize(cfg: Config, key: str) -> str | None:
    """The vision tower and the multi-token-prediction layers are not served."""
    return None if key.startswith(("model.visual.", "mtp.")) else key


LORA_TARGETS = qwen2_moe.LORA_TARGETS + tuple(
    f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
)
