"""Prediction-as-routing over whole sequences (teacher forcing): the student path of training.

At decode, consumer layer c routes token t+1 by the head its owner ran at token t. Over a
full sequence [B, T] that is a shift by one position, and every input the head needs (the
owner's MoE input and executed experts at t and t-1) exists by the time layer c runs, so the
whole sequence goes through in one forward. Positions where `use_prediction` is False (the
prompt, which inference prefills with the gates, and position 0) route by the gate.

Executed experts on consumer layers are the predicted ones, exactly as at decode, so the
heads see the same (drifted) features in training as in serving.
Shape legend: B batch, T positions, D hidden, E experts, K active experts.
"""

from __future__ import annotations

import torch

from edge0.models.base import Forward, RoutingObserver
from edge0.models.routing import topk_onehot
from edge0.prerouter.head import Prerouter, features


class TeacherForcedRouting(Forward):
    """A Forward for [B, T] inputs whose consumer layers route by the shifted predictions.

    With `stage_width` W (and the consumers' MoE `blocks`), a predicted position's consumer
    instead routes by its own router among the W experts the prediction would stage, as the
    engine's decode does with `--stage-width W`.
    """

    def __init__(
        self,
        prerouter: Prerouter,
        use_prediction: torch.Tensor,
        observer: RoutingObserver | None = None,
        stage_width: int | None = None,
        blocks: dict | None = None,
    ):
        super().__init__(cache=None, observer=observer)
        self.stage_width, self.blocks = stage_width, blocks
        self.pre = prerouter
        self.use = use_prediction  # [B, T] bool
        self.batch, self.length = use_prediction.shape
        self._h: dict[int, torch.Tensor] = {}
        self._idx: dict[int, torch.Tensor] = {}

    def routed(self, layer, h, logits, indices) -> None:
        # the first forward's only: a checkpointed layer's recomputation in the backward pass
        # routes again, and its h kept here would keep that recomputed graph alive until the
        # whole backward ended (0.75 GiB over the 35B tier's 40 layers); its consumer, one
        # layer later, was recomputed before it and read the first forward's h
        if str(layer) in self.pre.heads and layer not in self._h:
            self._h[layer] = h.view(self.batch, self.length, -1)
            self._idx[layer] = indices.view(self.batch, self.length, -1)
        super().routed(layer, h, logits, indices)

    def router_logits(self, layer: int, h: torch.Tensor, router: torch.nn.Module) -> torch.Tensor:
        own = router(h)  # [B*T, E]
        owner = self.pre.wiring.owner_of.get(layer)
        if owner is None:
            return own
        e = self.pre.num_experts
        executed = topk_onehot(self._idx[owner], e)  # [B, T, E]
        previous = torch.cat([torch.zeros_like(executed[:, :1]), executed[:, :-1]], dim=1)
        pred = self.pre.head(owner)(features(self._h[owner], executed, previous))  # [B, T, E]
        shifted = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], dim=1)  # made at t-1
        if self.stage_width is not None:  # the router picks among the W a prediction stages
            staged = self.blocks[layer].select(shifted.reshape(-1, e), self.stage_width)[1]
            allowed = topk_onehot(staged, e).bool().view(self.batch, self.length, e)
            self.allowed[layer] = (allowed | ~self.use[..., None]).reshape(-1, e)
            return own
        mixed = torch.where(
            self.use[..., None], shifted.to(own.dtype), own.view(self.batch, self.length, e)
        )
        return mixed.reshape(-1, e)


def prediction_mask(batch: int, length: int, first: int | torch.Tensor = 1) -> torch.Tensor:
    """[B, T] True from position `first` on (per row if `first` is a [B] tensor)."""
    pos = torch.arange(length)[None, :]
    first = torch.as_tensor(first).reshape(-1, 1)
    return (pos >= first).expand(batch, length)
