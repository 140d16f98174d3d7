"""`edge0 train teacher-cache TEACHER_DIR --data ... --out DIR`: the teacher, run once.

Phase 2 distils the teacher's distribution at every continuation position of its windows.
The cache holds what that loss needs, the paper's "top-k + tail": per position the teacher's
k most likely tokens, their log-probabilities and the log of the probability mass outside
them. `edge0 train sft --teacher-cache DIR` then trains with no teacher in memory.

Windows are random windows of the corpus's training split, prompt_len + gen_len tokens, the
same kind `train sft --source corpus` draws; a continuation position is one from prompt_len - 1
on (it predicts a continuation token). They are written in shards of `shard_windows`
windows, each its own safetensors file written atomically, whose windows are a function of
(seed, shard): a run that stops is resumed by running it again, and shards already written
are kept. `cache.json` records what made the cache (the teacher's files, the data, the
shape, k) and a resume with other settings is refused.

Per shard: tokens int32 [n, T], ids int32 [n, C, k], logprobs fp16 [n, C, k], tail fp32
[n, C] (log of 1 - the top k's probability, from the teacher's full distribution).
Shape legend: n windows, T = prompt_len + gen_len, C = gen_len positions, k top tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from edge0.text.tokenizer import load_tokenizer
from edge0.train import common

MANIFEST = "cache.json"
FORMAT_VERSION = 1


@dataclass
class CacheConfig:
    windows: int = 1024
    prompt_len: int = 32
    gen_len: int = 224
    topk: int = 32
    shard_windows: int = 128
    batch: int = 8  # windows per teacher forward
    seed: int = 0


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def teacher_identity(teacher_dir: Path) -> str:
    """A hash of the teacher's config and tokenizer files and its weights' sizes and heads
    (not every weight byte: a 70 GB teacher is not read twice to name it)."""
    h = hashlib.sha256()
    for f in sorted(teacher_dir.iterdir()):
        if not f.is_file():
            continue
        h.update(f.name.encode())
        if f.suffix == ".json" or f.stat().st_size < (1 << 20):
            h.update(f.read_bytes())
        else:
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def top_k_and_tail(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [..., V] -> the top k's ids int32 and log-probabilities [..., k] and the log
    of the remaining mass [...] (fp32, from the full distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top, ids = torch.topk(logp, k, dim=-1)
    rest = logp.scatter(-1, ids, float("-inf"))
    return ids.to(torch.int32), top, torch.logsumexp(rest, dim=-1)


def build(teacher_dir: Path, data: list[str], out: Path, cfg: CacheConfig, progress: bool) -> dict:
    """Write (or finish) the cache in `out`; returns its summary."""
    # the teacher's loaders live with the student
    from edge0.train.student import close_teacher, load_teacher

    teacher_dir, out = Path(teacher_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(teacher_dir)
    stream, data_hash = common.token_stream(data, "train", tok)
    length = cfg.prompt_len + cfg.gen_len
    meta = {
        "format_version": FORMAT_VERSION,
        "teacher": teacher_identity(teacher_dir),
        "data_hash": data_hash,
        "vocab_size": len(tok),
        **asdict(cfg),
    }
    meta.pop("batch")  # how fast it was made, not what it holds
    path = out / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        differs = sorted(k for k in meta if old.get(k) != meta[k])
        if differs:
            raise ValueError(
                f"{out} holds a teacher cache made with other {', '.join(differs)}; "
                "use another --out or the same settings"
            )
    else:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path)
    shards = -(-cfg.windows // cfg.shard_windows)
    todo = [i for i in range(shards) if not (out / shard_name(i)).exists()]
    teacher = load_teacher(teacher_dir, rows=cfg.batch, length=length) if todo else None
    bar = tqdm(
        total=cfg.windows,
        initial=cfg.windows - sum(_shard_size(cfg, i) for i in todo),
        desc="teacher cache",
        unit="window",
        disable=not progress,
    )
    try:
        for i in todo:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
            windows = common.random_windows(stream, _shard_size(cfg, i), length - 1, gen)
            parts = []
            for rows in windows.split(cfg.batch):
                with torch.no_grad():
                    logits = teacher(rows)[:, cfg.prompt_len - 1 : -1]  # [b, C, V]
                parts.append(top_k_and_tail(logits, cfg.topk))
                bar.update(rows.shape[0])
            ids, top, tail = (torch.cat(t) for t in zip(*parts, strict=True))
            tensors = {
                "tokens": windows.to(torch.int32),
                "ids": ids,
                "logprobs": top.to(torch.float16),
                "tail": tail,
            }
            tmp = out / (shard_name(i) + ".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, out / shard_name(i))
    finally:
        bar.close()
        close_teacher(teacher)
    return summary(out)


def _shard_size(cfg: CacheConfig, i: int) -> int:
    return min(cfg.shard_windows, cfg.windows - i * cfg.shard_windows)


def summary(out: Path) -> dict:
    meta = json.loads((out / MANIFEST).read_text())
    shard_bytes = sum(f.stat().st_size for f in out.glob("shard-*.safetensors"))
    positions = meta["windows"] * meta["gen_len"]
    return {**meta, "bytes": shard_bytes, "bytes_per_position": shard_bytes / positions}


class TeacherCache:
    """A finished cache, read a batch of windows at a time (the shards are mapped, not
    loaded)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.exists():
            raise FileNotFoundError(
                f"{self.path}: no {MANIFEST}; build it with edge0 train teacher-cache"
            )
        self.meta = json.loads(manifest.read_text())
        self.windows = self.meta["windows"]
        self.prompt_len, self.gen_len = self.meta["prompt_len"], self.meta["gen_len"]
        per = self.meta["shard_windows"]
        shards = -(-self.windows // per)
        missing = [shard_name(i) for i in range(shards) if not (self.path / shard_name(i)).exists()]
        if missing:
            raise ValueError(
                f"{self.path}: {len(missing)} of {shards} shards missing ({missing[0]}, ...); "
                "run edge0 train teacher-cache again to finish it"
            )
        self._files = [safe_open(str(self.path / shard_name(i)), "pt") for i in range(shards)]
        self._per = per

    def check(self, vocab_size: int) -> None:
        if self.meta["vocab_size"] != vocab_size:
            raise ValueError(
                f"{self.path}: the teacher cache's vocabulary has {self.meta['vocab_size']} "
                f"tokens, the student's {vocab_size}"
            )

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Windows `index` [B] -> tokens [B, T] long, ids [B, C, k] long, logprobs [B, C, k]
        and tail [B, C] fp32."""
        out = []
        for w in index.tolist():
            f, r = self._files[w // self._per], w % self._per
            out.append(
                [f.get_slice(name)[r : r + 1] for name in ("tokens", "ids", "logprobs", "tail")]
            )
        tokens, ids, logprobs, tail = (torch.cat(t) for t in zip(*out, strict=True))
        return tokens.long(), ids.long(), logprobs.float(), tail


def top_k_tail_kl(
    logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, tail: torch.Tensor
) -> torch.Tensor:
    """Mean over positions of KL(p || q) on the teacher's top k plus one tail outcome:
    sum_S p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail), p the teacher's cached
    top-k log-probabilities and tail mass, q = softmax(logits [..., V])."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    lq = logq.gather(-1, ids)
    q_tail = (1 - lq.exp().sum(-1)).clamp_min(1e-6)
    p = logprobs.exp()
    kl = (p * (logprobs - lq)).sum(-1) + tail.exp() * (tail - q_tail.log())
    return kl.mean()
