"""Qwen3-MoE (`model_type: qwen3_moe`): GQA with q/k RMSNorm, softmax-top-k routed experts.

Layers whose index is in `mlp_only_layers`, or that `decoder_sparse_step` skips, are dense.
Shape legend: B batch, T tokens, D hidden, E experts, K active experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from edge0.models.base import Forward, config_from_dict
from edge0.models.layers import MLP, Attention, KVCache, RMSNorm, RotaryEmbedding
from edge0.routing import softmax_topk


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
    intermediate_size: int = 0
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = None
    model_type: str = "qwen3_moe"

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        if not self.use_sliding_window:
            self.sliding_window = None

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        return config_from_dict(cls, raw, aliases={"num_local_experts": "num_experts"})

    def is_moe_layer(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Config, layer: int, experts: nn.Module):
        super().__init__()
        self.layer = layer
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = experts

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing function, logits [T, E] -> weights, indices [T, K]. The prerouter turns
        its predictions into experts with this same method."""
        return softmax_topk(logits, self.top_k, self.norm_topk_prob)

    def route(self, h: torch.Tensor, fwd: Forward) -> tuple[torch.Tensor, torch.Tensor]:
        logits = fwd.router_logits(self.layer, h, self.gate)  # a prediction replaces the router
        weights, indices = self.select(logits)
        fwd.routed(self.layer, h, logits, indices)
        return weights, indices

    def forward(self, x: torch.Tensor, fwd: Forward) -> torch.Tensor:
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        weights, indices = self.route(h, fwd)
        y = (self.experts(h, indices) * weights[..., None].to(h.dtype)).sum(
            dim=1
        )  # [T, K, D] -> [T, D]
        return y.view(b, t, d)


def attention(cfg: Config, layer: int) -> Attention:
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qk_norm=True,
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        eps=cfg.rms_norm_eps,
        layer=layer,
        window=cfg.sliding_window,
    )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = not isinstance(mlp, MLP)

    def forward(self, x: torch.Tensor, rope, fwd: Forward) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, fwd.cache)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, fwd) if self.is_moe else self.mlp(h))


class Backbone(nn.Module):
    def __init__(self, cfg: Config, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """Causal LM; `experts(layer)` builds each MoE layer's experts (resident or streaming)."""

    def __init__(self, cfg: Config, experts: Callable[[int], nn.Module]):
        super().__init__()
        self.config = cfg
        self.model = Backbone(
            cfg, [self.make_layer(cfg, i, experts) for i in range(cfg.num_hidden_layers)]
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @staticmethod
    def make_layer(cfg: Config, i: int, experts: Callable[[int], nn.Module]) -> nn.Module:
        mlp = (
            SparseMoeBlock(cfg, i, experts(i))
            if cfg.is_moe_layer(i)
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        return DecoderLayer(cfg, attention(cfg, i), mlp)

    @property
    def backbone(self) -> nn.Module:
        """The module holding embed_tokens, layers and norm (families nest it differently)."""
        return self.model

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.config.num_hidden_layers) if self.config.is_moe_layer(i)]

    def moe_block(self, layer: int) -> SparseMoeBlock:
        return self.backbone.layers[layer].mlp

    def new_cache(self) -> KVCache:
        """Fresh per-request state (KV buffers, recurrent states) for this model."""
        return KVCache(self.config.num_hidden_layers)

    def cache_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of per-request state after `tokens` tokens (sizes the resident floor)."""
        cfg = self.config
        per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        return cfg.num_hidden_layers * tokens * per_token

    def set_top_k(self, k: int) -> None:
        """Serve k experts per token instead of the native width."""
        if not 1 <= k <= self.config.num_experts:
            raise ValueError(f"--top-k {k} must be between 1 and {self.config.num_experts}")
        for i in self.moe_layers:
            self.moe_block(i).top_k = k

    def hidden(self, ids: torch.Tensor, fwd: Forward) -> torch.Tensor:
        """ids [B, T] -> final-norm hidden states [B, T, D]."""
        x = self.backbone.embed_tokens(ids)
        start = fwd.position(0)
        rope = self.rotary(torch.arange(start, start + ids.shape[1], device=ids.device), x.dtype)
        for layer in self.backbone.layers:
            x = layer(x, rope, fwd)
        return self.backbone.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return h @ self.backbone.embed_tokens.weight.t()
        return self.lm_head(h)

    def forward(
        self, ids: torch.Tensor, fwd: Forward | None = None, last_only: bool = False
    ) -> torch.Tensor:
        h = self.hidden(ids, fwd or Forward())
        return self.logits(h[:, -1:] if last_only else h)


EXPERT_PREFIX = "model.layers.{layer}.mlp.experts"
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def hf_config(
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    experts: int,
    top_k: int,
    expert_width: int,
    **overrides,
) -> dict:
    """A complete transformers `Qwen3MoeConfig` as a dict (what synth and train teacher write)."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": expert_width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg
