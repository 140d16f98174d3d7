"""The native sources on a CPU that is not x86 (ARM): their portable paths must compile. The
x86 paths sit behind one test of the target, and what only aarch64 does behind another; with
the first false and the second true, every source must still build. This machine's compiler
checks it, so an ARM build cannot break unseen."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from torch.utils import cpp_extension

from edge0 import native

X86_TEST = "defined(__x86_64__) || defined(_M_X64)"
ARM_TEST = "defined(__aarch64__)"


@pytest.mark.slow
def test_the_native_sources_compile_as_on_arm(tmp_path):
    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler: the native ops are not built here either")
    for f in native.SOURCES + native.HEADERS:
        text = f.read_text()
        (tmp_path / f.name).write_text(text.replace(X86_TEST, "0").replace(ARM_TEST, "1"))
    for test in (X86_TEST, ARM_TEST):  # both tests are still written this way
        assert any(test in f.read_text() for f in native.SOURCES), test
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    for src in native.SOURCES:
        proc = subprocess.run(
            [cxx, "-fsyntax-only", "-std=c++17", *native.CFLAGS, *includes, "-I", str(tmp_path)]
            + [str(tmp_path / src.name)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"{src.name} as on ARM:\n{proc.stderr[-2000:]}"
