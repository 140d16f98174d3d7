"""The decoder skeleton every family assembles from its declared pieces.

  MoEBlock      router -> select -> experts -> weighted sum (+ an optional shared expert)
  DecoderLayer  x + mixer(norm(x)), then x + mlp(norm(x))
  Backbone      embeddings, layers, final norm
  CausalLM      the model: backbone, rotary, LM head, caches, top-k

A family subclasses CausalLM and declares `decoder_layer` (its mixer, MLP and norm per layer)
plus, where its checkpoint differs, the embedding name, the nesting of the backbone and the
rotary width. Module names are the checkpoint's, so the state dict loads as stored. Every
MoE block routes through `Forward`, so prediction-as-routing and the engine's executors reach
every family without the family knowing of them.
Shape legend: B batch, T tokens, D hidden, E experts, K active experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from edge0.formats.format import INT4
from edge0.models.base import Forward
from edge0.models.int4 import Int4Embedding
from edge0.models.layers import KVCache, RMSNorm, RotaryEmbedding

# (logits [T, E], k, the block's gate) -> (weights [T, K], indices [T, K]); see routing.py
Select = Callable[[torch.Tensor, int, nn.Module], tuple[torch.Tensor, torch.Tensor]]
ExpertsFactory = Callable[[int], nn.Module]


class MoEBlock(nn.Module):
    """Routed experts plus an optional shared expert, gated by a sigmoid or not.

    `shared` is (name, module): families store it as `shared_expert` or `shared_experts`.
    """

    def __init__(
        self,
        layer: int,
        gate: nn.Module,
        select: Select,
        experts: nn.Module,
        top_k: int,
        shared: tuple[str, nn.Module] | None = None,
        shared_gate: nn.Module | None = None,
    ):
        super().__init__()
        self.layer, self.top_k, self.selector = layer, top_k, select
        self.gate = gate
        self.experts = experts
        self.shared_name = None
        if shared is not None:
            self.shared_name = shared[0]
            self.add_module(*shared)
        if shared_gate is not None:
            self.shared_expert_gate = shared_gate
        self.gated_shared = shared_gate is not None

    def select(
        self, logits: torch.Tensor, k: int | None = None, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing function, logits [T, E] -> weights, indices [T, k] (default: the
        block's K), among the `allowed` experts [T, E] if given. The prerouter turns its
        predictions into experts with this same method."""
        return self.selector(logits, k or self.top_k, self.gate, allowed)

    def route(
        self, h: torch.Tensor, fwd: Forward
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, D] -> the routing logits [T, E] (the router's, or the call's prediction) and
        the weights and indices [T, K] they select."""
        logits = fwd.router_logits(self.layer, h, self.gate)  # a prediction replaces the router
        weights, indices = self.select(logits, allowed=fwd.allowed.get(self.layer))
        return logits, weights, indices

    def parts(
        self,
        h: torch.Tensor,
        fwd: Forward,
        route: Callable | None = None,
        each: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the block sums, h [T, D] -> each token's routed experts [T, K, D], their
        weights [T, K] and the shared expert's output [T, D] (None without one). `route`
        stands in for the block's (the same function, computed another way); `each(f, h)`,
        if given, computes the shared expert f on h (on each row alone, say)."""
        logits, weights, indices = (route or self.route)(h, fwd)
        fwd.routed(self.layer, h, logits, indices)
        routed = fwd.experts(self.layer, self.experts)(h, indices)  # [T, K, D]
        s = None
        if self.shared_name is not None:
            s = each(self.shared_output, h) if each is not None else self.shared_output(h)
        return routed, weights, s

    def shared_output(self, h: torch.Tensor) -> torch.Tensor:
        """The shared expert's output on h [T, D], under its gate if it has one."""
        s = self._modules[self.shared_name](h)
        if self.gated_shared:
            s = torch.sigmoid(self.shared_expert_gate(h)) * s
        return s

    def forward(self, x: torch.Tensor, fwd: Forward) -> torch.Tensor:
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        routed, weights, s = self.parts(h, fwd)
        y = (routed * weights[..., None].to(h.dtype)).sum(dim=1)  # [T, D]
        if s is not None:
            y = y + s
        return y.view(b, t, d)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer. `mixer` and `mlp` are (name, module) under checkpoint names;
    the mixer is called as mixer(x, rope, cache), an MoE mlp as mlp(x, fwd)."""

    def __init__(
        self,
        mixer: tuple[str, nn.Module],
        mlp: tuple[str, nn.Module],
        norm: Callable[[], nn.Module],
    ):
        super().__init__()
        self.mixer_name, self.mlp_name = mixer[0], mlp[0]
        self.add_module(*mixer)
        self.add_module(*mlp)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.is_moe = isinstance(mlp[1], MoEBlock)

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_name]

    @property
    def mlp_block(self) -> nn.Module:
        return self._modules[self.mlp_name]

    def forward(self, x: torch.Tensor, rope, fwd: Forward) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), rope, fwd.cache)
        h = self.post_attention_layernorm(x)
        mlp = self.mlp_block
        return x + (mlp(h, fwd) if self.is_moe else mlp(h))


class Backbone(nn.Module):
    """Token embeddings (under the checkpoint's name), decoder layers, final norm."""

    def __init__(
        self, embed_name: str, vocab: int, hidden: int, layers: list[nn.Module], norm: nn.Module
    ):
        super().__init__()
        self.embed_name = embed_name
        self.add_module(embed_name, nn.Embedding(vocab, hidden))
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def embedding(self) -> nn.Embedding:
        return self._modules[self.embed_name]


class CausalLM(nn.Module):
    """A family's causal LM; `experts(layer)` builds each MoE layer's experts module
    (resident float weights, or a slot the engine's executors fill per call)."""

    embed_name = "embed_tokens"
    nest: str | None = None  # the backbone's extra level in the checkpoint, if any

    def __init__(self, cfg, experts: ExpertsFactory):
        super().__init__()
        self.config = cfg
        layers = [self.decoder_layer(cfg, i, experts) for i in range(cfg.num_hidden_layers)]
        backbone = Backbone(
            self.embed_name, cfg.vocab_size, cfg.hidden_size, layers, self.final_norm(cfg)
        )
        self.model = nn.ModuleDict({self.nest: backbone}) if self.nest else backbone
        self.rotary = RotaryEmbedding(
            self.rotary_dim(cfg),
            cfg.rope_theta,
            cfg.rope_scaling,
            getattr(cfg, "max_position_embeddings", None),
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # -- what a family declares ---------------------------------------------------------------

    def decoder_layer(self, cfg, i: int, experts: ExpertsFactory) -> DecoderLayer:
        raise NotImplementedError

    def final_norm(self, cfg) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rotary_dim(self, cfg) -> int:
        return cfg.head_dim

    def check_top_k(self, k: int) -> None:
        """ValueError unless k experts per token can be served (a family may narrow it)."""
        if not 1 <= k <= self.config.num_experts:
            raise ValueError(f"top_k {k} must be between 1 and {self.config.num_experts}")

    # -- shared -------------------------------------------------------------------------------

    @property
    def backbone(self) -> Backbone:
        return self.model[self.nest] if self.nest else self.model

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.config.num_hidden_layers) if self.config.is_moe_layer(i)]

    def moe_block(self, layer: int) -> MoEBlock:
        return self.backbone.layers[layer].mlp_block

    def moe_block_path(self, layer: int) -> str:
        """The MoE block's name in the state dict, e.g. `model.layers.3.mlp`."""
        block = self.moe_block(layer)
        return next(name for name, mod in self.named_modules() if mod is block)

    def new_cache(
        self,
        max_context: int,
        dtype: torch.dtype = torch.float32,
        batch: int = 1,
        device: torch.device | str | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> KVCache:
        """Per-request state for up to max_context tokens, allocated now (on the meta device,
        its `nbytes()` sizes the state without memory); keys and values stored in `kv_dtype`
        (default: `dtype`)."""
        specs = [layer.mixer.cache_spec() for layer in self.backbone.layers]
        return KVCache(specs, max_context, dtype, batch, device, kv_dtype)

    def int4_weights(self, not_int4: tuple[str, ...] = ()) -> set[str]:
        """State-dict names of the weights a converted directory stores as int4: every
        nn.Linear whose shape fits the kernel (out % 32, in % 64) and the token embedding,
        except the routers (their logits decide the routing) and names ending in `not_int4`
        (weights used as matrices, not through their forward). Works on the meta device."""
        gates = {id(m.gate) for m in self.modules() if isinstance(m, MoEBlock)}
        tied = self.config.tie_word_embeddings
        out = set()
        for name, m in self.named_modules():
            if id(m) in gates or name.endswith(not_int4):
                continue
            if isinstance(m, nn.Linear):
                n, k = m.weight.shape
                if n % INT4.block_rows == 0 and k % INT4.group_size == 0:
                    out.add(f"{name}.weight")
            elif isinstance(m, nn.Embedding):
                v, d = m.weight.shape
                if d % INT4.group_size == 0 and (not tied or v % INT4.block_rows == 0):
                    out.add(f"{name}.weight")
        return out

    def set_top_k(self, k: int) -> None:
        """Serve k experts per token instead of the native width."""
        self.check_top_k(k)
        for i in self.moe_layers:
            self.moe_block(i).top_k = k

    def hidden(self, ids: torch.Tensor, fwd: Forward) -> torch.Tensor:
        """ids [B, T] -> final-norm hidden states [B, T, D]."""
        x = self.backbone.embedding()(ids)
        rope = self.rotary(fwd.positions(ids.shape[1], ids.device), x.dtype)
        for i, layer in enumerate(self.backbone.layers):
            x = fwd.layer(i, layer)(x, rope, fwd)
        return self.backbone.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            emb = self.backbone.embedding()
            if isinstance(emb, Int4Embedding):
                return emb.project(h)
            return h @ emb.weight.t()
        return self.lm_head(h)

    def forward(
        self, ids: torch.Tensor, fwd: Forward | None = None, last_only: bool = False
    ) -> torch.Tensor:
        h = self.hidden(ids, fwd or Forward())
        return self.logits(h[:, -1:] if last_only else h)
