"""The decode policy, one copy for the engine and for student-path sampling in training.

A prompt routes by its layers' own gates while the prerouter watches (prefill); every
generated token routes its prediction-routed layers by the predictions its owners made one
token before (step); after each forward the predictions advance (`flush`). `executors` are the
engine's: where a layer's experts come from in this call (none: the model's own experts).
Shape legend: B sequences decoding in lockstep, T tokens, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from edge0.models.base import Forward, RowsForward
from edge0.models.experts import Executor
from edge0.models.layers import KVCache
from edge0.prerouter.runtime import PrerouterState, observe_rows


def prefill(
    model: torch.nn.Module,
    cache: KVCache,
    ids: torch.Tensor,
    pre: PrerouterState | None = None,
    executors: dict[int, Executor] | None = None,
    last: bool = True,
    every_position: bool = False,
) -> torch.Tensor:
    """ids [B, T] -> the last position's logits [B, V] (every position's, [B, T, V], for
    scoring a prompt); predictions for the next token made, unless more of the prompt follows
    (`last=False`)."""
    fwd = Forward(cache, observer=pre.observe if pre else None, executors=executors)
    logits = model(ids, fwd, last_only=not every_position)
    logits = logits if every_position else logits[:, -1]
    if pre is not None and last:
        pre.flush()  # heads on the last prompt position: the first decode token is predicted
    return logits


def step(
    model: torch.nn.Module,
    cache: KVCache,
    tokens: torch.Tensor,
    pre: PrerouterState | None = None,
    executors: dict[int, Executor] | None = None,
    layers: dict | None = None,
) -> torch.Tensor:
    """tokens [B, 1] -> logits [B, V]; consumers route by the current predictions; `layers`
    stand in for those decoder layers (Forward.layers)."""
    logits = model(tokens, step_forward(cache, pre, executors, layers), last_only=True)[:, -1]
    if pre is not None:
        pre.flush()
    return logits


def step_rows(
    model: torch.nn.Module,
    caches: list[KVCache],
    tokens: torch.Tensor,
    pres: list[PrerouterState | None],
    executors: list[dict[int, Executor]],
    together: Callable | None = None,
    attend_rows: Callable | None = None,
    layers: dict | None = None,
) -> torch.Tensor:
    """One decode step of B requests in one forward, a token [B, 1] each, with their own
    caches, prediction states and executors -> logits [B, V]: each row's as step() gives it
    alone, up to the rounding of matmuls over B rows instead of one (see RowsForward; the
    native layers compute every row's layers as its step does, native_layers.py).
    `together` computes a layer's experts for all rows, `attend_rows` their attention,
    `layers` stands in for decoder layers (RowsForward)."""
    rows = [step_forward(*a) for a in zip(caches, pres, executors, strict=True)]
    observer = None
    if all(pre is not None for pre in pres):  # each owner's head once over the rows
        observer = functools.partial(observe_rows, pres)
    fwd = RowsForward(rows, observer, together, attend_rows, layers)
    logits = model(tokens, fwd, last_only=True)[:, -1]
    for pre in pres:
        if pre is not None:
            pre.flush()
    return logits


def step_forward(
    cache: KVCache,
    pre: PrerouterState | None,
    executors: dict[int, Executor] | None,
    layers: dict | None = None,
) -> Forward:
    """A decode step's Forward: without a prerouter every layer routes by its own router;
    with one, each consumer routes by the predictions for it (W = K) or picks its K among the
    W staged for it (W > K)."""
    kw = dict(executors=executors, layers=layers)
    if pre is None:
        return Forward(cache, **kw)
    if pre.rt.wide:
        return Forward(cache, None, pre.observe, allowed=dict(pre.allowed), **kw)
    return Forward(cache, dict(pre.predicted), pre.observe, **kw)
