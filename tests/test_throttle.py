"""The bench's kernel read throttle (util/throttle.py, `edge0 bench --read-bandwidth`).

Its setup in cgroup v1 and v2 layouts (temporary directories standing in for the kernel's
files), the disk it picks for a path on a partition, its refusal of a path without a block
device; and where this machine has a writable blkio controller, the real thing: reads inside
the group run at the set rate, the group is gone afterwards, and the bench's capped arms read
through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge0.bench import sweep
from edge0.bench.ab import BenchConfig, run_bench
from edge0.convert.synth import Shape, synth
from edge0.formats.extents import ExtentLayout
from edge0.util import cgroup
from edge0.util.throttle import Hierarchy, ReadThrottle, block_device, find_hierarchy


def mountinfo(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "mountinfo"
    p.write_text("".join(line + "\n" for line in lines))
    return p


def test_the_v1_blkio_mount_is_preferred_and_v2_needs_the_io_controller(tmp_path):
    v1, v2 = tmp_path / "blkio", tmp_path / "unified"
    v1.mkdir()
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    blkio = f"38 31 0:35 / {v1} rw,relatime - cgroup cgroup rw,blkio"
    unified = f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw"
    memory_only = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory"
    assert find_hierarchy(mountinfo(tmp_path, memory_only, unified, blkio)) == Hierarchy(1, v1)
    assert find_hierarchy(mountinfo(tmp_path, memory_only, unified)) is None  # no io in v2
    (v2 / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert find_hierarchy(mountinfo(tmp_path, unified)) == Hierarchy(2, v2)


def test_the_group_is_set_up_as_each_version_reads_it(tmp_path):
    """v1: blkio.throttle.read_bps_device 'MAJ:MIN BYTES'; v2: io.max 'MAJ:MIN rbps=BYTES'
    and '+io' in the root's subtree_control (plain files here, so removed by hand)."""
    disk = "{}:{}".format(*block_device(tmp_path)) if os.major(os.stat(tmp_path).st_dev) else None
    if disk is None:
        pytest.skip(f"{tmp_path} has no block device here")
    v1 = tmp_path / "v1"
    v1.mkdir()
    t = ReadThrottle(tmp_path, 500_000_000, Hierarchy(1, v1))
    assert (t.path / "blkio.throttle.read_bps_device").read_text() == f"{disk} 500000000"
    assert t.procs == t.path / "cgroup.procs" and t.path.parent == v1
    (t.path / "blkio.throttle.io_service_bytes").write_text(
        f"{disk} Read 4096\n{disk} Write 0\nTotal 4096\n"
    )
    assert t.read_bytes() == 4096
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.subtree_control").write_text("cpu memory\n")
    t = ReadThrottle(tmp_path, 200_000_000, Hierarchy(2, v2))
    assert (t.path / "io.max").read_text() == f"{disk} rbps=200000000"
    assert (v2 / "cgroup.subtree_control").read_text() == "+io"
    (t.path / "io.stat").write_text(f"{disk} rbytes=8192 wbytes=0 rios=2 wios=0\n")
    assert t.read_bytes() == 8192
    with pytest.raises(ValueError, match="must be positive"):
        ReadThrottle(tmp_path, 0, Hierarchy(1, v1))


