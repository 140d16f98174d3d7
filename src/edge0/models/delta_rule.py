"""The gated delta rule of linear-attention layers (Gated DeltaNet, Kimi Delta Attention).

Per head the state S [Dk, Dv] decays by exp(g_t) along its key rows, then the delta rule writes
the part of v_t it does not yet predict:  u_t = beta_t (v_t - S^T k_t),  S += k_t u_t^T,
o_t = S^T q_t. The decay g is log-space and <= 0: one value per head (Gated DeltaNet) or one per
key channel (KDA). Two forms compute the same thing: `recurrent` (one token at a time: decode)
and `chunked` (a triangular solve per chunk of tokens: prefill); `gated_delta` picks one.

Shape legend: B batch, H value heads, T tokens, C chunk, Dk key dim, Dv value dim,
Dg decay width (1 or Dk). States are fp32 whatever the activations are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def recurrent_state(cache, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear-attention layer's (conv window, recurrent state) from a KVCache, or
    (None, None) without a cache or before the layer's first token: both start at zeros."""
    prev = None if cache is None else cache.state(layer)
    return prev or (None, None)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [B, Ch, T], weight [Ch, 1, W], window [B, Ch, W-1] (the
    previous inputs; zeros at the start) -> (out [B, Ch, T], the new window)."""
    w = weight.shape[-1]
    if window is None:
        window = x.new_zeros(x.shape[0], x.shape[1], w - 1)
    xs = torch.cat([window.to(x.dtype), x], dim=-1)  # [B, Ch, W-1+T]
    t, taps = x.shape[-1], weight[:, 0].to(x.dtype)  # [Ch, W]
    # W shifted multiply-adds: far cheaper than a grouped conv1d call for W = 4
    out = sum(taps[:, i, None] * xs[:, :, i : i + t] for i in range(w))
    return F.silu(out), xs[:, :, xs.shape[-1] - (w - 1) :]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, T, Dk], v [B, H, T, Dv], g [B, H, T, Dg], beta [B, H, T], state [B, H, Dk, Dv]
    -> (out [B, H, T, Dv] in v's dtype, new fp32 state). q and k are L2-normalised here."""
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    form = recurrent if q.shape[2] == 1 else chunked
    out, state = form(q, k, v, g, beta, state.float())
    return out.to(dtype), state


def recurrent(q, k, v, g, beta, state):
    """One token after another; the reference form of the rule."""
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, :, None].exp()  # decay the key rows
        u = beta[:, :, t, None] * (v[:, :, t] - (k[:, :, t, :, None] * state).sum(dim=-2))
        state = state + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append((q[:, :, t, :, None] * state).sum(dim=-2))  # [B, H, Dv]
    return torch.stack(outs, dim=2), state


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunks of C tokens: inside a chunk, with G_t the cumulative decay since the chunk start,
    the updates u solve the unit lower-triangular system (I + A) u = beta v - beta (e^G k) S0,
    A[t, j] = beta_t sum_d k_t[d] k_j[d] e^(G_t[d] - G_j[d]) (j < t). Every exponent is <= 0."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk  # zero k and beta, zero decay: padded steps change nothing
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outs = []
    for s in range(0, t + pad, chunk):
        qc, kc, vc, bc, gc = (x[:, :, s : s + chunk] for x in (q, k, v, beta, g))
        gc = gc.cumsum(dim=2)  # [B, H, C, Dg]
        diff = gc[:, :, :, None, :] - gc[:, :, None, :, :]  # [B, H, C(t), C(j), Dg]
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
        if gc.shape[-1] == 1:  # one decay per head: two matmuls
            kk = (kc @ kc.transpose(-1, -2)) * decay[..., 0]
            qk = (qc @ kc.transpose(-1, -2)) * decay[..., 0]
        else:  # per-channel decay: the pairwise [C, C, Dk] product
            kk = torch.einsum("bhtd,bhjd,bhtjd->bhtj", kc, kc, decay)
            qk = torch.einsum("bhtd,bhjd,bhtjd->bhtj", qc, kc, decay)
        a = (kk * bc[..., None]).tril(-1)
        rhs = torch.cat([vc, kc * gc.exp()], dim=-1) * bc[..., None]  # [B, H, C, Dv + Dk]
        sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = sol[..., :dv] - sol[..., dv:] @ state  # [B, H, C, Dv]
        outs.append((qc * gc.exp()) @ state + qk @ u)
        last = gc[:, :, -1:]  # [B, H, 1, Dg]
        state = (
            state * last.exp().transpose(-1, -2) + (kc * (last - gc).exp()).transpose(-1, -2) @ u
        )
    return torch.cat(outs, dim=2)[:, :, :t], state
