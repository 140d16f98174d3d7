"""The recovery LoRA: an unmerged low-rank delta beside frozen projections.

  y = W x + (alpha / r) * B (A x)        A [r, in], B [out, r]

Targets are attention projections, linear-attention projections and shared-expert
projections (each family's LORA_TARGETS), never routed experts: their bytes stream from disk
and must stay replaceable. The base weights are not touched, so switching the adapter off
(`--no-lora`) or swapping it is a file operation.

File: `lora.safetensors` with `<module path>.lora_A` / `.lora_B` and provenance metadata
(model, r, alpha, targets, phase, data hash, base hash, created). Loading is strict: a target
this model does not have, an incomplete pair, a wrong shape, or a different base is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from edge0.models.int4 import Int4Linear

FORMAT_VERSION = "1"


# What a LoRA may sit on: a float projection, or an int4 one (the served floor, models/int4.py).
BASES = (nn.Linear, Int4Linear)


class LoraLinear(nn.Module):
    """A frozen projection (float or int4) plus a trainable low-rank parallel delta."""

    def __init__(self, base: nn.Module, r: int, alpha: float):
        super().__init__()
        self.base = base
        self.r, self.alpha = r, alpha
        self.scale = alpha / r
        dev = next(iter(base.buffers() if isinstance(base, Int4Linear) else base.parameters()))
        # a base still on the meta device (a student built to be sharded before it is
        # filled) gets its adapter in host memory, so that its initial values exist
        dev = torch.device("cpu") if dev.device.type == "meta" else dev.device
        self.lora_A = nn.Parameter(torch.zeros(r, base.in_features, device=dev))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=dev))
        self.enabled = True

    def reset_parameters(self, gen: torch.Generator | None = None) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0: the adapter starts as an exact no-op."""
        bound = self.base.in_features**-0.5
        with torch.no_grad():
            self.lora_A.copy_(torch.empty_like(self.lora_A).uniform_(-bound, bound, generator=gen))
            self.lora_B.zero_()

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A, [out, in]: what merging would add to W."""
        return self.scale * self.lora_B @ self.lora_A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.enabled:
            return y
        return y + self.scale * ((x.to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()).to(
            y.dtype
        )


def target_paths(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Module paths of every LoRA target: each decoder layer's projections named in targets."""
    prefix = next(n for n, m in model.named_modules() if m is model.backbone.layers)
    paths = []
    names = dict(model.named_modules())
    for i in range(len(model.backbone.layers)):
        for suffix in targets:
            path = f"{prefix}.{i}.{suffix}"
            if isinstance(names.get(path), BASES + (LoraLinear,)):
                paths.append(path)
    if not paths:
        raise ValueError(f"no LoRA target of {targets} exists in this model")
    return paths


def router_targets(model: nn.Module) -> tuple[str, ...]:
    """The MoE routers as LoRA targets (names within a decoder layer, like LORA_TARGETS),
    where a router is a plain Linear (the softmax-top-k families). A router with a selection
    bias of its own (sigmoid-group) is left out: the selection reads that bias from the
    router module, which a LoRA would wrap."""
    prefix = next(n for n, m in model.named_modules() if m is model.backbone.layers)
    names = (
        f"{model.moe_block_path(i)}.gate".removeprefix(f"{prefix}.{i}.")
        for i in model.moe_layers
        if isinstance(model.moe_block(i).gate, (nn.Linear, LoraLinear))
    )
    return tuple(dict.fromkeys(names))  # one name per layer kind, in layer order


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def attach(
    model: nn.Module, paths: list[str], r: int, alpha: float, gen: torch.Generator | None = None
) -> dict[str, LoraLinear]:
    """Wrap each target in a LoraLinear (freshly initialised); returns them by path."""
    out = {}
    for path in paths:
        base = model.get_submodule(path)
        if isinstance(base, LoraLinear):
            raise ValueError(f"{path} already carries a LoRA")
        if not isinstance(base, BASES):
            raise ValueError(f"LoRA target {path} is a {type(base).__name__}, not a Linear")
        lora = LoraLinear(base, r, alpha)
        lora.reset_parameters(gen)
        _set(model, path, lora)
        out[path] = lora
    return out


def adapters(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def set_enabled(model: nn.Module, enabled: bool) -> None:
    for m in adapters(model).values():
        m.enabled = enabled


def save(model: nn.Module, path: Path, metadata: dict[str, str]) -> None:
    loras = adapters(model)
    if not loras:
        raise ValueError("the model carries no LoRA to save")
    first = next(iter(loras.values()))
    tensors = {}
    for name, m in loras.items():
        tensors[f"{name}.lora_A"] = m.lora_A.detach().float().contiguous()
        tensors[f"{name}.lora_B"] = m.lora_B.detach().float().contiguous()
    meta = {
        "kind": "lora",
        "format_version": FORMAT_VERSION,
        "r": str(first.r),
        "alpha": str(first.alpha),
        "targets": json.dumps(sorted(loras)),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        **metadata,
    }
    save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})


@dataclass(frozen=True)
class LoraFile:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    @property
    def r(self) -> int:
        return int(self.metadata["r"])

    @property
    def alpha(self) -> float:
        return float(self.metadata["alpha"])


def read(path: Path) -> LoraFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no LoRA file (serve without one: no_lora)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from e
    if meta.get("kind", "lora") != "lora":
        raise ValueError(f"{path}: metadata kind is {meta.get('kind')!r}, not 'lora'")
    for key in ("r", "alpha"):
        if key not in meta:
            raise ValueError(f"{path}: metadata lacks {key!r}")
    return LoraFile(tensors, meta)


def load(
    model: nn.Module, path: Path, base_hash: str | None = None, allow_other_base: bool = False
) -> dict[str, str]:
    """Attach the adapters of a lora.safetensors to `model`, strictly; returns its metadata."""
    path = Path(path)
    f = read(path)
    if base_hash and f.metadata.get("base_hash") not in (None, base_hash) and not allow_other_base:
        raise ValueError(
            f"{path} was trained for another base (base_hash {f.metadata['base_hash'][:12]}..., "
            f"this model {base_hash[:12]}...); set lora_any_base to load it anyway"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in f.tensors.items():
        name, _, part = key.rpartition(".")
        if part not in ("lora_A", "lora_B"):
            raise ValueError(f"{path}: unexpected tensor {key!r}")
        pairs.setdefault(name, {})[part] = t
    modules = dict(model.named_modules())
    for name, pair in pairs.items():
        if len(pair) != 2:
            missing = {"lora_A", "lora_B"} - set(pair)
            raise ValueError(f"{path}: target {name} lacks {missing.pop()}")
        if not isinstance(modules.get(name), BASES):
            raise ValueError(f"{path}: unknown LoRA target {name!r} (no such Linear in this model)")
    declared = json.loads(f.metadata["targets"]) if "targets" in f.metadata else sorted(pairs)
    missing = sorted(set(declared) - set(pairs))
    if missing:
        raise ValueError(
            f"{path}: target {missing[0]} is declared in the metadata but has no tensors"
        )
    attached = attach(model, sorted(pairs), f.r, f.alpha)
    for name, m in attached.items():
        a, b = pairs[name]["lora_A"], pairs[name]["lora_B"]
        if a.shape != m.lora_A.shape or b.shape != m.lora_B.shape:
            raise ValueError(
                f"{path}: {name} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"this model needs {tuple(m.lora_A.shape)}, {tuple(m.lora_B.shape)}"
            )
        with torch.no_grad():
            m.lora_A.copy_(a.float())
            m.lora_B.copy_(b.float())
        m.requires_grad_(False)
    return f.metadata
