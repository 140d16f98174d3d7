"""Prerouter heads: layer N's MoE input at token t -> layer N+1's router logits at token t+1.

One head per owner layer:
  x      = concat(h [D], onehot(experts executed at t) [E], onehot(experts executed at t-1) [E])
  logits = fc2(gelu_erf(fc1(x))) + linear_init(x)          (no biases, hidden width 512)
`linear_init` starts as the consumer's router weight (zeros on the one-hot columns) and fc2
starts at zero, so an untrained head is exactly "apply the next router to this hidden state".

The file format (`prerouter.safetensors`) keeps the reference's keys, `layers.{owner}.fc1.weight`,
`.fc2.weight`, `.linear_init.weight`, in fp16, with provenance in the safetensors metadata.
Shape legend: H heads, D hidden, E experts, W head width, T tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

FORMAT_VERSION = "1"
DEFAULT_WIDTH = 512


class PrerouterHead(nn.Module):
    def __init__(self, in_dim: int, num_experts: int, width: int = DEFAULT_WIDTH, device=None):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, width, bias=False, device=device)
        self.fc2 = nn.Linear(width, num_experts, bias=False, device=device)
        self.linear_init = nn.Linear(in_dim, num_experts, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="none")) + self.linear_init(x)


def features(h: torch.Tensor, executed: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Head input [.., D + 2E] from h [.., D] and two multi-hot [.., E] routing vectors."""
    return torch.cat([h.float(), executed.float(), previous.float()], dim=-1)


@dataclass(frozen=True)
class Wiring:
    """Which layer's head predicts which layer: consumer -> owner (the MoE layer before it)."""

    owner_of: dict[int, int]

    @classmethod
    def default(cls, moe_layers: list[int], start_layer: int | None = None) -> Wiring:
        """Each MoE layer from start_layer on consumes a prediction by the MoE layer before it."""
        start = moe_layers[1] if start_layer is None else start_layer
        pairs = {c: o for o, c in zip(moe_layers, moe_layers[1:], strict=False) if c >= start}
        if not pairs:
            raise ValueError(f"no MoE layer at or after start layer {start} has a predecessor")
        return cls(pairs)

    @property
    def owners(self) -> list[int]:
        return sorted(set(self.owner_of.values()))

    @property
    def consumers(self) -> list[int]:
        return sorted(self.owner_of)


