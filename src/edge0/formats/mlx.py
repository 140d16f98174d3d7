"""MLX affine-quantized checkpoints: the file format, read from headers and packed words.

A quantized linear `<module>` is three tensors:
  <module>.weight   U32  [..., out, in * bits / 32]   values packed LSB-first in each word
  <module>.scales   BF16 [..., out, in / group]       w = scale * q + bias,  q in [0, 2^bits)
  <module>.biases   BF16 [..., out, in / group]
Element j of a row sits in word j // (32 / bits), bits [bits * (j % (32/bits)), +bits).
config.json declares `quantization: {group_size, bits, mode?}` with per-module overrides keyed
by module path (a dict, or `false` for a module left in float). The logical input width comes
from the scales (in = groups * group_size) and is checked against the packed width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edge0.formats.checkpoint import TensorInfo

CONFIG_KEYS = ("quantization", "quantization_config")
_UNPACK_WORDS = 1 << 22  # words unpacked per step: 4M words -> 128 MiB of int32 temporaries
SCALE_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: str = "affine"


@dataclass(frozen=True)
class QuantConfig:
    """The `quantization` block of an MLX config.json: a default and per-module overrides."""

    default: QuantParams | None
    overrides: dict[str, QuantParams | None]

    @classmethod
    def from_config(cls, raw: dict, source: str) -> QuantConfig | None:
        """None when config.json declares no MLX quantization (a float checkpoint)."""
        block = next((raw[k] for k in CONFIG_KEYS if isinstance(raw.get(k), dict)), None)
        if block is None:
            return None
        default = None
        if "bits" in block or "group_size" in block:
            default = _params(block, f"{source}: quantization")
        overrides = {}
        for key, value in block.items():
            if isinstance(value, dict):
                overrides[key] = _params(value, f"{source}: quantization[{key!r}]")
            elif value is False:
                overrides[key] = None
        return cls(default, overrides)

    def for_module(self, path: str) -> QuantParams | None:
        return self.overrides[path] if path in self.overrides else self.default

    def summary(self) -> dict:
        """Default parameters and how many modules override them, for provenance records."""
        counts: dict[str, int] = {}
        for p in self.overrides.values():
            label = "float" if p is None else f"{p.bits}-bit group {p.group_size}"
            counts[label] = counts.get(label, 0) + 1
        d = self.default
        return {
            "default": None if d is None else {"bits": d.bits, "group_size": d.group_size},
            "mode": "affine",
            "overrides": counts,
        }


def _params(block: dict, where: str) -> QuantParams:
    try:
        p = QuantParams(int(block["group_size"]), int(block["bits"]), block.get("mode", "affine"))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: needs integer group_size and bits ({e})") from e
    if p.mode != "affine":
        raise ValueError(
            f"{where}: quantization mode {p.mode!r} is not supported; only MLX affine "
            "(scale * q + bias) checkpoints can be read"
        )
    if not 1 <= p.bits <= 8 or p.group_size < 1:
        raise ValueError(f"{where}: bits {p.bits} / group_size {p.group_size} are not valid")
    return p


@dataclass(frozen=True)
class QuantTensor:
    """One MLX-quantized weight: its three stored tensors and its logical shape."""

    module: str  # module path as stored, e.g. language_model.model.layers.0.mlp.gate
    weight: TensorInfo
    scales: TensorInfo
    biases: TensorInfo
    params: QuantParams
    shape: tuple[int, ...]  # logical [..., out, in]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


def split_quantized(
    table: dict[str, TensorInfo], qcfg: QuantConfig | None, source: str
) -> tuple[dict[str, QuantTensor], list[str]]:
    """(quantized weights by module path, every other tensor name), from headers alone.

    Raises ValueError naming the tensor when its stored shapes and the declared
    quantization disagree, so a wrong config.json cannot silently mis-size a model.
    """
    quantized: dict[str, QuantTensor] = {}
    for key, info in table.items():
        if not key.endswith(".scales"):
            continue
        module = key.removesuffix(".scales")
        wkey, bkey = f"{module}.weight", f"{module}.biases"
        if wkey not in table or bkey not in table:
            missing = wkey if wkey not in table else bkey
            raise ValueError(f"{source}: {key} has no matching {missing}")
        params = qcfg.for_module(module) if qcfg is not None else None
        if params is None:
            raise ValueError(
                f"{source}: {wkey} is quantized but config.json declares no quantization for "
                f"{module!r}; an MLX checkpoint needs its `quantization` block"
            )
        w, s, b = table[wkey], info, table[bkey]
        quantized[module] = QuantTensor(
            module, w, s, b, params, logical_shape(wkey, w, s, b, params, source)
        )
    taken = {f"{m}.{part}" for m in quantized for part in ("weight", "scales", "biases")}
    return quantized, [k for k in table if k not in taken]


def logical_shape(
    wkey: str, w: TensorInfo, s: TensorInfo, b: TensorInfo, p: QuantParams, source: str
) -> tuple[int, ...]:
    """[..., out, in] with in = groups * group_size, checked against the packed width."""
    if w.dtype != "U32":
        raise ValueError(f"{source}: {wkey} is {w.dtype}; packed MLX weights are U32")
    if s.dtype not in SCALE_DTYPES or b.dtype != s.dtype:
        raise ValueError(f"{source}: {wkey}: scales/biases are {s.dtype}/{b.dtype}")
    if s.shape != b.shape or s.shape[:-1] != w.shape[:-1]:
        raise ValueError(
            f"{source}: {wkey} {list(w.shape)} disagrees with its scales {list(s.shape)} / "
            f"biases {list(b.shape)}"
        )
    width = s.shape[-1] * p.group_size
    if w.shape[-1] * 32 != width * p.bits:
        raise ValueError(
            f"{source}: {wkey} packs {w.shape[-1]} words per row, but {s.shape[-1]} groups of "
            f"{p.group_size} at {p.bits} bits need {width * p.bits // 32}; config.json's "
            "quantization does not describe this tensor"
        )
    return (*w.shape[:-1], width)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 words [..., W] -> q uint8 [..., W * 32 / bits], LSB-first."""
    if bits not in (2, 4, 8):  # 3/5/6-bit values straddle words; no checkpoint we read has them
        raise ValueError(f"{bits}-bit MLX weights cannot be unpacked (2, 4 or 8 bits only)")
    per = 32 // bits
    words = packed.view(torch.int32).reshape(-1, packed.shape[-1])  # [R, W]; shifts on int32
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    out = torch.empty(words.shape[0], words.shape[1] * per, dtype=torch.uint8)
    step = max(1, _UNPACK_WORDS // max(1, words.shape[1]))  # rows per step: bounded int32
    for r in range(0, words.shape[0], step):  # temporaries (a 248k-row lm_head took 4 GiB)
        q = (words[r : r + step, :, None] >> shifts) & (2**bits - 1)  # the mask drops the sign
        out[r : r + step] = q.reshape(q.shape[0], -1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int
) -> torch.Tensor:
    """fp32 w = scale * q + bias, q [..., in], scales/biases [..., in / group]."""
    g = q.float().unflatten(-1, (-1, group_size))  # [..., groups, group]
    return (scales.float()[..., None] * g + biases.float()[..., None]).flatten(-2)


def detect_format(path: Path, raw_config: dict) -> str:
    """ "edge0", "mlx" or "hf": what a model directory holds, from its files and config."""
    if (path / "edge0.json").is_file():
        return "edge0"
    return "mlx" if QuantConfig.from_config(raw_config, str(path)) is not None else "hf"
