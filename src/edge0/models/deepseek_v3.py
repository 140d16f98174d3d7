"""DeepSeek-V3 (`model_type: deepseek_v3`): multi-head latent attention (MLA) and sigmoid-group
routed experts plus shared experts; the first `first_k_dense_replace` layers are dense.

MLA caches per token only the normalised KV latent [r] and the shared rope key [dr], not full
keys and values. Attention runs in the latent space: the key up-projection is folded into the
query and the value up-projection is applied after attention, so decode never expands the
cache (which is why `kv_b_proj` is read as a matrix and is not a LoRA target).
Shape legend: B batch, T new tokens, S cached + new tokens, D hidden, H heads, r kv_lora_rank,
dn / dr / dv nope, rope and value head dims, E experts, K active experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory, MoEBlock
from edge0.models.layers import MLP, KVCache, KVSpec, RMSNorm, apply_rotary, attend
from edge0.models.routing import SigmoidGroup

ALIASES = {
    "n_routed_experts": "num_experts",
    "num_local_experts": "num_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    num_key_value_heads: int | None = None
    n_shared_experts: int | None = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers after the decoder
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # a scaled RoPE's parameters (None: default)
    max_position_embeddings: int | None = None  # the positions it was trained for
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.qk_rope_head_dim  # what the rotary embedding spans
        e, g = self.num_experts, self.n_group
        if e % g or e // g < 2:
            raise ValueError(f"n_group {g} must split {e} experts into groups of at least 2")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"topk_group {self.topk_group} must be between 1 and n_group {g}")
        self.check_top_k(self.num_experts_per_tok)

    def check_top_k(self, k: int) -> None:
        eligible = self.topk_group * self.num_experts // self.n_group
        if not 1 <= k <= eligible:
            raise ValueError(
                f"top-k {k} must be between 1 and {eligible} (the experts of topk_group "
                f"{self.topk_group} groups)"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        return config_from_dict(cls, raw, aliases=ALIASES)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs stored as (x0, x1), (x2, x3)... -> halves [x0 x2 ..., x1 x3 ...]. Queries
    and keys get the same permutation, so their dot products are unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLA(nn.Module):
    """Multi-head latent attention; its cache: (latent [B, 1, S, r], rope key [B, 1, S, dr]).

    `out_name` is the checkpoint's name of the output projection; `gated` adds Ling's sigmoid
    gate per head (`g_proj`) on the attention output.
    """

    def __init__(self, cfg: Config, layer: int, out_name: str = "o_proj", gated: bool = False):
        super().__init__()
        self.layer, self.interleave = layer, cfg.rope_interleave
        self.h, self.r = cfg.num_attention_heads, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        d, bias, q_out = cfg.hidden_size, cfg.attention_bias, self.h * (self.dn + self.dr)
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(d, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.dn + self.dv), bias=False)
        self.out_name = out_name
        self.add_module(out_name, nn.Linear(self.h * self.dv, d, bias=bias))
        self.gated = gated
        if gated:
            self.g_proj = nn.Linear(d, self.h, bias=False)
        self.scale = (self.dn + self.dr) ** -0.5 * yarn_mscale(cfg.rope_scaling) ** 2

    def forward(self, x: torch.Tensor, rope, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        out = self.heads(x, rope, cache)  # [B, T, H, dv]
        if self.gated:
            out = out * torch.sigmoid(self.g_proj(x).float()).to(x.dtype)[..., None]
        return self._modules[self.out_name](out.reshape(b, t, self.h * self.dv))

    def cache_spec(self) -> KVSpec:
        return KVSpec(1, self.r, self.dr)

    def heads(self, x: torch.Tensor, rope, cache: KVCache | None) -> torch.Tensor:
        """Attention output per head [B, T, H, dv], before the output projection."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(b, t, self.h, -1).transpose(1, 2).split([self.dn, self.dr], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)
        latent, k_rope = self.kv_a_layernorm(latent)[:, None], k_rope[:, None]  # [B, 1, T, *]
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, *rope), apply_rotary(k_rope, *rope)
        w_uk, w_uv = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r).split(
            [self.dn, self.dv], dim=1
        )  # [H, dn, r], [H, dv, r]
        q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # the key up-projection, folded
        q = torch.cat([q_lat, q_rope], dim=-1)  # [B, H, T, r + dr]
        scale = self.scale

        def over(q, latent, k_rope):  # k [B, 1, S, r + dr], shared by all heads
            return attend(q, torch.cat([latent, k_rope], dim=-1), latent, scale)

        if cache is None:
            out = over(q, latent, k_rope)
        else:
            out = cache.attend(self.layer, q, latent, k_rope, over)
        out = out.view(b, t, self.h, self.r)
        return torch.einsum("bthr,hvr->bthv", out, w_uv)  # the value up-projection


def yarn_mscale(scaling: dict | None) -> float:
    """A scaled RoPE's factor on the attention scores' scale (squared there), as DeepSeek-V3
    applies it: 0.1 * mscale_all_dim * ln(factor) + 1 where the parameters set mscale_all_dim
    and the factor is above 1; else 1."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = scaling.get("factor") or 1.0
    return 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0


class Router(nn.Module):
    """The gate: fp32 logits, and the per-expert bias (`bias_name` in the checkpoint) that
    steers selection only."""

    def __init__(self, hidden: int, num_experts: int, bias_name: str = "e_score_correction_bias"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias_name = bias_name
        self.register_buffer(bias_name, torch.zeros(num_experts))

    @property
    def bias(self) -> torch.Tensor:
        return self._buffers[self.bias_name]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.float(), self.weight.float())


def moe(cfg: Config, layer: int, experts: nn.Module, router: Router) -> MoEBlock:
    """Sigmoid-group routed experts plus resident shared experts (if the config has them)."""
    select = SigmoidGroup(
        cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor
    )
    shared = None
    if cfg.n_shared_experts:
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        shared = ("shared_experts", MLP(cfg.hidden_size, inter))
    return MoEBlock(layer, router, select, experts, cfg.num_experts_per_tok, shared=shared)


class Model(CausalLM):
    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        mlp = (
            moe(cfg, i, experts(i), Router(cfg.hidden_size, cfg.num_experts))
            if cfg.is_moe_layer(i)
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        return DecoderLayer(("self_attn", MLA(cfg, i)), ("mlp", mlp), norm)

    def check_top_k(self, k: int) -> None:
        self.config.check_top_k(k)


def sanitize(cfg: Config, key: str) -> str | None:
    """Multi-token-prediction layers, stored as decoder layers past the last one, are not
    served."""
    extra = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return None if any(key.startswith(f"model.layers.{i}.") for i in extra) else key


# MLA reads kv_b_proj as a matrix (absorbed into the query and the output), not through its
# forward: it stays float (models/int4.py)
NOT_INT4 = ("kv_b_proj",)
KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # as transformers does
LORA_TARGETS = tuple(
    f"self_attn.{p}" for p in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
) + tuple(f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
