"""Files and folders replaced so that a kill at any moment leaves the old one or the new one.

A file is written under a temporary name, flushed to disk, renamed over the old, and then the
folder holding it is flushed, so the rename itself survives a crash. A folder is swapped the
same way, with the old one renamed aside first and deleted last (`replace_dir`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_tree(path: Path) -> None:
    """Flush every file of a folder and the folder itself."""
    for p in Path(path).iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def aside_name(path: Path) -> Path:
    """Where replace_dir puts the old folder while the new one is renamed in."""
    return path.with_name(f"{path.name}.old")


def replace_dir(new: Path, path: Path) -> None:
    """Put folder `new` at `path`: the old one is renamed aside, the new one renamed in, and
    only then the old one deleted, each step flushed. A kill leaves `path` holding the old
    folder or the new one (or, between the two renames, the old one at its aside name,
    which recover_dir puts back)."""
    new, path = Path(new), Path(path)
    fsync_tree(new)
    old = aside_name(path)
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
        fsync_dir(path.parent)
    os.rename(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_dir(path: Path) -> None:
    """Undo a replace_dir killed between its two renames: the old folder back at `path`."""
    path = Path(path)
    old = aside_name(path)
    if old.is_dir() and not path.exists():
        os.rename(old, path)
        fsync_dir(path.parent)
    elif old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
