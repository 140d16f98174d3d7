"""Building blocks shared by the model families: norms, rotary embedding, attention, KV cache.

Shape legend: B batch, T new tokens, S cached + new tokens, H query heads, G kv heads,
Dh head dim, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE over the first `rotary_dim` channels of each head: default, or scaled as
    `scaling` (a config's rope_parameters: yarn, linear, dynamic, llama3, longrope) says, with
    transformers' own functions for the frequencies and the attention factor (RopeScaling).

    The frequencies are derived, not stored, so a model built on the meta device needs no
    buffer fix-up after its weights are loaded.
    """

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        scaling: dict | None = None,
        max_positions: int | None = None,
    ):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        self.scaling = RopeScaling(rotary_dim, theta, scaling, max_positions) if scaling else None

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scaling is not None:
            return self.scaling(positions, dtype)
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (steps / self.rotary_dim))
        freqs = positions.float()[..., None] * inv_freq  # [..., T, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeScaling:
    """A scaled RoPE's cos and sin, from transformers' init function for its type (the one
    its models use), then scaled by the function's attention factor, as transformers' rotary
    embeddings do. A dynamic or longrope type depends on the sequence's length: its
    frequencies are those for the forward's largest position, as transformers' models update
    them from the position ids of each forward."""

    LENGTH_DEPENDENT = ("dynamic", "longrope")

    def __init__(self, rotary_dim: int, theta: float, scaling: dict, max_positions: int | None):
        from transformers import PreTrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.rope_type = scaling["rope_type"]
        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"config.json: rope type {self.rope_type!r} is not supported; supported: "
                f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
            )
        self.init = ROPE_INIT_FUNCTIONS[self.rope_type]
        # what the function reads: the rope parameters, the head's rotary width (rotary_dim,
        # already the partial width where a family rotates part of the head), the context
        params = {**scaling, "rope_theta": theta, "partial_rotary_factor": 1.0}
        self.config = PreTrainedConfig(
            rope_parameters=params,
            max_position_embeddings=max_positions,
            head_dim=rotary_dim,
            hidden_size=rotary_dim,
            num_attention_heads=1,
        )
        self._cached: tuple[torch.Tensor, float] | None = None

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [rot/2], attention factor) for a sequence of seq_len."""
        if self.rope_type in self.LENGTH_DEPENDENT:
            inv_freq, factor = self.init(self.config, None, seq_len=seq_len)
            return inv_freq.float(), float(factor)
        if self._cached is None:
            inv_freq, factor = self.init(self.config, None)
            self._cached = inv_freq.float(), float(factor)
        return self._cached

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, factor = self.frequencies(int(positions.max()) + 1)
        freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., T, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, Dh]; rotates the first cos.shape[-1] channels, passes the rest through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


@dataclass(frozen=True)
class KVSpec:
    """An attention layer's cache: keys [B, heads, S, k_dim] and values [B, heads, S, v_dim].
    MLA stores its compressed latent and rope key as the (k, v) pair."""

    heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class StateSpec:
    """A recurrent layer's fixed-size state, one tensor per shape (batch dim prepended);
    `fp32` marks the ones kept in fp32 whatever the compute dtype (the delta-rule matrix)."""

    shapes: tuple[tuple[int, ...], ...]
    fp32: tuple[bool, ...]


class ContextOverflow(ValueError):
    """More tokens than the cache was allocated for."""


KV_BLOCK = 32  # channels per int8 scale (KVCache with kv_dtype int8)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Dh] -> (int8 codes [..., Dh], fp16 scales [..., Dh / block]): one symmetric
    scale per block of KV_BLOCK channels of each token's head (the whole head where Dh is not
    a multiple of it), absmax / 127 rounded to fp16 before it divides, so codes and scale
    agree. Elementwise IEEE arithmetic: the same codes on every CPU."""
    dim = x.shape[-1]
    block = KV_BLOCK if dim % KV_BLOCK == 0 else dim
    xb = x.float().unflatten(-1, (dim // block, block))
    scale = (xb.abs().amax(-1) / 127).half()
    s = scale.float()[..., None]
    codes = torch.where(s > 0, xb / s.clamp(min=torch.finfo(torch.float16).tiny), 0)
    return codes.round_().clamp_(-127, 127).to(torch.int8).flatten(-2), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_kv's inverse, into `dtype`."""
    blocks = scale.shape[-1]
    x = codes.unflatten(-1, (blocks, -1)).float() * scale.float()[..., None]
    return x.flatten(-2).to(dtype)


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


class KVCache:
    """One request's per-layer state, allocated once for `max_context` tokens (built on the
    meta device it sizes the state without memory). Attention layers get key/value buffers
    (views of the filled part are handed to attention); recurrent layers get their fixed-size
    state (conv window, recurrent matrix), zero at the start. `length[layer]` counts the tokens
    each layer has seen.

    Keys and values are stored in `kv_dtype` (default: the compute dtype `dtype`) and handed
    to attention in the dtype they were computed in: bf16 rounds them once as they are
    stored; int8 keeps codes and an fp16 scale per block of channels (quantize_kv) and
    dequantizes the filled part for each forward. Recurrent states stay at the compute dtype
    (the delta-rule matrix in fp32: StateSpec).
    """

    def __init__(
        self,
        specs: list[KVSpec | StateSpec],
        max_context: int,
        dtype: torch.dtype,
        batch: int = 1,
        device: torch.device | str | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        self.max_context = max_context
        self.kv_dtype = kv_dtype or dtype
        self.quantized = self.kv_dtype == torch.int8
        n = len(specs)
        self.k: list[torch.Tensor | None] = [None] * n
        self.v: list[torch.Tensor | None] = [None] * n
        self.k_scale: list[torch.Tensor | None] = [None] * n  # int8 only
        self.v_scale: list[torch.Tensor | None] = [None] * n
        self._state: list[tuple[torch.Tensor, ...] | None] = [None] * n
        for i, spec in enumerate(specs):
            if isinstance(spec, KVSpec):
                shape = (batch, spec.heads, max_context)
                self.k[i] = torch.empty(*shape, spec.k_dim, dtype=self.kv_dtype, device=device)
                self.v[i] = torch.empty(*shape, spec.v_dim, dtype=self.kv_dtype, device=device)
                if self.quantized:
                    for scales, d in ((self.k_scale, spec.k_dim), (self.v_scale, spec.v_dim)):
                        blocks = d // KV_BLOCK if d % KV_BLOCK == 0 else 1
                        scales[i] = torch.empty(*shape, blocks, dtype=torch.float16, device=device)
            else:
                self._state[i] = tuple(
                    torch.zeros(batch, *shape, dtype=torch.float32 if f else dtype, device=device)
                    for shape, f in zip(spec.shapes, spec.fp32, strict=True)
                )
        self.length = [0] * n

    def _buffers(self) -> list[list[torch.Tensor | None]]:
        """Every per-position buffer list: keys, values (and their scales when int8)."""
        return [self.k, self.v, self.k_scale, self.v_scale]

    def state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """A recurrent layer's state, or None before its first token (the layer then starts
        from zeros itself: the same numbers, without reading the buffers)."""
        return self._state[layer] if self.length[layer] else None

    def update_state(self, layer: int, state: tuple[torch.Tensor, ...], t: int) -> None:
        """Store a recurrent layer's state after it consumed t more tokens."""
        self._check(layer, t)
        for buf, new in zip(self._state[layer], state, strict=True):
            buf.copy_(new)
        self.length[layer] += t

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, G, T, *]; return all cached [B, G, S, *] in k's dtype."""
        n, t = self.length[layer], k.shape[2]
        self._check(layer, t)
        s = n + t
        self.length[layer] = s
        if self.quantized:
            out = []
            for new, codes, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
                c, sc = quantize_kv(new)
                codes[layer][:, :, n:s], scales[layer][:, :, n:s] = c, sc
                out.append(dequantize_kv(codes[layer][:, :, :s], scales[layer][:, :, :s], k.dtype))
            return out[0], out[1]
        buf_k, buf_v = self.k[layer], self.v[layer]
        buf_k[:, :, n:s] = k
        buf_v[:, :, n:s] = v
        return buf_k[:, :, :s].to(k.dtype), buf_v[:, :, :s].to(v.dtype)

    def slot(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's whole key and value buffers [B, G, max_context, *], for a caller that
        writes t tokens at `length[layer]` itself and then advances the length (the native
        attention op, which takes float buffers, not int8 ones); ContextOverflow if they do
        not fit."""
        assert not self.quantized, "an int8 cache is written through update()"
        self._check(layer, t)
        return self.k[layer], self.v[layer]

    def state_slot(self, layer: int, t: int) -> tuple[torch.Tensor, ...]:
        """A recurrent layer's state buffers, for a caller that advances them by t tokens in
        place and then the length (the native delta-rule op); zeros before the layer's first
        token (what state() stands for then), ContextOverflow if t more do not fit."""
        self._check(layer, t)
        buffers = self._state[layer]
        if not self.length[layer]:
            for buf in buffers:
                buf.zero_()
        return buffers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn):
        """Append k, v [B, G, T, *] and return fn(q, all cached keys, all cached values): the
        attention of a mixer over what this cache holds (see RowCaches)."""
        k, v = self.update(layer, k, v)
        return fn(q, k, v)

    def attend_scaled(self, layer, q, k, v, scale: float, window: int | None) -> torch.Tensor:
        """attend() with layers.attend: causal GQA attention -> [B, T, H*Dh]."""
        return self.attend(layer, q, k, v, lambda q, k, v: attend(q, k, v, scale, window))

    def positions(self, t: int, device=None) -> torch.Tensor:
        """The positions [T] of the next t tokens (those every layer will have seen)."""
        n = self.length[0]
        return torch.arange(n, n + t, device=device)

    def _check(self, layer: int, t: int) -> None:
        if self.length[layer] + t > self.max_context:
            raise ContextOverflow(
                f"{self.length[layer]} + {t} tokens exceed the {self.max_context}-token context "
                "this cache was allocated for"
            )

    def touched_bytes(self) -> int:
        """Bytes a step of attention reads at the current lengths: every layer's filled keys
        and values (their scales too when int8), and every recurrent layer's whole state."""
        total = 0
        for buffers in self._buffers():
            for layer, t in enumerate(buffers):
                if t is not None:
                    per_position = t[:, :, :1].numel() * t.element_size()
                    total += per_position * self.length[layer]
        total += sum(t.numel() * t.element_size() for s in self._state if s for t in s)
        return total

    def nbytes(self) -> int:
        tensors = [t for ts in self._buffers() for t in ts if t is not None]
        tensors += [t for s in self._state if s is not None for t in s]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (which cannot be cut back to a prefix)."""
        return any(s is not None for s in self._state)

    def uniform_length(self) -> int | None:
        """The tokens every layer has seen, or None if a forward stopped partway."""
        n = self.length[0]
        return n if all(m == n for m in self.length) else None

    def snapshot_nbytes(self, n: int) -> int:
        """Bytes a snapshot of the first n positions takes (see snapshot)."""
        per_position = sum(
            t[:, :, :1].numel() * t.element_size()
            for ts in self._buffers()
            for t in ts
            if t is not None
        )
        states = sum(t.numel() * t.element_size() for s in self._state if s is not None for t in s)
        return n * per_position + states

    def snapshot(self, n: int | None = None) -> CacheSnapshot:
        """A copy of the first n positions (default: all it holds). Attention keys and values
        can be cut at any n; recurrent states only at the cache's (uniform) length."""
        length = self.uniform_length()
        assert length is not None, "snapshot of a cache a forward left half-updated"
        n = length if n is None else n
        assert 0 <= n <= length and (n == length or not self.recurrent), (n, length)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:  # [B, G, n, *], owning memory
            return None if t is None else t[:, :, :n].clone(memory_format=torch.contiguous_format)

        states = [None if s is None else tuple(t.clone() for t in s) for s in self._state]
        buffers = [[cut(t) for t in ts] for ts in self._buffers()]
        return CacheSnapshot(n, buffers, states)

    def copy_row(self, batch: KVCache, row: int, n: int) -> None:
        """Make this (empty, one-row) cache hold the first n positions of `batch`'s row `row`:
        keys and values only (a recurrent state cannot be cut to a row's length)."""

        def rows(ts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            return [None if t is None else t[row : row + 1] for t in ts]

        assert not batch.recurrent, "a recurrent state cannot be cut to a row's length"
        assert batch.kv_dtype == self.kv_dtype, (batch.kv_dtype, self.kv_dtype)
        buffers = [rows(ts) for ts in batch._buffers()]
        self.restore(CacheSnapshot(n, buffers, [None] * len(batch.k)), n)

    def restore(self, snap: CacheSnapshot, n: int) -> None:
        """Make this cache hold the first n positions of `snap`. Attention keys and values cut
        back to any n; a recurrent state exists only at the length it was taken at."""
        if not 0 < n <= min(snap.length, self.max_context):
            raise ValueError(f"cannot restore {n} positions of a {snap.length}-token snapshot")
        if snap.recurrent and n != snap.length:
            raise ValueError(
                f"a recurrent state of {snap.length} tokens cannot be cut back to {n} tokens"
            )
        for i in range(len(self.length)):
            for bufs, saved in zip(self._buffers(), snap.buffers, strict=True):
                if bufs[i] is not None:
                    bufs[i][:, :, :n] = saved[i][:, :, :n]
            if self._state[i] is not None:
                for buf, saved in zip(self._state[i], snap.state[i], strict=True):
                    buf.copy_(saved)
            self.length[i] = n


class RowCaches:
    """B requests' one-row caches as the cache of one forward of B rows (a batched decode
    step): each row's keys and values go into its own cache at its own position and each row
    attends over its own (rows differ in length, so attention runs row by row); recurrent
    states are gathered into one batch and written back per row. Rotary positions are each
    row's own ([B, 1, T]: broadcast over heads)."""

    def __init__(self, rows: list[KVCache], attend_rows: Callable | None = None):
        self.rows, self.attend_rows = rows, attend_rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn):
        return torch.cat(
            [
                c.attend(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1], fn)
                for i, c in enumerate(self.rows)
            ]
        )

    def attend_scaled(self, layer, q, k, v, scale: float, window: int | None) -> torch.Tensor:
        """attend() with layers.attend; a token a row without a window in one call of the
        native op (`attend_rows`, native/decode_ops.cpp), which does the same per row."""
        if (
            self.attend_rows is None
            or window is not None
            or q.shape[2] != 1
            or any(c.quantized for c in self.rows)
        ):
            return self.attend(layer, q, k, v, lambda q, k, v: attend(q, k, v, scale, window))
        slots = [c.slot(layer, 1) for c in self.rows]
        n = [c.length[layer] for c in self.rows]
        out = self.attend_rows(q, k, v, [s[0] for s in slots], [s[1] for s in slots], n, scale)
        for c in self.rows:
            c.length[layer] += 1
        return out

    def positions(self, t: int, device=None) -> torch.Tensor:
        return torch.stack([c.positions(t, device) for c in self.rows])[:, None]  # [B, 1, T]

    def state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        states = [c.state(layer) for c in self.rows]
        if any(s is None for s in states):
            assert all(s is None for s in states), "rows at different starts of a recurrence"
            return None
        return tuple(torch.cat(parts) for parts in zip(*states, strict=True))

    def update_state(self, layer: int, state: tuple[torch.Tensor, ...], t: int) -> None:
        for i, c in enumerate(self.rows):
            c.update_state(layer, tuple(s[i : i + 1] for s in state), t)


@dataclass
class CacheSnapshot:
    """A copy of a KVCache's first `length` positions: keys and values [B, G, length, *] of
    attention layers (KVCache._buffers: with their scales when int8), and recurrent layers'
    states after exactly `length` tokens."""

    length: int
    buffers: list[list[torch.Tensor | None]]
    state: list[tuple[torch.Tensor, ...] | None]

    @property
    def recurrent(self) -> bool:
        return any(s is not None for s in self.state)

    def nbytes(self) -> int:
        tensors = [t for ts in self.buffers for t in ts if t is not None]
        tensors += [t for s in self.state if s is not None for t in s]
        return sum(t.numel() * t.element_size() for t in tensors)


def causal_mask(t: int, s: int, device, window: int | None = None) -> torch.Tensor | None:
    """Boolean [T, S] mask (True = attend) for T new tokens after S - T cached ones."""
    if t == 1 and window is None:
        return None
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal GQA attention: q [B, H, T, Dh], k/v [B, G, S, Dh] -> [B, T, H*Dh]."""
    b, h, t, _ = q.shape
    s = k.shape[2]
    gqa = k.shape[1] != h
    if t == s and window is None:  # plain prefill: let SDPA build the causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=scale, enable_gqa=gqa)
    else:
        mask = causal_mask(t, s, q.device, window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(b, t, -1)


class Attention(nn.Module):
    """GQA self-attention. Per family: q/k RMSNorm per head (Qwen3, Qwen3.5) or over the whole
    projection (OLMoE), q/k/v bias (Qwen2), q/k/v clipping (OLMoE), sliding window (Mixtral),
    and a sigmoid output gate that q_proj computes beside each head's query (Qwen3.5)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        qk_norm: str | None,
        qkv_bias: bool,
        o_bias: bool = False,
        eps: float,
        layer: int,
        window: int | None = None,
        clip: float | None = None,
        output_gate: bool = False,
        norm: type[nn.Module] = RMSNorm,
    ):
        super().__init__()
        if qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', not {qk_norm!r}")
        self.heads, self.kv_heads, self.head_dim, self.layer = heads, kv_heads, head_dim, layer
        self.window, self.clip, self.qk_norm, self.output_gate = window, clip, qk_norm, output_gate
        q_out = heads * head_dim * (2 if output_gate else 1)  # per head: [query | gate]
        self.q_proj = nn.Linear(hidden, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm == "head":
            self.q_norm, self.k_norm = norm(head_dim, eps), norm(head_dim, eps)
        elif qk_norm == "full":
            self.q_norm = norm(heads * head_dim, eps)
            self.k_norm = norm(kv_heads * head_dim, eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        gate = None
        if self.output_gate:
            q, gate = q.view(b, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, Dh]
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scale, window = self.head_dim**-0.5, self.window
        if cache is None:
            out = attend(q, k, v, scale, window)  # [B, T, H*Dh]
        else:
            out = cache.attend_scaled(self.layer, q, k, v, scale, window)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(out)

    def cache_spec(self) -> KVSpec:
        return KVSpec(self.kv_heads, self.head_dim, self.head_dim)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x). Dense layers and shared experts."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose stored weight w scales by (1 + w) (Qwen3.5/3.6)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times act(gate): the output norm of linear-attention
    layers (SiLU in Gated DeltaNet, sigmoid in Kimi Delta Attention). Computed in fp32."""

    def __init__(self, dim: int, eps: float, act=F.silu):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.act = eps, act

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x * self.act(gate.float())).to(dtype)
