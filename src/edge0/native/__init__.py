"""Native kernels, compiled from source on the machine that runs them.

Each op but one computes what a pure-PyTorch path computes, bit for bit, in one call; what
they remove is the Python, the dispatch and the dtype round trips between that path's ops:

  torch.ops.edge0.swiglu_int4_gemv  a decode token through its K int4 experts in one parallel
                                    region (int4_gemv.cpp; the reference: ~16 ops per expert)
  torch.ops.edge0.int4_gemv         one int4 projection of a few rows
  torch.ops.edge0.int8_order_       int4 codes put in the int8 kernels' order, in place
  torch.ops.edge0.kernel_pairs_     quant.to_kernel_pairs in one loop, in place (a pool read's
                                    fix-up, int4_gemv.cpp)
  torch.ops.edge0.attention_rows    a decode token of each of B sequences (one request's,
                                    or a batched step's rows) through a decoder layer's norm,
                                    GQA attention, residual and post-attention norm
                                    (decode_ops.cpp; the engine's native_layers.py: which)
  torch.ops.edge0.attend_rows       a batched step's attention alone, row by row in one call
  torch.ops.edge0.router_topk       an MoE block's router and routing.softmax_topk's ATen ops
  torch.ops.edge0.softmax_topk      routing.softmax_topk's ATen ops (decode_ops.cpp)
  torch.ops.edge0.moe_combine       the weighted sum of a token's experts, its shared expert
                                    and the residual (decode_ops.cpp)
  torch.ops.edge0.rms_norm          layers.py RMSNorm of fp32 or bf16 rows (norms.cpp)
  torch.classes.edge0.TokenDecoder  a decode token of one request through every decoder
                                    layer in one call: the ops above, layer after layer
                                    (decode_ops.cpp; engine/backends/native_token.py)
  torch.classes.edge0.Handoff       what a staged token's call shares with the pool's Python
                                    side: slot states and messages (handoff.h;
                                    engine/backends/native_staged.py)
  torch.ops.edge0.prerouter_head    a prerouter head on a few decode rows from its fp16
                                    weights, and its consumer's staged set (heads.cpp: the
                                    one op whose sums are its own, the same on every CPU)

The int4 products are edge0's own kernels (AVX-512, AVX2, portable), each doing what torch's
int4 kernel does for the CPU capability of that name, operation for operation; `kernel_args`
gives the ops the path of torch's capability here (ATEN_CPU_CAPABILITY selects both) and the
arrangement the weights are packed in. `kernel_args(int8=True)` gives the same ops' int8
paths instead (EngineOptions.int4_activations): int8 activation codes, integer dot products,
the same bits on every path, quant.int4_linear_int8 their reference. The norms add their
sums in the order ATen's float reduction adds them (as do the weighted sums), whose vector
width the engine finds by comparing with ATen here (engine/backends/native_layers.py sum_lanes).

The library is compiled with the system's C++ compiler against the installed torch's
headers, in a child process, the first time it is needed (`make` set-up does it: `python -m
edge0.native`), and kept under the cache directory, one build per torch version and source.
A machine without a compiler gets `NativeUnavailable` naming why, and the engine then uses
the pure-PyTorch path (EngineOptions.backend).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from edge0.formats import int4_layout
from edge0.formats.int4_layout import Int4Layout
from edge0.util.paths import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in ("attention.cpp", "decode_ops.cpp", "heads.cpp", "int4_gemv.cpp", "norms.cpp")
]
HEADERS = [
    Path(__file__).with_name(n)
    for n in ("attention.h", "handoff.h", "heads.h", "int4_gemv.h", "norms.h")
]
ISA_PATHS = ("portable", "avx2", "avx512")  # int4_gemv.cpp's paths, by their code
INT8 = 16  # added to a path's code: its int8-activation kernel (int4_gemv.cpp, Path)
# heads.cpp computes the same bits on each of its paths: it takes the widest the CPU has
BEST_ISA = len(ISA_PATHS) - 1
# No -march: int4_gemv.cpp marks its AVX2 and AVX-512 functions with target attributes and
# picks one at run time; no contraction, so the portable path's arithmetic is as written.
# OpenMP: at::parallel_for is inline, and shares torch's threads only when compiled with it
# (the loaded libgomp.so.1 is torch's own, found by its soname).
CFLAGS = ["-O2", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class NativeUnavailable(RuntimeError):
    """The native library could not be built or loaded here (the message says why)."""


def library_path(cache_dir: Path | None = None) -> Path:
    """Where this torch's build of this source lives (its name carries the source's hash)."""
    text = b"".join(f.read_bytes() for f in SOURCES + HEADERS) + " ".join(CFLAGS).encode()
    digest = hashlib.sha256(text).hexdigest()[:12]
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
            f"are needed; backend='torch' computes the same without it): "
            f"{' | '.join(tail) or f'exit status {proc.returncode}'}"
        )
    log.info("compiled in %.1f s", time.perf_counter() - start)
    return path


def compile_into(path: Path) -> None:
    """The child process's half of build(): compile SOURCES into `path`.

    The library is linked in a work folder of this call's own and renamed into place, so a
    process that finds `path` never loads a half-written file. The folder is not shared:
    torch's builder takes a lock file in it and waits, without end, while one exists, so a
    build killed in a shared folder (Ctrl-C at the first start) would hang every later one.
    """
    from torch.utils import cpp_extension

    work = Path(tempfile.mkdtemp(prefix="build-", dir=path.parent))
    try:
        built = cpp_extension.load(
            name=path.stem,
            sources=[str(src) for src in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(work),
            is_python_module=False,
        )
        os.replace(built, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _registered() -> bool:
    return hasattr(torch.ops.edge0, "swiglu_int4_gemv")


def load(cache_dir: Path | None = None) -> None:
    """Build and load the library unless this process registered its ops already: loading a
    second build (another cache folder) would register them again, which aborts the
    process, so registered ops are used as they are. Raises NativeUnavailable saying why
    where it cannot be built."""
    if not _registered():
        torch.ops.load_library(str(build(cache_dir)))


def available(cache_dir: Path | None = None) -> bool:
    """Whether the library builds and loads here; if not, a warning says why and that
    decode takes the pure-PyTorch paths."""
    try:
        load(cache_dir)
    except NativeUnavailable as e:
        log.warning("%s; decode uses the pure-PyTorch paths", e)
        return False
    return True


def kernel_isa() -> int:
    """The int4 path (index into ISA_PATHS) that mirrors torch's int4 kernel in this process:
    the one of torch's CPU capability. Other capabilities (DEFAULT, or an ARM one) take the
    portable path, which mirrors torch's non-vectorised loop (NEON's on aarch64)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return 2 if cap.startswith("AVX512") else 1 if cap == "AVX2" else 0


