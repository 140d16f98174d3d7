"""Files and folders replaced so that a kill at any moment leaves the old one or the new one.

A file is written under a temporary name, flushed to disk, renamed over the old, and then the
folder holding it is flushed, so the rename itself survives a crash. A folder is swapped with
the old one in one step where the kernel can (Linux's renameat2 RENAME_EXCHANGE), then the
old one is deleted; elsewhere the old one is renamed aside first, and `recover_dir` puts it
back if a kill came between the two renames.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); False where the kernel, the
    C library or the file system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    if renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, path: Path) -> None:
    """Put folder `new` at `path`, flushed, then delete the old one. A kill at any moment
    leaves `path` holding the old folder or the new one (where the two cannot be swapped in
    one step: or the old one at its aside name, between two renames; recover_dir)."""
    new, path = Path(new), Path(path)
    fsync_tree(new)
    if path.exists() and _exchange(new, path):
        fsync_dir(path.parent)
        shutil.rmtree(new)  # (the old folder, now at the new one's name)
        return
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
