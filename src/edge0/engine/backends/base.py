"""What a backend decides, and the expert ops it hands the executors.

Shape legend: T tokens, K active, D hidden, n tokens routed to one expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from edge0.engine.options import EngineOptions
from edge0.formats import int4_layout
from edge0.formats.extents import ExpertTensors, ExtentLayout
from edge0.formats.int4_layout import Int4Layout
from edge0.models.experts import swiglu_dense

# (token rows int64 [n], the expert's tensors): one expert's share of a forward
Group = tuple[torch.Tensor, ExpertTensors]


class ExpertOps:
    """A layer's routed experts from their int4 tensors, as the executors call them.

    `token`: one decode token x [1, D] through its experts, in routing order -> [K, D].
    `rows`: several experts, each on the tokens routed to it, x [T, D] -> fp32 [sum n, D],
    the experts' rows in order (prefill; a batched decode step of `rows_from` requests or
    more). `dense`: one expert on its weights dequantized to fp32, for an expert with at
    least `dense_from` tokens, where the int4 kernels lose to a dense matmul.
    """

    dense_from: int = 1 << 62
    rows_from: int = 1 << 62

    def token(self, x: torch.Tensor, experts: list[ExpertTensors]) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, layout: ExtentLayout, x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
        """x [n, D] -> fp32 [n, D] through the expert's dequantized weights."""
        w13, w2 = layout.dequantize(t)
        return swiglu_dense(x.float(), w13, w2)


def swiglu_float(x: torch.Tensor, t: ExpertTensors) -> torch.Tensor:
    """One expert stored as float weights (the BF16 format) on its tokens: x [n, D] -> fp32
    [n, D], in fp32 on the weights widened per call: the stored weights' only error is their
    rounding to bf16. (torch's bf16 matmul on the CPU took 0.3 GiB more scratch for a
    teacher's 8 x 256-token forward on the built-in model, and was no faster.)"""
    return swiglu_dense(x.float(), t.w13.float(), t.w2.float())


class FloatExperts(ExpertOps):
    """Experts whose extents hold their weights (a teacher's bf16 store), on every backend:
    swiglu_float on the pool's views, nothing to dequantize (`dense` is the base's: the
    layout widens the same views)."""

    def token(self, x: torch.Tensor, experts: list[ExpertTensors]) -> torch.Tensor:
        return torch.stack([swiglu_float(x, t)[0].to(x.dtype) for t in experts])

    def rows(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        return torch.cat([swiglu_float(x[tokens], t) for tokens, t in groups])


class Backend:
    """The kernels of one loaded engine, chosen once (EngineOptions.backend). This base is
    what every backend shares: weights packed in the arrangement torch's int4 kernel reads
    here (found by packing a probe and checked by one matmul), the pool's reads turned into
    kernel form in PyTorch, no layer, attention or head op of its own."""

    name: ClassVar[str]
    # bytes a prerouter head parameter takes as served (None: the compute dtype's)
    heads_bytes: ClassVar[int | None] = None

    def __init__(self, options: EngineOptions):
        self.options = options
        self._arrangement: Int4Layout | None = None

    @classmethod
    def heads_itemsize(cls, dtype: torch.dtype) -> int:
        return cls.heads_bytes or dtype.itemsize

    @property
    def arrangement(self) -> Int4Layout:
        """The int4 arrangement weights are packed in for this process's kernels."""
        if self._arrangement is None:
            host = int4_layout.host_layout()
            int4_layout.self_check(host)
            self._arrangement = host
        return self._arrangement

    def pool_layout(self, stored: ExtentLayout, holds_every_expert: bool) -> ExtentLayout:
        """The layout the expert pool holds extents stored as `stored` in."""
        return stored.with_int4(self.arrangement)

    def reorder(self) -> Callable[[torch.Tensor, Int4Layout], None] | None:
        """The pool's in-place reorder into its layout's int8 order (None: it has none)."""
        return None

    def kernel_pairs(self) -> Callable[[torch.Tensor], None]:
        """The pool's in-place fix-up of each read's (scale, bias) pairs."""
        from edge0.formats.quant import to_kernel_pairs

        return to_kernel_pairs

    def expert_ops(self, arrangement: Int4Layout) -> ExpertOps:
        """The expert ops for codes held in `arrangement` (the pool's)."""
        raise NotImplementedError

    def ops_for(self, layout: ExtentLayout) -> ExpertOps:
        """The expert ops for extents the pool holds as `layout`: this backend's int4 ops for
        its arrangement, or FloatExperts for weights stored as bf16."""
        if not layout.format.quantized:
            return FloatExperts()
        return self.expert_ops(layout.int4)

    def layers(self, model: nn.Module) -> dict[int, Callable]:
        """Stand-ins for the decoder layers this backend computes at decode (Forward.layers)."""
        return {}

    def token_decoder(self, model: nn.Module, layers: dict, pool, experts: ExpertOps):
        """What decodes one request's token through every layer in one call, where the
        engine's pool holds every expert and no prerouter runs (native_token.py); None: the
        layers one by one."""
        return None

    def staged_decoder(self, model: nn.Module, layers: dict, pool, experts: ExpertOps, runtime):
        """What decodes one request's prediction-routed token through every layer in one
        call, its pool's part on a thread of its own (native_staged.py); None: the layers
        one by one."""
        return None

    def attend_rows(self) -> Callable | None:
        """A batched decode step's attention, row by row in one call (RowsForward)."""
        return None

    def heads(self) -> tuple[Callable, int] | None:
        """The prerouter heads' op and its path (None: the heads run in torch)."""
        return None
