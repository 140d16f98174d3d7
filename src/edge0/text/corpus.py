"""A text corpus every machine has without a download: the running Python's standard library.

Documents are the stdlib's .py files (tests and site-packages excluded) plus the topics of
`pydoc_data` (the prose behind `help()`): about 12.6 MB on CPython 3.11. Each document goes
to train or held-out by a hash of its name, so the split is the same on every machine that
has the same files, and no held-out file ever leaks into training.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PER_20 = 1  # one document in twenty is held out
SHINGLE_WORDS = 12  # a run this long shared by two documents is copied text, not idiom
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


def site_packages_documents(root: Path | None = None) -> Iterator[Document]:
    """Every .py file of the running interpreter's site-packages (third-party Python): more
    training text on the same machine, never part of the held-out split."""
    root = Path(root or sysconfig.get_paths()["purelib"])
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        try:
            yield Document(
                "site-packages/" + path.relative_to(root).as_posix(),
                path.read_text(encoding="utf-8"),
            )
        except (UnicodeDecodeError, OSError):
            continue  # not UTF-8 text, or unreadable: not corpus material


def shingles(text: str) -> set[int]:
    """Hashes of every run of SHINGLE_WORDS consecutive words. Escapes (\\n, \\t) count as
    spaces, so prose and the same prose inside string literals (pydoc_data/topics.py holds
    the pydoc topics that way) match."""
    words = re.findall(r"\w+", re.sub(r"\\[ntr]", " ", text))
    return {
        hash(" ".join(words[i : i + SHINGLE_WORDS])) for i in range(len(words) - SHINGLE_WORDS + 1)
    }


def shared_fraction(text: str, reference: set[int]) -> float:
    """The fraction of `text`'s shingles that occur in `reference` (0 for very short text)."""
    own = shingles(text)
    return len(own & reference) / len(own) if own else 0.0
