"""Run a command under a cgroup-v1 memory cap (root only), and read what it used.

The child joins the group before it execs (a tiny `sh` wrapper writes its own pid to
cgroup.procs), so everything the command allocates, page cache included, is charged to it.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")
log = logging.getLogger(__name__)


@dataclass
class CappedRun:
    returncode: int
    max_usage_bytes: int
    failcnt: int
    stdout: str
    stderr: str


def available() -> bool:
    return ROOT.is_dir() and os.access(ROOT, os.W_OK)


class CappedGroup:
    """A new memory cgroup (v1) with a limit, removed on exit; `command(cmd)` wraps a command
    so that it joins the group before it execs."""

    def __init__(self, limit_bytes: int):
        if not available():
            raise PermissionError(f"{ROOT} is not writable: memory caps need root and cgroup v1")
        self.path = ROOT / f"edge0-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def command(self, cmd: list[str], also: tuple[Path, ...] = ()) -> list[str]:
        """cmd, joining this group (and the groups whose cgroup.procs `also` names: a read
        throttle's, util/throttle.py) before it execs."""
        return joining(cmd, (self.path / "cgroup.procs", *also))

    @property
    def max_usage_bytes(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    @property
    def failcnt(self) -> int:
        return int((self.path / "memory.failcnt").read_text())

    def __enter__(self) -> CappedGroup:
        return self

    def __exit__(self, *exc) -> None:
        remove_group(self.path)


def joining(cmd: list[str], procs: tuple[Path, ...]) -> list[str]:
    """cmd wrapped in a tiny `sh` that writes its own pid to each cgroup.procs in `procs`,
    then execs cmd: everything the command does is charged to those groups."""
    join = " && ".join(f"echo $$ > {p}" for p in procs) + ' && exec "$@"'
    return ["sh", "-c", join, "edge0-cgroup", *cmd]


def run_capped(
    cmd: list[str],
    limit_bytes: int,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    also: tuple[Path, ...] = (),
) -> CappedRun:
    """Run cmd with memory.limit_in_bytes = limit_bytes (and in the groups `also` names);
    the group is removed afterwards."""
    with CappedGroup(limit_bytes) as group:
        proc = subprocess.run(
            group.command(cmd, also), capture_output=True, text=True, timeout=timeout, env=env
        )
        return CappedRun(
            proc.returncode, group.max_usage_bytes, group.failcnt, proc.stdout, proc.stderr
        )


def remove_group(group: Path, tries: int = 100, wait_s: float = 0.02) -> None:
    """rmdir the group once the kernel lets go of it. Right after its last task exits, the
    kernel can still hold a group (EBUSY): `edge0 bench` then failed with a traceback after
    its arm had run. A group still held after `tries` is left behind, and said so."""
    for _ in range(tries):
        try:
            group.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(wait_s)
    log.warning("left the empty memory cgroup %s behind: the kernel still holds it", group)
