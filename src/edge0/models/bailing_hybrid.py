"""Ling 3 / Bailing hybrid (`model_type: bailing_hybrid`): Kimi Delta Attention (KDA) linear
layers interleaved with gated MLA, DeepSeek-V3 sigmoid-group routed experts with shared
experts, dense MLPs per `mlp_layer_types`. The reference 8B tier's architecture.

KDA is the gated delta rule with a decay per key channel (bounded below by `kda_lower_bound`)
and a sigmoid-gated output norm; its state per request is the conv window and the recurrent
matrix. MLA is DeepSeek-V3's (always interleaved rope) with a sigmoid gate per head. Module
names follow the released checkpoints: `attention`, `dense`, `word_embeddings`, separate
q/k/v conv kernels, `gate.expert_bias`.
Shape legend: B batch, T tokens, D hidden, H linear heads, Dh their head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edge0.models import deepseek_v3
from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory
from edge0.models.delta_rule import causal_conv, gated_delta, recurrent_state
from edge0.models.layers import MLP, GatedRMSNorm, KVCache, RMSNorm, StateSpec

ALIASES = dict(
    deepseek_v3.ALIASES,
    num_expert_group="n_group",
    num_experts_per_token="num_experts_per_tok",
    moe_renormalize="norm_topk_prob",
    num_shared_experts="n_shared_experts",
    short_conv_kernel_size="linear_conv_kernel_dim",
)


@dataclass
class Config(deepseek_v3.Config):
    linear_head_dim: int | None = None
    linear_num_heads: int | None = None
    linear_conv_kernel_dim: int = 4
    layer_group_size: int = 6
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    rope_interleave: bool = True
    model_type: str = "bailing_hybrid"

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # the last layer of every group is full attention
            g = self.layer_group_size
            self.layer_types = [
                "full_attention" if (i + 1) % g == 0 else "linear_attention" for i in range(n)
            ]
        if self.mlp_layer_types is None:
            k = self.first_k_dense_replace
            self.mlp_layer_types = ["dense" if i < k else "sparse" for i in range(n)]
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} needs {n} entries (num_hidden_layers)")
        self.linear_num_heads = self.linear_num_heads or self.num_attention_heads
        super().__post_init__()

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        data = dict(raw)
        if "linear_head_dim" not in data:  # released configs: head_dim is the linear head dim
            data["linear_head_dim"] = data.get("head_dim")
        return config_from_dict(cls, data, aliases=ALIASES)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and self.mlp_layer_types[i] == "sparse"


class KimiDeltaAttention(nn.Module):
    """Linear attention: causal conv over q, k, v, then the delta rule with per-channel decay."""

    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.layer, self.h, self.dh = layer, cfg.linear_num_heads, cfg.linear_head_dim
        d, c, w = (
            cfg.hidden_size,
            cfg.linear_num_heads * cfg.linear_head_dim,
            cfg.linear_conv_kernel_dim,
        )
        self.q_proj = nn.Linear(d, c, bias=False)
        self.k_proj = nn.Linear(d, c, bias=False)
        self.v_proj = nn.Linear(d, c, bias=False)
        self.q_conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)  # weight [C, 1, W]
        self.k_conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)
        self.v_conv1d = nn.Conv1d(c, c, w, groups=c, bias=False)
        self.f_proj = nn.Linear(d, c, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(c))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.b_proj = nn.Linear(d, self.h, bias=False)
        self.g_proj = nn.Linear(d, c, bias=False)
        self.o_norm = GatedRMSNorm(self.dh, cfg.rms_norm_eps, torch.sigmoid)
        self.dense = nn.Linear(c, d, bias=False)
        self.safe_gate, self.lower_bound = cfg.kda_safe_gate, cfg.kda_lower_bound
        self.conv = w

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay per key channel [B, T, H, Dh], <= 0."""
        b, t, _ = x.shape
        f = (self.f_proj(x).float() + self.dt_bias.float()).view(b, t, self.h, self.dh)
        rate = self.A_log.float().exp()[:, None]  # [H, 1]
        if self.safe_gate:  # bounded: never decays by more than exp(lower_bound) per token
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f)

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        window, state = recurrent_state(cache, self.layer)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        qkv, window = causal_conv(qkv.transpose(1, 2), weight, window)  # [B, 3C, T]
        q, k, v = (y.reshape(b, self.h, self.dh, t).transpose(2, 3) for y in qkv.chunk(3, dim=1))
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)  # [B, H, T]
        out, state = gated_delta(q, k, v, self.decay(x).transpose(1, 2), beta, state)
        if cache is not None:
            cache.update_state(self.layer, (window, state), t)
        gate = self.g_proj(x).view(b, t, self.h, self.dh)
        return self.dense(self.o_norm(out.transpose(1, 2), gate).reshape(b, t, -1))

    def cache_spec(self) -> StateSpec:
        c = self.h * self.dh
        return StateSpec(((3 * c, self.conv - 1), (self.h, self.dh, self.dh)), (False, True))


class Model(CausalLM):
    embed_name = "word_embeddings"

    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        if cfg.layer_types[i] == "linear_attention":
            mixer = KimiDeltaAttention(cfg, i)
        else:  # DeepSeek-V3 MLA with a sigmoid gate per head; its output projection is `dense`
            mixer = deepseek_v3.MLA(cfg, i, out_name="dense", gated=True)
        if cfg.is_moe_layer(i):
            router = deepseek_v3.Router(cfg.hidden_size, cfg.num_experts, "expert_bias")
            mlp = deepseek_v3.moe(cfg, i, experts(i), router)
        else:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        return DecoderLayer(("attention", mixer), ("mlp", mlp), norm)

    def check_top_k(self, k: int) -> None:
        self.config.check_top_k(k)


sanitize = deepseek_v3.sanitize
# MLA reads kv_b_proj as a matrix (absorbed into the query and the output), not through its
# forward: it stays float (models/int4.py)
NOT_INT4 = ("kv_b_proj",)
KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.expert_bias", "A_log", "dt_bias", "conv1d.weight")
LORA_TARGETS = tuple(
    f"attention.{p}"
    for p in (
        "q_proj",
        "k_proj",
        "v_proj",
        "f_proj",
        "b_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "g_proj",
        "dense",
    )
) + tuple(f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
