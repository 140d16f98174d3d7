"""A text corpus every machine has without a download: the running Python's standard library.

Documents are the stdlib's .py files (tests and site-packages excluded) plus the topics of
`pydoc_data` (the prose behind `help()`): about 12.6 MB on CPython 3.11. Each document goes
to train or held-out by a hash of its name, so the split is the same on every machine that
has the same files, and no held-out file ever leaks into training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PER_20 = 1  # one document in twenty is held out
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def split_of(name: str) -> str:
    digest = hashlib.sha256(name.encode()).digest()
    return "heldout" if digest[0] % 20 < HELDOUT_PER_20 else "train"


def _source_files(root: Path) -> list[Path]:
    files = [
        p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def documents(split: str, root: Path | None = None) -> Iterator[Document]:
    """Documents of one split ("train" or "heldout"), in a fixed order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in _source_files(root):
        name = "stdlib/" + path.relative_to(root).as_posix()
        if split_of(name) == split:
            try:
                yield Document(name, path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue  # a few files are Latin-1 test data or unreadable: not corpus material
    from pydoc_data.topics import topics

    for key in sorted(topics):
        name = f"pydoc/{key}"
        if split_of(name) == split:
            yield Document(name, topics[key])


def corpus_hash(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode() + b"\0" + d.text.encode() + b"\0")
    return h.hexdigest()
