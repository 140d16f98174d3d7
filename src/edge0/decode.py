"""The decode policy, one copy for the engine and for student-path sampling in training.

A prompt routes by its layers' own gates while the prerouter watches (prefill); every
generated token routes its prediction-routed layers by the predictions its owners made one
token before (step); after each forward the predictions advance (`flush`). `executors` are the
engine's: where a layer's experts come from in this call (none: the model's own experts).
Shape legend: B sequences decoding in lockstep, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from edge0.models.base import Forward
from edge0.models.experts import Executor
from edge0.models.layers import KVCache
from edge0.prerouter.runtime import PrerouterState


def prefill(
    model: torch.nn.Module,
    cache: KVCache,
    ids: torch.Tensor,
    pre: PrerouterState | None = None,
    executors: dict[int, Executor] | None = None,
    last: bool = True,
) -> torch.Tensor:
    """ids [B, T] -> the last position's logits [B, V]; predictions for the next token made,
    unless more of the prompt follows (`last=False`)."""
    fwd = Forward(cache, observer=pre.observe if pre else None, executors=executors)
    logits = model(ids, fwd, last_only=True)[:, -1]
    if pre is not None and last:
        pre.flush()  # heads on the last prompt position: the first decode token is predicted
    return logits


def step(
    model: torch.nn.Module,
    cache: KVCache,
    tokens: torch.Tensor,
    pre: PrerouterState | None = None,
    executors: dict[int, Executor] | None = None,
) -> torch.Tensor:
    """tokens [B, 1] -> logits [B, V]; consumers route by the current predictions."""
    if pre is None:
        return model(tokens, Forward(cache, executors=executors), last_only=True)[:, -1]
    if pre.rt.wide:  # each consumer's router picks its K among the W staged for it
        fwd = Forward(cache, None, pre.observe, executors=executors, allowed=dict(pre.allowed))
    else:  # the prediction is the routing
        fwd = Forward(cache, dict(pre.predicted), pre.observe, executors=executors)
    logits = model(tokens, fwd, last_only=True)[:, -1]
    pre.flush()
    return logits
