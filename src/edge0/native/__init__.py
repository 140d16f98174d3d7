"""Native kernels, compiled from source on the machine that runs them.

Two ops (decode_ops.cpp), each running the ATen ops of a pure-PyTorch path in the same order
in one call, so each computes bit-identically to that path and ATen still picks the int4
kernel for the CPU at hand; what they remove is the Python and dispatch between the ops:

  torch.ops.edge0.swiglu_int4_experts  a decode token through its K int4 experts (~16 ops
                                       per expert)
  torch.ops.edge0.attention_decode     a decode token of one sequence through a GQA
                                       attention layer (native/attention.py says which)

The library is compiled with the system's C++ compiler against the installed torch's
headers, in a child process, the first time it is needed (`make` set-up does it: `python -m
edge0.native`), and kept under the cache directory, one build per torch version and source.
A machine without a compiler gets `NativeUnavailable` naming why, and the engine then uses
the pure-PyTorch path (EngineOptions.expert_kernel).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edge0.store.relayout import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_ops.cpp")
CFLAGS = ["-O2"]  # no -march: the code is ISA-neutral, ATen dispatches the kernels


class NativeUnavailable(RuntimeError):
    """The native library could not be built or loaded here (the message says why)."""


def library_path(cache_dir: Path | None = None) -> Path:
    """Where this torch's build of this source lives (its name carries the source's hash)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    name = f"edge0_decode_{digest}"
    root = (cache_dir or default_cache_dir()) / "native" / f"torch-{torch.__version__}"
    return root / name / f"{name}.so"


def build(cache_dir: Path | None = None) -> Path:
    """Compile the library unless it is there; returns its path.

    The compiler runs in a child process (torch.utils.cpp_extension, with ninja from the
    `ninja` package on its PATH), so a failing toolchain cannot take the caller down.
    """
    path = library_path(cache_dir)
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeUnavailable(
            f"cannot create {path.parent} for the native decode kernels: {e}"
        ) from e
    env = dict(os.environ)
    try:
        import ninja  # the build tool torch's extension builder drives

        env["PATH"] = ninja.BIN_DIR + os.pathsep + env.get("PATH", "")
    except ImportError:
        pass  # a system ninja may still be on PATH; torch says so if not
    # a warning, not info: the first start pauses ~15 s, once (`make` does it at set-up)
    log.warning("compiling the native decode kernels for this machine, once (%s)", path.parent)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "edge0.native", "--compile-into", str(path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode or not path.exists():
        tail = [line[:200] for line in (proc.stderr or proc.stdout).strip().splitlines()[-3:]]
        raise NativeUnavailable(
            "could not compile the native decode kernels (a C++ compiler and torch's headers "
            f"are needed; expert_kernel='torch' computes the same without it): "
            f"{' | '.join(tail) or f'exit status {proc.returncode}'}"
        )
    log.info("compiled in %.1f s", time.perf_counter() - start)
    return path


def compile_into(path: Path) -> None:
    """The child process's half of build(): compile SOURCE into `path`.

    The library is linked in a work folder and renamed into place, so a process that finds
    `path` never loads a half-written file.
    """
    from torch.utils import cpp_extension

    work = path.parent / "build"
    work.mkdir(exist_ok=True)
    built = cpp_extension.load(
        name=path.stem,
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        build_directory=str(work),
        is_python_module=False,
    )
    os.replace(built, path)


def _registered() -> bool:
    return hasattr(torch.ops.edge0, "swiglu_int4_experts")


def _load(cache_dir: Path | None) -> None:
    """Build and load the library unless this process registered its ops already: loading a
    second build (another cache folder) would register them again, which aborts the
    process, so registered ops are used as they are."""
    if not _registered():
        torch.ops.load_library(str(build(cache_dir)))


def swiglu_int4_experts(cache_dir: Path | None = None) -> Callable[..., torch.Tensor]:
    """The op, built and loaded if need be: (x [1, D], w13s, p13s, w2s, p2s) -> [K, D]."""
    _load(cache_dir)
    return torch.ops.edge0.swiglu_int4_experts


def attention_decode(cache_dir: Path | None = None) -> Callable[..., torch.Tensor]:
    """The op, built and loaded if need be (its arguments: native/attention.py)."""
    _load(cache_dir)
    return torch.ops.edge0.attention_decode
