"""The pure-PyTorch backend: torch's own int4 kernel and the model's own modules, the
reference every other backend is compared with.

Shape legend: n tokens, K active, D hidden, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edge0.engine.backends.base import Backend, ExpertOps, Group
from edge0.formats import quant
from edge0.formats.extents import ExpertTensors
from edge0.formats.int4_layout import Int4Layout

# Below this many tokens per expert torch's int4 kernel beats dequantize + fp32 matmul on the
# CPUs measured (docs/kernels.md); above it the dense matmul amortises the dequantization.
DENSE_MIN_TOKENS = 96


def swiglu_int4(x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
    """One expert on its tokens with torch's int4 kernel: x [n, D] -> fp32 [n, D]."""
    gate, up = quant.int4_linear(x, t.w13, t.p13).float().chunk(2, dim=-1)
    return quant.int4_linear(F.silu(gate) * up, t.w2, t.p2).float()


class TorchExperts(ExpertOps):
    """One expert at a time, each through swiglu_int4 (~16 ATen ops an expert)."""

    dense_from = DENSE_MIN_TOKENS

    def token(self, x: torch.Tensor, experts: list[ExpertTensors]) -> torch.Tensor:
        return torch.stack([swiglu_int4(x, t)[0].to(x.dtype) for t in experts])

    def rows(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        return torch.cat([swiglu_int4(x[tokens], t) for tokens, t in groups])


class TorchBackend(Backend):
    name = "torch"

    def expert_ops(self, arrangement: Int4Layout) -> ExpertOps:
        return TorchExperts()