def test_a_partition_is_throttled_on_its_disk(tmp_path):
    dev = os.stat(tmp_path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        pytest.skip(f"{tmp_path} has no block device here")
    sysfs = tmp_path / "sys"
    part = sysfs / "devices" / "block" / "sdz" / "sdz2"
    part.mkdir(parents=True)
    (part / "partition").write_text("2\n")
    (part.parent / "dev").write_text("8:240\n")
    (sysfs / "dev" / "block").mkdir(parents=True)
    (sysfs / "dev" / "block" / f"{major}:{minor}").symlink_to(part)
    assert block_device(tmp_path, sysfs) == (8, 240)


def test_a_path_without_a_block_device_is_refused_with_the_reason():
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.major(os.stat(shm).st_dev) != 0:
        pytest.skip("no tmpfs at /dev/shm")
    with pytest.raises(ValueError, match="without a block device"):
        block_device(shm)


def test_rates_are_read_in_decimal_units():
    assert sweep.parse_rates("0.2G,500M, 1GB/s,none") == [200_000_000, 500_000_000, 10**9, None]
    with pytest.raises(ValueError, match="like 0.5G"):
        sweep.parse_rates("fast")
    with pytest.raises(ValueError, match="like 0.5G"):
        sweep.parse_rates("0G")


REAL = find_hierarchy() is not None and os.geteuid() == 0
real = pytest.mark.skipif(not REAL, reason="needs root and a writable blkio/io controller")

READ = (
    "import mmap, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n"
    "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\n"
    "buf, n, t = mmap.mmap(-1, 1 << 20), 0, time.perf_counter()\n"
    "while (r := os.preadv(fd, [buf], n)) > 0:\n"
    "    n += r\n"
    "print(n / (time.perf_counter() - t))\n"
)


@real
def test_the_kernel_reads_at_the_set_rate_and_the_group_is_removed(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(12 << 20))
    rate = 8_000_000
    with ReadThrottle(data, rate) as t:
        cmd = ["sh", "-c", f'echo $$ > {t.procs} && exec "$@"', "x", sys.executable, "-c", READ]
        t0 = time.perf_counter()
        got = float(subprocess.run([*cmd, str(data)], capture_output=True, text=True,
                                   check=True).stdout)  # fmt: skip
        elapsed = time.perf_counter() - t0
        assert t.read_bytes() >= 12 << 20  # the reads were the group's
        group = t.path
    assert not group.exists()
    # 12 MiB at 8 MB/s: ~1.6 s (the kernel lets a first slice through at once)
    assert got < 1.5 * rate and elapsed > 1.0, (got, elapsed)


@real
@pytest.mark.skipif(not cgroup.available(), reason="needs the cgroup v1 memory controller")
def test_the_benchs_capped_arms_read_through_the_throttle(tmp_path):
    shape = Shape(layers=3, hidden=256, heads=4, kv_heads=2, experts=16, top_k=4, vocab=4096)
    model = synth(tmp_path / "m", shape, progress=False)
    cfg = BenchConfig(
        arms=("prerouter", "ondemand"),
        memory_cap=1 << 30,
        expert_cache=24 * ExtentLayout(256, shape.expert_width).nbytes,  # half of 3 x 16
        tokens=6,
        warmup=2,
        rounds=1,
        read_bandwidth=50_000_000,
    )
    s = run_bench(model, cfg)
    assert s["read_bandwidth"] == 50_000_000
    assert s["disk_bandwidth_bytes_per_s"] < 1.5 * 50_000_000  # measured inside the throttle
    assert any("read throttle of 0.05 GB/s" in n for n in s["notes"])
    for arm in ("prerouter", "ondemand"):
        assert s["arms"][arm]["bytes_per_step"] > 0 and s["arms"][arm]["dropped"] == 0
    json.dumps(s)  # the summary is JSON as the CLI writes it


def point(k, rate, disk, pre_tok_s, od_tok_s, step_bytes=100 << 20):
    arm = lambda t: {"decode_tok_s": {"median": t}, "bytes_per_step": step_bytes}  # noqa: E731
    return {
        "top_k": k,
        "read_bandwidth": rate,
        "disk_bandwidth_bytes_per_s": disk,
        "C_ms": 300.0,
        "arms": {"prerouter": arm(pre_tok_s), "ondemand": arm(od_tok_s)},
    }


def test_the_plots_series_keep_throttled_and_unthrottled_runs_apart():
    s = {"points": [point(4, None, 1.7e9, 3.0, 2.2), point(4, 5e8, 5e8, 1.9, 1.9),
                    point(4, 1e9, 1e9, 2.4, 1.9)]}  # fmt: skip
    d = sweep.series(s)[4]
    assert d["gb_s"] == [0.5, 1.0] and d["prerouter"] == [1.9, 2.4] and d["ondemand"] == [1.9, 1.9]
    assert d["free_gb_s"] == [1.7] and d["free_prerouter"] == [3.0]
    # the bound: 1 / max(C, D) with D the prerouter's bytes at each rate of the grid
    for g, t in zip(d["bound_gb_s"], d["bound_tok_s"], strict=True):
        assert t == pytest.approx(1e3 / max(300.0, 1e3 * (100 << 20) / (g * 1e9)))
    assert min(d["bound_gb_s"]) < 0.5 and max(d["bound_gb_s"]) > 1.7
