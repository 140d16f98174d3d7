"""The machine a number was measured on: the CPU as /proc/cpuinfo names it, its cores, and
the kernels torch dispatches to there (they vary between machines of the same kind)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name ("unknown" where /proc/cpuinfo has none, e.g. some ARM boards)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


def describe() -> dict:
    """CPU, cores, torch version and the CPU capability its kernels use (ATEN_CPU_CAPABILITY,
    when set, is what chose it)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
    }
