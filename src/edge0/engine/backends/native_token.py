"""A decode token of one request through every decoder layer in one native call.

The native layers (native_layers.py) remove the ATen ops inside a layer, but a token still
makes ~5 op calls a layer with Python between them: the stand-in's call and its argument
checks, the MoE block's hooks, the executor, the pool's lookup, the weighted sum. On the
bench shape that was ~4 ms of a ~19 ms step (`bench --profile`). `edge0.TokenDecoder`
(decode_ops.cpp) makes the same calls on the same tensors in the same order, every layer in
one call, so it computes the same bits; Python runs once a token: the rotary row, as the
model's own forward computes it. The op also looks up an int4 embedding's row (as a module
call, ~12 ATen ops and 0.25 ms a token) and runs the final norm and the LM head (an untied
head it takes as a projection, after an RMSNorm); for other embeddings and heads the modules
run, before and after the call.

A batched decode step of several requests (Engine.step_rows) goes through the same call
(`rows`): each row is computed as its own step computes it, up to
and with the LM head, so each row's logits are its step's bits. Through the layers one by
one such a step also paid the Python of grouping the rows' experts, and its LM head ran
over all rows at once.

It serves a step the engine would take through the exact path with every layer a native
layer: no prerouter (every layer routes by its own router), an MoE block in every layer
with softmax top-k routing on a float router in the activations' dtype and no shared
expert, full rotary of one head size, float caches of one request each, and a pool that
holds every expert of every layer, all loaded (the decoder keeps a table of their tensors).
Any other step returns None and the caller takes the per-layer path. The decoder is built
again when a projection, the router, an adapter's switch or the pool's slots change.

Shape legend: L decoder layers, K active, D hidden, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from edge0 import native
from edge0.engine.backends.native_layers import NativeLayer, projection
from edge0.models.int4 import Int4Embedding
from edge0.models.layers import KVCache, RMSNorm
from edge0.store.pool import ExpertPool


class NativeToken:
    """A decode token of one request, or of each of a batched step's, through every layer
    in one call (see the module docstring); `layers` are the native backend's stand-ins,
    `layout` and `isa` its expert ops' (the pool's arrangement and the kernel path),
    `rows_from` the rows from which a batched step computes each expert once over its rows."""

    def __init__(
        self,
        model: nn.Module,
        layers: dict[int, NativeLayer],
        pool: ExpertPool,
        layout: list[int],
        isa: int,
        cache_dir=None,
        rows_from: int = 0,
    ):
        self.model, self.pool, self.layout, self.isa = model, pool, layout, isa
        self.rows_from = rows_from
        self.stand_ins = [layers[i] for i in range(len(model.backbone.layers))]
        self.num_experts = model.config.num_experts
        self._decoder_class = native.token_decoder(cache_dir)
        self._key: tuple | None = None
        self._decoder = None
        self._head_key: tuple | None = None
        self._head_parts: tuple[list[torch.Tensor], float] | None = None

    @staticmethod
    def servable(model: nn.Module, layers: dict[int, NativeLayer]) -> bool:
        """Whether every decoder layer is a native one the token op can take (as built)."""
        stand_ins = [layers.get(i) for i in range(len(model.backbone.layers))]
        if not stand_ins or any(type(s) is not NativeLayer for s in stand_ins):
            return False
        # full rotary of one head size: the rotary row of a token is every layer's
        head_dims = {s.mixer.head_dim for s in stand_ins}
        plain = all(not (s.mixer.output_gate or s.zero_centred) for s in stand_ins)
        return (
            plain
            and head_dims == {model.rotary.rotary_dim}
            and all(
                s.is_moe and s.route is not None and s.mlp.shared_name is None for s in stand_ins
            )
        )

    def _built(self, dtype: torch.dtype):
        """The decoder for the layers' arguments now, built again where one changed (a
        projection, an adapter's switch, the router, the pool's slots); None where the op
        cannot take them or the pool does not hold every expert loaded."""
        args = [s._static() for s in self.stand_ins]
        gates = [s.route._router() for s in self.stand_ins]
        top_k = [s.mlp.top_k for s in self.stand_ins]
        lm_head = self._head()
        key = (self._pool_key(), *map(id, args), *map(id, gates), *top_k, id(lm_head))
        if key == self._key:
            return self._decoder
        if None in args or None in gates:
            return None
        if any(a[0] != dtype or g[0][0].dtype != dtype for a, g in zip(args, gates, strict=True)):
            return None
        views = self._views()
        if views is None:
            return None  # not yet every expert loaded: not a key, try again next step
        first = self.stand_ins[0]
        decoder = self._decoder_class(first.lanes, first.layout, first.isa, self.layout, self.isa)
        for s, (_, head, one, _), (gate, gate_scale), experts in zip(
            self.stand_ins, args, gates, views, strict=True
        ):
            heads, kv_heads, head_dim, scale = one[:4]
            decoder.add_layer(
                *head,
                heads,
                kv_heads,
                head_dim,
                scale,
                gate,
                gate_scale,
                s.mlp.top_k,
                s.route.norm,
                *([getattr(t, f) for t in experts] for f in ("w13", "p13", "w2", "p2")),
            )
        if lm_head is not None and lm_head[0][0].dtype in (dtype, torch.uint8):
            norm = self.model.backbone.norm
            decoder.set_head(norm.weight, norm.eps, *lm_head)
        embedding = self.model.backbone.embedding()
        if _native_embedding(embedding):
            bits = (embedding.scales.view(torch.bfloat16), embedding.biases.view(torch.bfloat16))
            decoder.set_embedding(embedding.codes, *bits, embedding.dtype == torch.bfloat16)
        self._more(decoder)
        self._key, self._decoder = key, decoder
        return decoder

    def _pool_key(self) -> int:
        """What of the pool the decoder holds: its table of every expert's views, made again
        when an entry left the pool."""
        return self.pool.changes

    def _views(self) -> list[list] | None:
        """Each layer's experts' tensors by index, None until every one is loaded."""
        return self.pool.every_expert(len(self.stand_ins), self.num_experts)

    def _more(self, decoder) -> None:
        """What a decoder of another kind of step is given once it is built."""

    def _head(self) -> tuple[list[torch.Tensor], float] | None:
        """The LM head's tensors and LoRA scale as the op takes a projection's, again only when
        the head or its adapter's switch changed; None where the op does not compute the
        logits (tied embeddings, a head of another kind, a final norm other than RMSNorm)."""
        model = self.model
        head = model._modules.get("lm_head")
        key = (head, None if head is None else head.__dict__.get("enabled"))
        if key != self._head_key:
            self._head_key, self._head_parts = key, None
            servable = head is not None and not model.config.tie_word_embeddings
            if servable and type(model.backbone.norm) is RMSNorm:
                self._head_parts = projection(head)
        return self._head_parts

    def __call__(self, cache: KVCache, token: int) -> torch.Tensor | None:
        """The next logits [1, V] after `token`, written into `cache`; None (nothing done)
        where the op does not serve this step."""
        return self.rows([cache], [token])

    def rows(self, caches: list[KVCache], tokens: list[int]) -> torch.Tensor | None:
        """A decode step of each request (a batched step where several): the next logits
        [B, V] after each one's token, each row its own step's bits, written into its cache;
        None (nothing done) where the op does not serve this step."""
        decoder = self.decoder(caches)
        if decoder is None:
            return None
        out = decoder.step(*self.inputs(decoder, caches, tokens), self.rows_from)
        written(caches, len(self.stand_ins))
        self.pool.count_hits(out[1].numel())  # as the exact path's lookups count them
        return self.logits(out, 2)

    def decoder(self, caches: list[KVCache]):
        """The decoder for a step of these caches, None where it does not serve it."""
        if not all(type(c) is KVCache and not c.quantized and c.k[0].shape[0] == 1 for c in caches):
            return None
        embedding = self.model.backbone.embedding()
        native = _native_embedding(embedding)
        return self._built(embedding.dtype if native else embedding.weight.dtype)

    def inputs(self, decoder, caches: list[KVCache], tokens: list[int]) -> tuple:
        """A step's first arguments: the tokens' embeddings x [B, 1, D], their rotary rows,
        every layer's cache buffers and positions (`written` counts them after the call)."""
        model = self.model
        backbone = model.backbone
        embedding = backbone.embedding()
        if _native_embedding(embedding):
            rows = [decoder.embed(t) for t in tokens]
            x = rows[0] if len(rows) == 1 else torch.cat(rows)
        else:
            x = embedding(torch.tensor([[t] for t in tokens], dtype=torch.long))
        # the rotary rows as a RowsForward computes them (RowCaches.positions): for one
        # request the values of its own forward's, in a [1, 1, 1, Dh] view
        positions = torch.stack([c.positions(1) for c in caches])[:, None]
        cos, sin = model.rotary(positions, x.dtype)
        layers = range(len(self.stand_ins))
        slots = [c.slot(i, 1) for i in layers for c in caches]  # every layer's rows in turn
        n = [c.length[i] for i in layers for c in caches]
        k, v = [s[0] for s in slots], [s[1] for s in slots]
        return x, cos, sin, k, v, n

    def logits(self, out: list[torch.Tensor], at: int) -> torch.Tensor:
        """The next logits [B, V] from a step's results: its own (`out[at]`, where the op ran
        the final norm and the LM head), else the modules' on its last layer's output."""
        if len(out) > at:
            return out[at][:, -1]
        model = self.model
        return model.logits(model.backbone.norm(out[0]))[:, -1]


def written(caches: list[KVCache], layers: int) -> None:
    """After a step's call: each cache's position of every layer counted as written."""
    for c in caches:
        for i in range(layers):
            c.length[i] += 1


def _native_embedding(embedding: nn.Module) -> bool:
    """Whether the decoder looks a token's row up itself (TokenDecoder.embed): an int4
    embedding with rows in bf16 or fp32; else the module does, before the call."""
    return type(embedding) is Int4Embedding and embedding.dtype in (torch.bfloat16, torch.float32)
