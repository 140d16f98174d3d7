"""A kernel read throttle for benchmarks: a cgroup whose reads from the block device holding a
path are limited to a rate, so that one fast disk can stand in for slower ones.

The kernel does the limiting, not edge0: cgroup v1's blkio controller
(`blkio.throttle.read_bps_device` "MAJ:MIN BYTES") where it is mounted, else cgroup v2's io
controller (`io.max` "MAJ:MIN rbps=BYTES" in a child of the unified hierarchy, with `+io` in
its parent's `cgroup.subtree_control`). A process joins by writing its pid to the group's
`cgroup.procs` (util/cgroup.py `run_capped(also=...)` does it before the command execs).

Throttles take a whole disk: a path on a partition is throttled on its disk (the kernel
refuses a partition's numbers), and a path on a filesystem without a block device (tmpfs,
overlay) is refused with the reason. Reads served from the page cache are not disk reads and
pass unthrottled: benchmarks read experts with O_DIRECT (`--io-mode direct`, the default).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from edge0.util.cgroup import remove_group

MOUNTINFO = Path("/proc/self/mountinfo")
SYSFS = Path("/sys")


@dataclass(frozen=True)
class Hierarchy:
    """Where read throttles are made: cgroup v1's blkio mount or the v2 unified mount."""

    version: int
    root: Path


def find_hierarchy(mountinfo: Path = MOUNTINFO) -> Hierarchy | None:
    """The blkio (v1) mount if there is one, else a cgroup2 mount that offers the io
    controller; None if neither (or no such mount is writable)."""
    v1 = v2 = None
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        point, fstype, opts = Path(fields[4]), fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup" and "blkio" in opts and v1 is None:
            v1 = Hierarchy(1, point)
        elif fstype == "cgroup2" and v2 is None:
            controllers = point / "cgroup.controllers"
            if controllers.is_file() and "io" in controllers.read_text().split():
                v2 = Hierarchy(2, point)
    for h in (v1, v2):
        if h is not None and os.access(h.root, os.W_OK):
            return h
    return None


def block_device(path: Path | str, sysfs: Path = SYSFS) -> tuple[int, int]:
    """(major, minor) of the whole disk that holds `path`."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        raise ValueError(
            f"{path} is on a filesystem without a block device (device 0:{minor}: tmpfs, "
            "overlay or network): a kernel read throttle needs the disk it is read from"
        )
    node = sysfs / "dev" / "block" / f"{major}:{minor}"
    if (node / "partition").is_file():  # a partition: its disk is the parent in sysfs
        major, minor = map(int, (node.resolve().parent / "dev").read_text().split(":"))
    return major, minor


class ReadThrottle:
    """A new cgroup whose reads from the disk holding `path` run at most `rate` bytes/s;
    removed on exit. `procs` is the file a process joins it by."""

    def __init__(
        self,
        path: Path | str,
        rate: int,
        hierarchy: Hierarchy | None = None,
        sysfs: Path = SYSFS,
    ):
        if rate <= 0:
            raise ValueError(f"a read rate must be positive, not {rate}")
        h = hierarchy or find_hierarchy()
        if h is None:
            raise PermissionError(
                "read throttles need root and a writable cgroup blkio (v1) or io (v2) "
                "controller; neither is mounted writable here"
            )
        self.version, self.rate = h.version, rate
        self.device = block_device(path, sysfs)
        if h.version == 2:  # children of the root get the io controller
            control = h.root / "cgroup.subtree_control"
            if "io" not in control.read_text().split():
                control.write_text("+io")
        self.path = h.root / f"edge0-read-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        dev = "{}:{}".format(*self.device)
        try:
            if h.version == 1:
                (self.path / "blkio.throttle.read_bps_device").write_text(f"{dev} {rate}")
            else:
                (self.path / "io.max").write_text(f"{dev} rbps={rate}")
        except OSError:
            remove_group(self.path)
            raise

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def read_bytes(self) -> int:
        """Bytes the group's processes have read from the throttled disk."""
        dev = "{}:{}".format(*self.device)
        if self.version == 1:
            for line in (self.path / "blkio.throttle.io_service_bytes").read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == dev and parts[1] == "Read":
                    return int(parts[2])
            return 0
        for line in (self.path / "io.stat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == dev:
                stats = dict(p.split("=", 1) for p in parts[1:])
                return int(stats.get("rbytes", 0))
        return 0

    def __enter__(self) -> ReadThrottle:
        return self

    def __exit__(self, *exc) -> None:
        remove_group(self.path)
