"""Memory accounting: anonymous and file-backed resident bytes, and the peak sampler."""

from __future__ import annotations

import mmap
import time

import torch

from edge0 import memory


def test_anonymous_and_file_backed_bytes_are_told_apart(tmp_path):
    before = memory.sample()
    x = torch.ones(64 << 18)  # 64 MiB of fp32, touched
    grown = memory.sample()
    assert grown.anon_bytes - before.anon_bytes >= 60 << 20
    path = tmp_path / "f"
    path.write_bytes(b"\1" * (32 << 20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        total = sum(m[i] for i in range(0, len(m), 4096))  # fault every page in
        mapped = memory.sample()
    assert total == (32 << 20) // 4096
    assert mapped.file_bytes - grown.file_bytes >= 30 << 20
    assert abs(mapped.anon_bytes - grown.anon_bytes) < 16 << 20
    del x


def test_peak_sampler_sees_a_short_peak():
    with memory.PeakSampler(interval_s=0.005) as peaks:
        start = memory.sample().anon_bytes
        x = torch.ones(32 << 18)  # 32 MiB
        time.sleep(0.05)
        del x
    assert peaks.peak_anon - start >= 30 << 20
