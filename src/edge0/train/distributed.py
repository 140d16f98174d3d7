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

With `--fsdp` (the dequantized base only) the student is sharded instead of replicated:
FSDP2's `fully_shard` on every decoder layer and on the model, over all ranks. Each rank
then holds 1/N of every weight, the frozen base's and the LoRA's, and gathers a layer's
whole weights only while that layer computes (forward, and again in the backward); the
LoRA's gradients are reduce-scattered, and each rank's AdamW steps its shard. For a base
that does not fit one device but fits N. Checkpoints hold the whole adapter and AdamW state
(gathered to rank 0), and every rank takes its shard of them on resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state
import torch.distributed.fsdp as fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


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


def no_sync(forward, model: nn.Module | None = None):
    """A context in which backward passes keep their gradients on this rank (accumulation
    before the synchronising pass), for a DDP-wrapped forward or an FSDP-sharded model;
    nothing for a plain one."""
    if isinstance(forward, nn.parallel.DistributedDataParallel):
        return forward.no_sync()
    if sharded(model):
        return _without_gradient_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def sharded(model: nn.Module | None) -> bool:
    """Whether `model` was sharded by shard() (FSDP2)."""
    return model is not None and isinstance(model, fsdp.FSDPModule)


def shard(model: nn.Module, layers: list[nn.Module], ranks: Ranks, device: torch.device) -> None:
    """FSDP2 over every rank: each of `layers` (the decoder layers) its own unit, the rest of
    `model` (embeddings, final norm, LM head) the root's."""
    mesh = init_device_mesh(device.type, (ranks.world,))
    for layer in layers:
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)


def materialize(model: nn.Module, device: torch.device, source, ranks: Ranks) -> None:
    """Give a model built on the meta device and sharded there (shard()) its memory on
    `device`, and fill this rank's part of each tensor from `source(name, rows)`: the named
    tensor's rows in the range of its first dimension, the part FSDP2 keeps on this rank
    (torch.chunk's: ceil(n / N) rows a rank, the last ranks maybe fewer or none); tensors it
    does not shard (buffers), whole. So no rank ever holds more than its shards and the one
    tensor being read."""
    model.to_empty(device=device)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            n = t.shape[0] if t.dim() else 0
            rows = range(n)
            if isinstance(t, DTensor):
                per = -(-n // ranks.world)
                rows = range(min(ranks.rank * per, n), min((ranks.rank + 1) * per, n))
            part = source(name, rows)
            if part.shape != local.shape:
                raise ValueError(
                    f"{name}: rank {ranks.rank} holds {tuple(local.shape)} of it, the source "
                    f"gave {tuple(part.shape)}"
                )
            local.copy_(part)


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Within it a sharded model's parameters are whole on every rank (each FSDP unit
    unsharded), to be read as a plain model's; every rank must enter it. Nothing for a
    model that is not sharded."""
    units = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()


def full_state(model: nn.Module, optimizer, keep) -> tuple[dict, dict]:
    """(the model's state entries whose names `keep` accepts, the optimizer's state) whole,
    as checkpoints hold them; for a sharded model gathered from every rank (each must call
    it; keyed by parameter name), else the plain state dicts."""
    if not sharded(model):
        state = {k: v for k, v in model.state_dict().items() if keep(k)}
        return state, optimizer.state_dict()
    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dcp_state.get_model_state_dict(model, options=options)
    opt = dcp_state.get_optimizer_state_dict(model, optimizer, options=options)
    return {k: v for k, v in state.items() if keep(k)}, opt


def load_full_state(model: nn.Module, optimizer, state: dict, opt_state: dict) -> None:
    """full_state()'s dicts back: into a sharded model each rank takes its shards."""
    if not sharded(model):
        model.load_state_dict(state, strict=False)
        optimizer.load_state_dict(opt_state)
        return
    options = dcp_state.StateDictOptions(full_state_dict=True, strict=False)
    dcp_state.set_model_state_dict(model, state, options=options)
    dcp_state.set_optimizer_state_dict(model, optimizer, opt_state, options=options)


def mean(value: torch.Tensor, ranks: Ranks) -> float:
    """A per-rank scalar averaged over the ranks (each rank's share is the same size)."""
    return total(value.float(), ranks).item() / ranks.world


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


def wrap(params: list[nn.Parameter], forward, ranks: Ranks, model: nn.Module | None = None):
    """forward(*args) as the step calls it: through DDP over `params` on several ranks (a
    sharded model synchronises its own gradients)."""
    if ranks.world == 1 or sharded(model):
        return forward
    module = Trainables(params, forward)
    ids = None if params[0].device.type == "cpu" else [params[0].device]
    return nn.parallel.DistributedDataParallel(module, device_ids=ids)
