"""Qwen3-MoE (`model_type: qwen3_moe`): GQA with q/k RMSNorm, softmax-top-k routed experts.

Layers whose index is in `mlp_only_layers`, or that `decoder_sparse_step` skips, are dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from torch import nn

from edge0.models.base import config_from_dict
from edge0.models.blocks import CausalLM, DecoderLayer, ExpertsFactory, MoEBlock
from edge0.models.layers import MLP, Attention, RMSNorm
from edge0.models.routing import SoftmaxTopK


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
    rope_scaling: dict | None = None  # a scaled RoPE's parameters (None: default)
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


def attention(cfg: Config, layer: int) -> Attention:
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
        window=cfg.sliding_window,
    )


def moe(cfg: Config, layer: int, experts: nn.Module) -> MoEBlock:
    """Softmax-top-k routed experts; `gate` is the router."""
    gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
    select = SoftmaxTopK(cfg.norm_topk_prob)
    return MoEBlock(layer, gate, select, experts, cfg.num_experts_per_tok)


def mlp(cfg: Config, layer: int, experts: ExpertsFactory) -> nn.Module:
    """The layer's MoE block, or a dense MLP where the config says so."""
    if cfg.is_moe_layer(layer):
        return moe(cfg, layer, experts(layer))
    return MLP(cfg.hidden_size, cfg.intermediate_size)


class Model(CausalLM):
    def decoder_layer(self, cfg: Config, i: int, experts: ExpertsFactory) -> DecoderLayer:
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps)
        return DecoderLayer(("self_attn", attention(cfg, i)), ("mlp", mlp(cfg, i, experts)), norm)


def sanitize(cfg: Config, key: str) -> str | None:
    """A checkpoint tensor's name in the model (None: not served). Qwen3-MoE's are the same."""
    return key


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
