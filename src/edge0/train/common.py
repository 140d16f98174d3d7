"""What every training phase shares: seeding, token data, schedules, resumable checkpoints, logs.

A run directory holds `state.pt` (model trainables, optimizer, step, RNG states), written
atomically every `save_every` steps, and `log.json` (every logged loss). Re-running the same
command resumes from `state.pt`; with the same `--seed` the result is the same as an
uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from edge0.models.layers import RMSNorm
from edge0.train.data import load_texts


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def device_for(name: str | None = None) -> torch.device:
    """The GPU when there is one (or the one asked for), else the CPU."""
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def init_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    """Fresh weights for a meta-built model: normal(0, std) matrices, unit norms, zero biases."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            if name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def tokenize(docs: Iterable[str], tokenizer, eos_id: int) -> torch.Tensor:
    """One long int32 stream: each document's tokens followed by the end-of-text id."""
    ids: list[int] = []
    for text in docs:
        ids.extend(tokenizer.encode(text))
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def token_stream(data: list[str], split: str, tokenizer) -> tuple[torch.Tensor, str]:
    """The `split` ("train" or "heldout") of --data as one stream (`tokenize`), and its hash."""
    docs, data_hash = load_texts(data, split)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return tokenize(docs, tokenizer, eos), data_hash


def random_windows(
    stream: torch.Tensor, batch: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """[batch, length + 1] windows starting at random offsets (inputs and shifted targets)."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()]).long()


def fixed_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping evaluation windows: the same every time."""
    n = min(count, (stream.numel() - 1) // length)
    step = (stream.numel() - 1 - length) // max(1, n - 1) if n > 1 else 0
    return torch.stack([stream[i * step : i * step + length + 1] for i in range(n)]).long()


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))


@dataclass
class RunLog:
    """Losses and evaluations of one run, rewritten to log.json as they come."""

    path: Path
    config: dict
    entries: list[dict] = field(default_factory=list)

    def add(self, **entry) -> None:
        self.entries.append(entry)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": self.config, "entries": self.entries}, indent=1))
        os.replace(tmp, self.path)

    @classmethod
    def resume(cls, path: Path, config: dict) -> RunLog:
        if path.exists():
            data = json.loads(path.read_text())
            return cls(path, config, data.get("entries", []))
        return cls(path, config)


def save_state(
    path: Path,
    step: int,
    model_state: dict,
    optimizer,
    gen: torch.Generator | None,
    extra: dict | None = None,
) -> None:
    """Write a resumable checkpoint atomically. `gen` may be None for a run whose data order
    is a function of the step (train/passes.py) rather than of a generator's state."""
    state = {
        "step": step,
        "model": model_state,
        # an optimizer, or its state dict already taken (gathered from ranks)
        "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
        "gen": None if gen is None else gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "extra": extra or {},
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: Path) -> dict | None:
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state


def config_dict(obj) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(obj).items()}
