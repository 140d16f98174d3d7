"""Training on several processes: torch.distributed as torchrun launches it.

`torchrun --nproc_per_node N -m edge0 train heads|sft|opd ...` (and `--nnodes` across machines)
starts N copies of the command; torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) makes them one process group, on gloo for the CPU and NCCL for
CUDA (each rank on GPU LOCAL_RANK). Without that environment a run is one rank of one.

What phases 2 and 3 do with it (student.train_lora; phase 1: train/heads.py):
  - the LoRA's parameters are wrapped in DistributedDataParallel: rank 0's initial adapter
    is broadcast, and every backward pass averages the gradients over the ranks
  - every rank draws the same global batch of `--batch` sequences (the effective batch)
    from the same seeded generator and computes its own contiguous share of it, batch / N
    rows, so no two ranks see the same window and N ranks step as one process with the
    whole batch does (up to the order of float sums)
  - rank 0 writes the checkpoints, the log and the adapter; every rank resumes from them
  - progress bars and logs are rank 0's only
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank `rank` of `world`."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and shows progress."""
        return self.rank == 0

    def share(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a global batch [B, ...] (B divisible by world)."""
        if batch.shape[0] % self.world:
            raise ValueError(
                f"the batch ({batch.shape[0]}) must be a multiple of the ranks ({self.world})"
            )
        n = batch.shape[0] // self.world
        return batch[self.rank * n : (self.rank + 1) * n]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def join(device_type: str | None = None) -> Ranks:
    """This process's rank, joining torchrun's process group if it was launched by one
    (gloo on the CPU, NCCL on CUDA). Ranks other than 0 log warnings only."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), local)
    if not ranks.main:
        logging.getLogger("edge0").setLevel(logging.WARNING)
    return ranks


def no_sync(forward):
    """A context in which backward passes keep their gradients on this rank (accumulation
    before the synchronising pass), for a DDP-wrapped forward; nothing for a plain one."""
    if isinstance(forward, nn.parallel.DistributedDataParallel):
        return forward.no_sync()
    return contextlib.nullcontext()


def mean(value: torch.Tensor, ranks: Ranks) -> float:
    """A per-rank scalar averaged over the ranks (each rank's share is the same size)."""
    if ranks.world == 1:
        return value.item()
    total = value.detach().clone().float()
    if dist.get_backend() == "nccl":
        total = total.cuda()
    dist.all_reduce(total)
    return total.item() / ranks.world


def total(values: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """A per-rank tensor summed over the ranks."""
    if ranks.world == 1:
        return values
    out = values.detach().clone()
    if dist.get_backend() == "nccl":
        out = out.cuda()
    dist.all_reduce(out)
    return out.cpu()


def gather(value, ranks: Ranks) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    if ranks.world == 1:
        return [value]
    out = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def device(ranks: Ranks, wanted: torch.device) -> torch.device:
    """The device this rank computes on: its own GPU under torchrun on CUDA."""
    if wanted.type == "cuda" and ranks.world > 1:
        return torch.device("cuda", ranks.local)
    return wanted


class Trainables(nn.Module):
    """The trainable parameters alone, as a module whose forward is the student's: what
    DistributedDataParallel wraps, so that only they are broadcast and averaged (the
    frozen base, int4 buffers included, stays each rank's own)."""

    def __init__(self, params: list[nn.Parameter], forward):
        super().__init__()
        self.params = nn.ParameterList(params)
        self._forward = forward

    def forward(self, *args):
        return self._forward(*args)


def wrap(params: list[nn.Parameter], forward, ranks: Ranks):
    """forward(*args) as the step calls it: through DDP over `params` on several ranks."""
    if ranks.world == 1:
        return forward
    module = Trainables(params, forward)
    ids = None if params[0].device.type == "cpu" else [params[0].device]
    return nn.parallel.DistributedDataParallel(module, device_ids=ids)
