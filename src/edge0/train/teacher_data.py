"""The teacher's token streams: training text, the held-out split, and its clean part.

Training text is the train split of `--data` plus, optionally, train-only `--extra-train`
sources (`site-packages`: the running interpreter's third-party Python, or paths), capped at
`--extra-chars` in a fixed order. An extra document that shares any 12-word run with a
held-out document is dropped: vendored copies of stdlib modules (setuptools' distutils)
would otherwise put held-out text into training.

The held-out stream is every held-out document of `--data`, as `edge0 eval` reads it. Its
*clean* part leaves out the held-out documents that share more than CLEAN_MAX_SHARED of their
12-word runs with training text. On the stdlib corpus that is pydoc_data/topics.py (62% of
the held-out characters), whose topics are also training documents (`pydoc/<topic>`), and a
few generated codec tables: perplexity there measures recall of training text as much as
prediction. Both are reported; early stopping watches the clean one.

The tokenizer is trained on `--data`'s train split only (or taken as found in OUT_DIR), so
extra text never changes how the held-out text is tokenized.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from edge0.text import corpus
from edge0.text.tokenizer import load_tokenizer
from edge0.text.tokenizer_train import train_bpe
from edge0.train import common
from edge0.train.data import load_texts, read_files

log = logging.getLogger(__name__)

CLEAN_MAX_SHARED = 0.1


@dataclass
class TeacherData:
    train: torch.Tensor
    heldout: torch.Tensor
    heldout_clean: torch.Tensor
    info: dict


def extra_documents(sources: list[str]) -> list[corpus.Document]:
    docs: list[corpus.Document] = []
    for src in sources:
        if src == "site-packages":
            docs += corpus.site_packages_documents()
        else:
            docs += [corpus.Document(name, text) for name, text in read_files([src])]
    # a fixed order that mixes packages, so a cap takes a sample of all of them
    return sorted(docs, key=lambda d: hashlib.sha256(d.name.encode()).digest())


def select_extra(
    docs: list[corpus.Document], heldout: set[int], max_chars: int
) -> tuple[list[str], list[str]]:
    """(kept texts, names dropped for sharing text with held-out) up to max_chars."""
    kept, dropped, seen, chars = [], [], set(), 0
    for d in docs:
        if chars >= max_chars:
            break
        digest = hashlib.sha256(d.text.encode()).digest()
        if digest in seen:
            continue  # the same file shipped twice (vendored copies)
        seen.add(digest)
        if corpus.shingles(d.text) & heldout:
            dropped.append(d.name)
            continue
        kept.append(d.text)
        chars += len(d.text)
    return kept, dropped


def load(out: Path, vocab: int, data: list[str], extra: list[str], extra_chars: int):
    """(tokenizer, TeacherData), tokenized once and cached in OUT/run/tokens.pt."""
    train_docs, train_hash = load_texts(data, "train")
    if not (out / "tokenizer.json").exists():
        train_bpe(train_docs, vocab, out)
    tok = load_tokenizer(out)
    key = json.dumps(
        {
            "data": data,
            "extra": extra,
            "extra_chars": extra_chars if extra else 0,
            "tokenizer": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        },
        sort_keys=True,
    )
    cache = out / "run" / "tokens.pt"
    if cache.exists():
        cached = torch.load(cache)
        if cached.get("key") != key:
            raise ValueError(
                f"{out} holds a run on other data or another tokenizer ({cached.get('key')}); "
                "use a new OUT_DIR, or delete it to start over"
            )
        return tok, TeacherData(**cached["data"])
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    held_docs, held_hash = load_texts(data, "heldout")
    held_shingles = set().union(*(corpus.shingles(t) for t in held_docs))
    extra_texts, dropped = select_extra(extra_documents(extra), held_shingles, extra_chars)
    if dropped:
        log.info("extra training text: %d files dropped for sharing held-out text", len(dropped))
    train_shingles = set().union(*(corpus.shingles(t) for t in train_docs + extra_texts))
    clean = [t for t in held_docs if corpus.shared_fraction(t, train_shingles) < CLEAN_MAX_SHARED]
    result = TeacherData(
        train=common.tokenize(train_docs + extra_texts, tok, eos),
        heldout=common.tokenize(held_docs, tok, eos),
        heldout_clean=common.tokenize(clean, tok, eos),
        info={
            "train_hash": train_hash,
            "heldout_hash": held_hash,
            "train_documents": len(train_docs),
            "train_chars": sum(map(len, train_docs)),
            "extra_documents": len(extra_texts),
            "extra_chars": sum(map(len, extra_texts)),
            "extra_dropped": dropped,
            "heldout_documents": len(held_docs),
            "heldout_clean_documents": len(clean),
            "heldout_clean_chars": sum(map(len, clean)),
        },
    )
    torch.save({"key": key, "data": vars(result)}, cache)
    return tok, result
