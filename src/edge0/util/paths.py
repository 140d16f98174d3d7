"""Where edge0 keeps what it builds once per machine (repacked experts, the native library)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/edge0, else ~/.cache/edge0."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edge0"
