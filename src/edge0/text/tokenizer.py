"""Tokenizers from the model directory (transformers, never remote code) and streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from edge0.formats.checkpoint import regular_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    path = Path(path)
    for f in TOKENIZER_FILES:
        if (path / f).exists():
            regular_file(path / f, "tokenizer file")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json, vocab.json, ...)")
    try:
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # transformers' and tokenizers' own, of many kinds
        files = [f for f in TOKENIZER_FILES if (path / f).exists()]
        raise ValueError(
            f"{path}: the tokenizer ({', '.join(files)}) cannot be loaded: "
            f"{type(e).__name__}: {str(e)[:300]}"
        ) from e


def eos_ids(path: Path | str, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """End-of-sequence ids from generation_config.json, config.json and the tokenizer."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            value = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting a character.

    Byte-level BPE can end a token in the middle of a UTF-8 sequence; the decoded text then
    ends in U+FFFD, and we hold it back until the next token completes the character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids before this are already emitted and stable
        self._read = 0  # ids up to here have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]
