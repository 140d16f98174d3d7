"""cgroup.py: a capped run's group is removed once the kernel lets go of it."""

from __future__ import annotations

import errno
import logging
import sys

import pytest

from edge0.util import cgroup


class HeldGroup:
    """A group directory whose rmdir fails with `error` for its first `held` calls."""

    def __init__(self, held: int, error: int = errno.EBUSY):
        self.held, self.error, self.calls = held, error, 0

    def rmdir(self) -> None:
        self.calls += 1
        if self.calls <= self.held:
            raise OSError(self.error, "Device or resource busy")


def test_a_group_the_kernel_still_holds_is_removed_when_it_lets_go():
    group = HeldGroup(held=3)
    cgroup.remove_group(group, wait_s=0)
    assert group.calls == 4


def test_a_group_held_too_long_is_left_behind_and_said_so(caplog):
    group = HeldGroup(held=10)
    with caplog.at_level(logging.WARNING, logger="edge0.util.cgroup"):
        cgroup.remove_group(group, tries=5, wait_s=0)
    assert group.calls == 5
    assert "left the empty memory cgroup" in caplog.text


def test_another_error_is_raised_at_once():
    group = HeldGroup(held=1, error=errno.EACCES)
    with pytest.raises(PermissionError):
        cgroup.remove_group(group, wait_s=0)
    assert group.calls == 1


@pytest.mark.skipif(not cgroup.available(), reason="needs root and cgroup v1")
def test_a_capped_run_reports_its_usage_and_leaves_no_group():
    before = set(cgroup.ROOT.glob("edge0-*"))
    run = cgroup.run_capped([sys.executable, "-c", "b = bytearray(64 << 20)"], 1 << 30)
    assert run.returncode == 0 and run.max_usage_bytes >= 64 << 20
    assert set(cgroup.ROOT.glob("edge0-*")) == before
