"""Building blocks shared by the model families: norms, rotary embedding, attention, KV cache.

Shape legend: B batch, T new tokens, S cached + new tokens, H query heads, G kv heads,
Dh head dim, D hidden.
"""

from __future__ import annotations

import math

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
    """Default (unscaled) RoPE over the first `rotary_dim` channels of each head.

    The frequencies are derived, not stored, so a model built on the meta device needs no
    buffer fix-up after its weights are loaded.
    """

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=positions.device)
        inv_freq = 1.0 / (self.theta ** (steps / self.rotary_dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


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


class KVCache:
    """One request's per-layer state: growing key/value buffers for attention layers (views are
    handed to attention), a fixed-size state tuple for recurrent layers (linear attention's
    conv window and recurrent matrix). `length[layer]` counts the tokens each layer has seen.

    MLA layers store their compressed latent and rope key as the (k, v) pair.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.state: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
        self.length = [0] * num_layers

    def update_state(self, layer: int, state: tuple[torch.Tensor, ...], t: int) -> None:
        """Replace a recurrent layer's state after it consumed t more tokens."""
        self.state[layer] = state
        self.length[layer] += t

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, G, T, Dh]; return all cached [B, G, S, Dh]."""
        n, t = self.length[layer], k.shape[2]
        buf_k, buf_v = self.k[layer], self.v[layer]
        if buf_k is None or n + t > buf_k.shape[2]:
            cap = max(64, 2 ** math.ceil(math.log2(n + t)))
            new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            if buf_k is not None:
                new_k[:, :, :n] = buf_k[:, :, :n]
                new_v[:, :, :n] = buf_v[:, :, :n]
            self.k[layer], self.v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, n : n + t] = k
        buf_v[:, :, n : n + t] = v
        self.length[layer] = n + t
        return buf_k[:, :, : n + t], buf_v[:, :, : n + t]

    def nbytes(self) -> int:
        tensors = [t for t in self.k + self.v if t is not None]
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
    """GQA self-attention with optional q/k RMSNorm (Qwen3) and optional q/k/v bias (Qwen2)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool,
        qkv_bias: bool,
        o_bias: bool = False,
        eps: float,
        layer: int,
        window: int | None = None,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.layer = heads, kv_heads, head_dim, layer
        self.window = window
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, Dh]
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        return self.o_proj(attend(q, k, v, self.head_dim**-0.5, self.window))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x). Dense layers and shared experts."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
