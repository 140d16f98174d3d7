"""The native backend: edge0's compiled ops (edge0.native), built once on the machine.

Each computes what the PyTorch path computes, bit for bit (the int8-activation kernels
excepted, which are their own reference's bits on every CPU), in one call where the PyTorch
path takes dozens of ATen ops: a decode token's K experts, a prefill's experts, a decode
token's attention half and routing (native_layers.py), a Gated DeltaNet layer's mixer
(native_delta.py), the prerouter heads.

Shape legend: T tokens, K active, D hidden, n tokens routed to one expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from edge0 import native
from edge0.engine.backends.base import Backend, ExpertOps, Group
from edge0.engine.backends.native_delta import delta_layers
from edge0.engine.backends.native_layers import native_layers
from edge0.engine.backends.native_staged import NativeStaged
from edge0.engine.backends.native_token import NativeToken
from edge0.formats.extents import ExpertTensors, ExtentLayout
from edge0.formats.int4_layout import Int4Layout

# From this many tokens an expert of a prefill is computed on its dequantized weights: the
# native op decodes a block's weights once per 4 tokens, so the dense matmul wins later than
# against torch's kernel (docs/kernels.md)
ROWS_DENSE_MIN_TOKENS = 256
# A batched decode step of at least this many requests computes their experts in one rows()
# call; below it each row's own token() call is cheaper (the call's fixed cost; kernels.md)
ROWS_TOGETHER = 4


class NativeExperts(ExpertOps):
    """A token's K experts in one call (edge0::swiglu_int4_gemv), several experts' rows in
    one call (edge0::swiglu_int4_rows); the arrangement and the kernel path bound once."""

    dense_from = ROWS_DENSE_MIN_TOKENS
    rows_from = ROWS_TOGETHER

    def __init__(self, token_op: Callable, rows_op: Callable, layout: list[int], isa: int):
        self.token_op, self.rows_op, self.layout, self.isa = token_op, rows_op, layout, isa

    def token(self, x: torch.Tensor, experts: list[ExpertTensors]) -> torch.Tensor:
        fields = (
            [t.w13 for t in experts],
            [t.p13 for t in experts],
            [t.w2 for t in experts],
            [t.p2 for t in experts],
        )
        return self.token_op(x, *fields, self.layout, self.isa)

    def rows(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        fields = [[g[0] for g in groups]]
        fields += [[getattr(g[1], f) for g in groups] for f in ("w13", "p13", "w2", "p2")]
        return self.rows_op(x, *fields, self.layout, self.isa)


class NativeBackend(Backend):
    """Raises native.NativeUnavailable where the library cannot be built or loaded."""

    name = "native"
    heads_bytes = 2  # heads.cpp reads the heads' fp16 weights as stored

    def __init__(self, options):
        super().__init__(options)
        native.load(options.cache_dir)
        self.int8 = options.int4_activations == "int8"

    def pool_layout(self, stored: ExtentLayout, holds_every_expert: bool) -> ExtentLayout:
        # Decode on the int8 AVX2 or AVX-512 kernel reads experts in their int8 order, put in as
        # each is read, where the pool holds them all: read once, at load. Under a cap every
        # read would pay it again on the cores that decode (slower: docs/kernels.md).
        host = self.arrangement
        if self.int8 and holds_every_expert and native.int8_order_pays():
            host = host.in_int8_order()
        return stored.with_int4(host)

    def reorder(self) -> Callable[[torch.Tensor, Int4Layout], None]:
        return native.put_in_int8_order

    def kernel_pairs(self) -> Callable[[torch.Tensor], None]:
        # one native loop: as torch ops the fix-up takes the cores that decode while a
        # prerouter's reads overlap the step (docs/io.md)
        return native.to_kernel_pairs

    def expert_ops(self, arrangement: Int4Layout) -> NativeExperts:
        cache = self.options.cache_dir
        _, isa = native.kernel_args(self.int8)
        return NativeExperts(
            native.op("swiglu_int4_gemv", cache),
            native.op("swiglu_int4_rows", cache),
            native.layout_code(arrangement),
            isa,
        )

    def layers(self, model: nn.Module) -> dict[int, Callable]:
        cache = self.options.cache_dir
        return native_layers(model, cache, self.int8) | delta_layers(model, cache, self.int8)

    def token_decoder(self, model: nn.Module, layers: dict, pool, experts: ExpertOps):
        if not isinstance(experts, NativeExperts) or not NativeToken.servable(model, layers):
            return None
        cache = self.options.cache_dir
        return NativeToken(model, layers, pool, experts.layout, experts.isa, cache, ROWS_TOGETHER)

    def staged_decoder(self, model: nn.Module, layers: dict, pool, experts: ExpertOps, runtime):
        if not isinstance(experts, NativeExperts) or not NativeToken.servable(model, layers):
            return None
        if not NativeStaged.serves(runtime):
            return None
        cache = self.options.cache_dir
        return NativeStaged(runtime, model, layers, pool, experts.layout, experts.isa, cache)

    def attend_rows(self) -> Callable:
        return native.op("attend_rows", self.options.cache_dir)

    def heads(self) -> tuple[Callable, int]:
        return native.op("prerouter_head", self.options.cache_dir), native.BEST_ISA
