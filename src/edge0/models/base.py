"""What every model family shares: the per-call Forward state and config helpers.

A family file defines a config dataclass (`from_dict`, `is_moe_layer`), a `Model` built on the
skeleton in `blocks.py` from its declared pieces (mixers, norm, routing `select`), and
`sanitize(key)`: a checkpoint tensor's name in the model, or None for tensors it does not serve
(a vision tower, multi-token-prediction layers). It may declare `LORA_TARGETS` (projections,
relative to a decoder layer, the recovery LoRA may attach to) and `KEEP_FP32` (name suffixes
`convert` keeps in fp32 rather than bf16: routers, selection biases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from edge0.models.experts import Executor
from edge0.models.layers import KVCache, RowCaches

# Observer signature: (layer, MoE input h [T, D], routing logits [T, E], executed top-k [T, K]).
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class Forward:
    """Per-call state: the request's cache, and the engine's hooks into routed layers.

    `predicted[layer]` holds logits [T, E] that replace that layer's router for this call
    (prediction-as-routing); `observer` sees each MoE layer's input and executed experts;
    `executors[layer]` computes that layer's experts (the engine's strategy for this phase);
    `allowed[layer]` (bool [T, E]) restricts that layer's router to those experts (a staged
    set wider than K); `layers[i]` stands in for decoder layer i (the engine's native layer at
    decode, called as the layer is). With none set, every layer routes by its own router
    through its own experts module, and every decoder layer is the model's own.
    """

    def __init__(
        self,
        cache: KVCache | None = None,
        predicted: dict[int, torch.Tensor] | None = None,
        observer: RoutingObserver | None = None,
        executors: dict[int, Executor] | None = None,
        allowed: dict[int, torch.Tensor] | None = None,
        layers: dict[int, Callable] | None = None,
    ):
        self.cache = cache
        self.predicted = predicted or {}
        self.observer = observer
        self.executors = executors or {}
        self.allowed = allowed or {}
        self.layers = layers or {}

    def layer(self, i: int, module: nn.Module) -> Callable:
        """What computes decoder layer i in this call: the stand-in, else the module."""
        return self.layers.get(i, module)

    def router_logits(self, layer: int, h: torch.Tensor, router: nn.Module) -> torch.Tensor:
        pred = self.predicted.get(layer)
        return router(h) if pred is None else pred

    def routed(
        self, layer: int, h: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor
    ) -> None:
        if self.observer is not None:
            self.observer(layer, h, logits, indices)

    def experts(self, layer: int, module: nn.Module) -> Executor:
        """What computes this layer's experts in this call: the executor, else the module."""
        return self.executors.get(layer, module)

    def positions(self, t: int, device=None) -> torch.Tensor:
        """The rotary positions of this call's t tokens: [T], or [B, 1, T] for RowCaches."""
        if self.cache is None:
            return torch.arange(t, device=device)
        return self.cache.positions(t, device)


class RowsForward(Forward):
    """One forward of B requests' decode tokens, one row each, every row with its own
    Forward (its cache, predictions, allowed sets, observer and executors, as a step of that
    request alone would have). Dense work runs on all rows at once; attention runs per row
    over each row's own cache (RowCaches); at an MoE layer the router runs on all rows, each
    row's predictions and allowed set replace or restrict its own row, each row's observer
    sees its row, and each row's executor computes its row's experts (so each request pins
    and reads what it would alone). `observer`, if given, sees all rows at once instead of
    each row's own (the prerouter's heads then run once over the rows). `together`, if
    given, computes a layer's experts for all rows at once, as together(the rows' executors,
    x, indices), where every row's executor can `pin` its experts for it. `attend_rows`, if
    given, is the native op that runs the rows' attention in one call (RowCaches); `layers`,
    the stand-ins for decoder layers that take such a forward's rows (a backend's layers)."""

    def __init__(
        self,
        rows: list[Forward],
        observer: RoutingObserver | None = None,
        together: Callable[[list, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        attend_rows: Callable | None = None,
        layers: dict[int, Callable] | None = None,
    ):
        # the rows are one engine's requests: the same layers are predicted or restricted in
        # every row, or in none
        assert all(f.predicted.keys() == rows[0].predicted.keys() for f in rows)
        assert all(f.allowed.keys() == rows[0].allowed.keys() for f in rows)
        super().__init__(RowCaches([f.cache for f in rows], attend_rows), layers=layers)
        self.rows, self.observer, self.together = rows, observer, together
        self.predicted = {k: torch.cat([f.predicted[k] for f in rows]) for k in rows[0].predicted}
        self.allowed = {k: torch.cat([f.allowed[k] for f in rows]) for k in rows[0].allowed}

    def routed(
        self, layer: int, h: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor
    ) -> None:
        if self.observer is not None:
            self.observer(layer, h, logits, indices)
            return
        for i, f in enumerate(self.rows):
            f.routed(layer, h[i : i + 1], logits[i : i + 1], indices[i : i + 1])

    def experts(self, layer: int, module: nn.Module) -> Executor:
        executors = [f.experts(layer, module) for f in self.rows]
        if self.together is not None and all(hasattr(ex, "pin") for ex in executors):
            together = self.together
            return lambda x, indices: together(executors, x, indices)

        def each_row(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            return torch.cat(
                [ex(x[i : i + 1], indices[i : i + 1]) for i, ex in enumerate(executors)]
            )

        return each_row


def config_from_dict(cls, raw: dict[str, Any], aliases: dict[str, str] | None = None):
    """Build a config dataclass from config.json: unknown keys ignored, aliases renamed."""
    data = dict(raw)
    for src, dst in (aliases or {}).items():
        if src in data and dst not in data:
            data[dst] = data[src]
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if "rope_theta" not in data and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    names = {f.name for f in dataclasses.fields(cls)}
    # a scaled RoPE's parameters, as transformers reads them (models/layers.py RopeScaling)
    data["rope_scaling"] = None
    if rope_type not in ("default", None):
        data["rope_scaling"] = {**rope, "rope_type": rope_type}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in data
    ]
    if missing:
        raise ValueError(f"config.json: missing required field(s) {', '.join(missing)}")
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    for k, v in data.items():
        if k in names:
            _check_value(k, v, fields[k])
    return cls(**{k: v for k, v in data.items() if k in names})


# the Python types a field's annotation admits, for those config.json can get wrong
_SCALARS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
MAX_SIZE = 1 << 24  # no size or count of a model comes near this (a typo, or damage, does)


def _check_value(name: str, value, annotation) -> None:
    """A config.json value of the type its field declares (int, float, bool, str, with or
    without None), a size or count within [0, MAX_SIZE], an epsilon within (0, 1)."""
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None:
        if "None" not in kinds:
            raise ValueError(f"config.json: {name} must be set, not null")
        return
    allowed = [_SCALARS[k] for k in kinds if k in _SCALARS]
    if not allowed or len(allowed) != len([k for k in kinds if k != "None"]):
        return  # a list, dict or other structure: its family checks it
    types = tuple(t for a in allowed for t in a)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        want = " or ".join(k for k in kinds if k != "None")
        raise ValueError(f"config.json: {name} must be {want}, got {value!r}")
    if isinstance(value, bool):
        return
    if name.endswith("eps") and not 0 < value < 1:
        raise ValueError(f"config.json: {name} must be between 0 and 1, got {value!r}")
    if isinstance(value, int) and "int" in kinds and not 0 <= value <= MAX_SIZE:
        if not name.endswith(("_id", "_token_id", "seed")):
            raise ValueError(f"config.json: {name} {value} is out of range [0, {MAX_SIZE}]")
