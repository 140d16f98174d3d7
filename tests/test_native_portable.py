"""The native sources on a CPU that is not x86 (ARM): their portable paths must compile. The
x86 paths sit behind one test of the target; with that test false, every source must still
build. This machine's compiler checks it, so an ARM build cannot break unseen."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from torch.utils import cpp_extension

from edge0 import native

X86_TEST = "defined(__x86_64__) || defined(_M_X64)"


@pytest.mark.slow
def test_the_native_sources_compile_without_their_x86_paths(tmp_path):
    cxx = shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler: the native ops are not built here either")
    for f in native.SOURCES + native.HEADERS:
        text = f.read_text()
        (tmp_path / f.name).write_text(text.replace(X86_TEST, "0"))
    assert any(X86_TEST in f.read_text() for f in native.SOURCES)  # the test still exists
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    for src in native.SOURCES:
        proc = subprocess.run(
            [cxx, "-fsyntax-only", "-std=c++17", *native.CFLAGS, *includes, "-I", str(tmp_path)]
            + [str(tmp_path / src.name)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"{src.name} without its x86 paths:\n{proc.stderr[-2000:]}"