class Prerouter(nn.Module):
    """All heads of a model, keyed by owner layer."""

    def __init__(
        self,
        wiring: Wiring,
        hidden: int,
        num_experts: int,
        width: int = DEFAULT_WIDTH,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.wiring = wiring
        self.hidden, self.num_experts, self.width = hidden, num_experts, width
        self.heads = nn.ModuleDict(
            {
                str(o): PrerouterHead(hidden + 2 * num_experts, num_experts, width, device)
                for o in wiring.owners
            }
        )

    def head(self, owner: int) -> PrerouterHead:
        return self.heads[str(owner)]

    def warm_start(self, routers: dict[int, torch.Tensor], seed: int = 0) -> None:
        """linear_init <- consumer router [E, D] (zero on one-hots), fc2 <- 0, fc1 random."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for consumer, owner in self.wiring.owner_of.items():
                head = self.head(owner)
                head.linear_init.weight.zero_()
                head.linear_init.weight[:, : self.hidden] = routers[consumer].float()
                head.fc2.weight.zero_()
                bound = (1.0 / head.fc1.in_features) ** 0.5
                head.fc1.weight.copy_(
                    torch.empty_like(head.fc1.weight).uniform_(-bound, bound, generator=gen)
                )

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        tensors = {
            f"layers.{o}.{name}": p.detach().to(torch.float16).contiguous()
            for o, head in self.heads.items()
            for name, p in head.state_dict().items()
        }
        meta = {
            "kind": "prerouter",
            "format_version": FORMAT_VERSION,
            "width": str(self.width),
            "owners": json.dumps(self.wiring.owners),
            "consumers": json.dumps({str(c): o for c, o in self.wiring.owner_of.items()}),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            **metadata,
        }
        save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})

    @classmethod
    def load(
        cls,
        path: Path,
        hidden: int,
        num_experts: int,
        moe_layers: list[int],
        dtype: torch.dtype = torch.float32,
    ) -> tuple[Prerouter, dict]:
        """Heads from prerouter.safetensors; every mismatch is an error naming the file and key.

        Parameters hold the file's values in `dtype`: float32 for training, or the file's own
        float16 tensors (no copy) where they are only stacked for inference.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no prerouter file (serve without one: no_prerouter)")
        try:
            with safe_open(str(path), "pt") as f:  # one open: metadata and tensors
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{path}: unreadable safetensors file ({e})") from e
        if meta.get("kind", "prerouter") != "prerouter":
            raise ValueError(f"{path}: metadata kind is {meta.get('kind')!r}, not 'prerouter'")
        owners = sorted({int(k.split(".")[1]) for k in tensors})
        if "owners" in meta and sorted(json.loads(meta["owners"])) != owners:
            raise ValueError(
                f"{path}: its metadata names owners {json.loads(meta['owners'])}, and its "
                f"tensors are heads of layers {owners}"
            )
        if "consumers" in meta:
            owner_of = {int(c): int(o) for c, o in json.loads(meta["consumers"]).items()}
        else:  # files without wiring metadata: each owner predicts the next MoE layer
            nxt = dict(zip(moe_layers, moe_layers[1:], strict=False))
            owner_of = {nxt[o]: o for o in owners if o in nxt}
        bad = [layer for layer in list(owner_of) + owners if layer not in moe_layers]
        if bad:
            raise ValueError(f"{path}: layer {bad[0]} is not an MoE layer of this model")
        idle = [o for o in owners if o not in owner_of.values()]
        if idle:
            raise ValueError(
                f"{path}: the head of layer {idle[0]} has no next MoE layer to predict "
                f"(MoE layers {moe_layers[0]}..{moe_layers[-1]})"
            )
        width = tensors[f"layers.{owners[0]}.fc1.weight"].shape[0]
        pre = cls(Wiring(owner_of), hidden, num_experts, width, device="meta")  # no init
        expected = {f"layers.{o}.{k}" for o in pre.heads for k in pre.head(int(o)).state_dict()}
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or extra:
            key = (missing or extra)[0]
            raise ValueError(f"{path}: {'missing' if missing else 'unexpected'} tensor {key!r}")
        for key, t in tensors.items():
            _, o, name, _ = key.split(".")
            linear = getattr(pre.head(int(o)), name)
            if t.shape != linear.weight.shape:
                raise ValueError(
                    f"{path}: {key} has shape {tuple(t.shape)}, this model needs "
                    f"{tuple(linear.weight.shape)} (hidden {hidden}, {num_experts} experts)"
                )
            linear.weight = nn.Parameter(t.to(dtype))
        return pre, meta


class StackedHeads:
    """Every head's weights stacked, so one flush evaluates all heads with three bmm calls.

    Weights are the fp16 values of the file, held at the compute dtype like every float weight
    of the floor (fp32 by default: exact upcast; bf16 with --dtype bfloat16). On CUDA they stay
    fp16.
    """

    @staticmethod
    def dtype_on(device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.dtype:
        return torch.float16 if torch.device(device).type == "cuda" else dtype

    def __init__(
        self,
        pre: Prerouter,
        owners: list[int],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        dtype = self.dtype_on(device, dtype)
        heads = [pre.head(o) for o in owners]

        def stack(name):
            return torch.stack([getattr(h, name).weight.detach().half() for h in heads]).to(
                device, dtype
            )

        self.w1, self.w2, self.w0 = stack("fc1"), stack("fc2"), stack("linear_init")
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.w1, self.w2, self.w0))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [H, T, D+2E] -> logits [H, T, E] (fp32)."""
        x = x.to(self.w1.dtype)
        hidden = F.gelu(torch.bmm(x, self.w1.transpose(1, 2)), approximate="none")
        return (
            torch.bmm(hidden, self.w2.transpose(1, 2)) + torch.bmm(x, self.w0.transpose(1, 2))
        ).float()

    @torch.no_grad()
    def one(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Head i alone: x [T, D+2E] -> logits [T, E] (fp32); the same math as __call__."""
        x = x.to(self.w1.dtype)
        hidden = F.gelu(x @ self.w1[i].T, approximate="none")
        return (hidden @ self.w2[i].T + x @ self.w0[i].T).float()


class NativeHeads:
    """Every head as the native op reads it (native/heads.cpp): the file's fp16 weights, the
    h columns of fc1 and linear_init as matrices and their one-hot columns transposed into
    rows, so that a decode row's head reads its h part and 2K short rows, in one call that
    also picks its consumer's staged set. Its logits are StackedHeads.one's up to the order
    of float sums, and the same bits on every CPU. Holds half the bytes of fp32 heads."""

    def __init__(self, pre: Prerouter, owners: list[int], op, isa: int):
        self.op, self.isa = op, isa
        d = pre.hidden
        self.parts = {}
        for o in owners:
            head = pre.head(o)
            w1, w0 = (head.fc1.weight.detach().half(), head.linear_init.weight.detach().half())
            self.parts[o] = (
                w1[:, :d].contiguous(),
                w1[:, d:].t().contiguous(),
                head.fc2.weight.detach().half().contiguous(),
                w0[:, :d].contiguous(),
                w0[:, d:].t().contiguous(),
            )

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for parts in self.parts.values() for w in parts)

    def __call__(
        self,
        owner: int,
        h: torch.Tensor,
        executed: torch.Tensor,
        previous: torch.Tensor,
        stage: int = 0,
    ) -> list[torch.Tensor]:
        """The owner's head on rows h [B, D] with the experts they executed [B, K] and at the
        step before [B, K'] (int64, -1: none) -> [logits fp32 [B, E]], and with stage > 0 also
        each row's top-`stage` experts by routing.softmax_topk (ascending, [B, stage]) and
        their mask (bool [B, E])."""
        return self.op(h, executed, previous, *self.parts[owner], stage, self.isa)
