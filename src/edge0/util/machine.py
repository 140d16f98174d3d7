"""The machine a number was measured on: the CPU as /proc/cpuinfo names it, its cores, the
vector extensions that decide kernel speed, and the kernels torch dispatches to there (they
vary between machines of the same kind)."""

from __future__ import annotations

import os
from pathlib import Path

# the flags that change which kernels run, and how fast
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name ("unknown" where /proc/cpuinfo has none, e.g. some ARM boards)."""
    return _cpuinfo().get("model name", "unknown")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe() -> dict:
    """CPU name, family and model, vector extensions, cores, torch version and the CPU
    capability its kernels use (ATEN_CPU_CAPABILITY, when set, is what chose it)."""
    import torch

    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {
        "cpu": info.get("model name", "unknown"),
        "cpu_family": info.get("cpu family"),
        "cpu_model": info.get("model"),
        "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
    }
