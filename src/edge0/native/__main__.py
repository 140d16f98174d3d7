"""`python -m edge0.native`: build the native library now (the Makefile's set-up runs it).

Without a compiler it says so and exits 0: the engine then serves with the pure-PyTorch path.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from edge0 import native


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m edge0.native")
    ap.add_argument("--cache-dir", type=Path, help="default $XDG_CACHE_HOME/edge0")
    ap.add_argument("--compile-into", type=Path, help=argparse.SUPPRESS)  # build()'s child
    args = ap.parse_args()
    if args.compile_into:
        native.compile_into(args.compile_into)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        path = native.build(args.cache_dir)
        native.load(args.cache_dir)  # loads and registers: the build works
    except native.NativeUnavailable as e:
        print(f"edge0: no native decode kernels, the pure-PyTorch paths will be used: {e}")
        return 0
    print(f"edge0: native decode kernels ready ({path}, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