def layout_code(layout: Int4Layout) -> list[int]:
    """An arrangement as the ops take it: [block, interleaved, tail block, tail interleaved],
    and a fifth code, 1, for one in the int8 order (which only the int8 paths read)."""
    tail = layout.tail
    code = [
        layout.block,
        int(layout.interleaved),
        tail.block if tail else 0,
        int(tail.interleaved) if tail else 0,
    ]
    return code + [1] if layout.int8_order else code


def int8_order_pays() -> bool:
    """Whether experts should sit in the int8 order where decode runs the int8 kernels: where
    that path is a vector one. On AVX2 the order replaces 4 loads and 6 unpacks per 4 columns
    with 2 loads (a layer's 8 experts 1.10-1.13x faster from memory); on AVX-512 it replaces
    the byte permutes with plain loads (the uncapped decode step 1.06x faster, docs/kernels.md).
    The portable loop would gain nothing from it."""
    return kernel_isa() in (1, 2)


@functools.cache
def kernel_args(int8: bool = False) -> tuple[list[int], int]:
    """(layout, isa) for the int4 ops here: the weights' arrangement (the host's, which the
    loader packs them in) and the path of torch's capability, or its int8-activation kernel
    (the same bits on every path)."""
    return layout_code(int4_layout.host_layout()), kernel_isa() + (INT8 if int8 else 0)


def op(name: str, cache_dir: Path | None = None) -> Callable:
    """The library's op `name` (torch.ops.edge0.<name>), built and loaded if need be. Their
    arguments: the module docstring, and each op's schema in its .cpp file."""
    load(cache_dir)
    return getattr(torch.ops.edge0, name)


def token_decoder(cache_dir: Path | None = None) -> Callable:
    """The library's edge0.TokenDecoder class (decode_ops.cpp: a decode token through every
    layer in one call), built and loaded if need be."""
    load(cache_dir)
    return torch.classes.edge0.TokenDecoder


def handoff(cache_dir: Path | None = None) -> Callable:
    """The library's edge0.Handoff class (handoff.h: what a staged decode token in one call
    shares with the pool's Python side), built and loaded if need be."""
    load(cache_dir)
    return torch.classes.edge0.Handoff


def put_in_int8_order(codes: torch.Tensor, own: Int4Layout) -> None:
    """Codes packed [N, K/2] in the arrangement `own`, put in its int8 order in place (the
    pool's reorder, ExtentLayout.finalize)."""
    op("int8_order_")(codes, layout_code(own))


def to_kernel_pairs(pairs: torch.Tensor) -> None:
    """quant.to_kernel_pairs, bit for bit, in one native loop (the pool's fix-up of each
    expert it reads, ExtentLayout.finalize): contiguous bf16 (scale, bias) pairs [..., 2]
    into (scale, zero), in place."""
    op("kernel_pairs_")(pairs)
