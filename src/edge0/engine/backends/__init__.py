"""Backends: the one object that decides how a loaded engine computes.

A backend is chosen once at load (EngineOptions.backend) and owns every kernel decision: the
int4 arrangement weights are packed in, the pool's fix-up of each read, the experts' ops at
decode and prefill, the decoder layers and attention it computes itself, and the prerouter
heads' op. The executors, the plan and the engine ask it; nothing else decides a kernel.

  torch   the pure-PyTorch reference: torch's own int4 kernel and the model's own modules
  native  edge0's compiled ops, torch's numbers in fewer calls (backends/native.py)

A new backend is one module with a Backend subclass, and one `register` line.
"""

from __future__ import annotations

import logging

from edge0.engine.backends.base import Backend
from edge0.engine.backends.native import NativeBackend
from edge0.engine.backends.torch import TorchBackend
from edge0.engine.options import EngineOptions
from edge0.native import NativeUnavailable

log = logging.getLogger(__name__)

BACKENDS: dict[str, type[Backend]] = {}
# a backend that cannot be built here (native: no compiler); "auto" then falls back to torch
BackendUnavailable = NativeUnavailable


def register(cls: type[Backend]) -> type[Backend]:
    BACKENDS[cls.name] = cls
    return cls


register(TorchBackend)
register(NativeBackend)


def backend_class(name: str) -> type[Backend]:
    """The class EngineOptions.backend names ("auto": native, the one it tries first)."""
    if name == "auto":
        return NativeBackend
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"backend must be one of {known}: {name!r}") from None


def choose(options: EngineOptions) -> Backend:
    """The backend options.backend names; "auto": native where it builds, else torch with a
    warning saying why."""
    cls = backend_class(options.backend)
    if options.backend != "auto":
        return cls(options)
    try:
        return cls(options)
    except BackendUnavailable as e:
        log.warning("%s; decode uses the pure-PyTorch paths", e)
        return TorchBackend(options)
