"""The full-size shapes edge0 is measured on, as config.json: `edge0 synth --shape NAME`.

- `35b-a3b`: the reference's 35B tier (Edge0-35B-A3B-preview, base Qwen3.5/3.6-35B-A3B),
  qwen3_5_moe: 40 layers, 30 Gated DeltaNet and 10 gated attention (every 4th), hidden 2048,
  256 experts of width 512 plus a shared expert of width 512 with its sigmoid gate, native
  top-8 served at K=4, vocabulary 248,320, untied lm_head. The widths are those of
  ../shared/reference (the audit's header counts and the inventory); the fields that shape
  no tensor (rope, eps, context) are the base model's published config. No vision tower and
  no MTP layers: edge0 never serves them.
- `30b-a3b`: Qwen3-30B-A3B (qwen3_moe): 48 layers, hidden 2048, 32 query and 4 KV heads of
  128, 128 experts of width 768, top-8, vocabulary 151,936, untied.
- `bench`: the decode bench's shape (convert/synth.py's `Shape()` defaults).

Each tier also names the reference's adapters for it: prediction-routed layers from
`start_layer` on (heads owned by the layer before), the K the heads were trained for, and the
recovery LoRA's rank and alpha over every target the family serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tier:
    config: dict
    served_top_k: int | None = None  # None: the native K
    start_layer: int | None = None  # first prediction-routed layer; None: no adapters
    lora_rank: int = 16
    lora_alpha: int = 32
    notes: dict = field(default_factory=dict)


QWEN3_5_35B_TEXT = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "norm_topk_prob": True,
}

TIERS = {
    "35b-a3b": Tier(
        config={
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": QWEN3_5_35B_TEXT,
            "tie_word_embeddings": False,
        },
        served_top_k=4,
        start_layer=7,  # 33 heads, owners 6..38
    ),
    "30b-a3b": Tier(
        config={
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
        },
        start_layer=1,
    ),
}


def tier_config(name: str, layers: int | None = None) -> dict:
    """A tier's config.json; `layers` keeps every width and cuts the depth (tests)."""
    if name not in TIERS:
        raise ValueError(f"unknown shape {name!r}; shapes: bench, {', '.join(TIERS)}")
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TIERS[name].config.items()}
    if layers is not None:
        (cfg.get("text_config") or cfg)["num_hidden_layers"] = layers
    return cfg
