"""Text for the training phases: the built-in stdlib corpus or the user's files.

`--data stdlib` is the corpus of `edge0.text.corpus` (train split; its held-out split for
evaluation). Otherwise --data names text files or directories (every *.py, *.txt, *.md,
*.jsonl... regular file below them, in sorted order); their held-out share is chosen by a
hash of each file's path, like the corpus, so it is stable across runs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from edge0.text import corpus

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".html"}


def _files(paths: list[str]) -> list[tuple[Path, str]]:
    """(file, name) of every text file below `paths`. The name is the file's path below the
    directory it was found in (a file given by itself: its name), so that the held-out split
    and the data hash do not depend on where the data lives."""
    out: list[tuple[Path, str]] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"--data {p}: no such file or directory")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            out += [(f, f.relative_to(p).as_posix()) for f in found]
        else:
            out.append((p, p.name))
    if not out:
        raise ValueError(f"--data {' '.join(paths)}: no text files found")
    return out


def read_files(paths: list[str], split: str | None = None) -> list[tuple[str, str]]:
    """(name, text) of every text file below `paths` (names as _files gives them), of one
    split or of both (None)."""
    out = []
    for f, name in _files(paths):
        if split is not None and corpus.split_of(name) != split:
            continue
        try:
            out.append((name, f.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise ValueError(f"--data {f}: not UTF-8 text ({e})") from e
    return out


def load_texts(data: list[str], split: str) -> tuple[list[str], str]:
    """(documents, sha256 of their names and contents) for split 'train' or 'heldout'."""
    if data == ["stdlib"]:
        docs = list(corpus.documents(split))
        return [d.text for d in docs], corpus.corpus_hash(docs)
    docs = []
    h = hashlib.sha256()
    for name, text in read_files(data, split):
        docs.append(text)
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    if not docs:
        raise ValueError(f"--data: no {split} documents (a held-out share needs several files)")
    return docs, h.hexdigest()
