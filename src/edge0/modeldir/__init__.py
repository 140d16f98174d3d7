"""The edge0 model directory: its manifest, edge0.json, and `ModelDir`, which opens it once.

config.json, tokenizer files, chat template   copied from the Hugging Face source
model.safetensors                             resident (non-expert) weights: bf16, or int4 for
                                              projections and embeddings (models/int4.py)
experts.safetensors                           one aligned int4 extent per routed expert
edge0.json                                    format version, family, layout, hashes
prerouter.safetensors, lora.safetensors       optional trained adapters
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from edge0.formats.checkpoint import TensorInfo, check_dir, read_header, read_json
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import INT4
from edge0.formats.int4_layout import UNRECORDED, Int4Layout, by_name
from edge0.models import int4, load_config
from edge0.models.experts import ExpertSlot
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import LAYOUT_KEY, read_table

FORMAT_VERSION = 1
MANIFEST = "edge0.json"
RESIDENT_FILE = "model.safetensors"
PREROUTER_FILE = "prerouter.safetensors"
LORA_FILE = "lora.safetensors"
LORA_SFT_FILE = "lora-phase2.safetensors"  # phase 2 output, phase 3 input; kept for the eval


@dataclass
class Manifest:
    format_version: int
    family: str
    quantization: dict
    experts: dict
    native_top_k: int
    source: dict
    created: str
    files: dict = field(default_factory=dict)
    served_top_k: int | None = None  # experts per token served by default (None: native)
    # experts staged per prediction-routed layer by default (None: the served K)
    served_stage_width: int | None = None

    @classmethod
    def new(
        cls,
        *,
        family: str,
        layout: ExtentLayout,
        num_experts: int,
        native_top_k: int,
        layers: dict[int, dict[str, int]],
        source: dict,
        resident: str = "bf16",
    ) -> Manifest:
        return cls(
            format_version=FORMAT_VERSION,
            family=family,
            quantization={
                "experts": INT4.describe(layout.int4.name),
                # "int4": projections and embeddings as MLX affine int4 (models/int4.py)
                "resident": resident,
            },
            experts={
                "file": EXPERTS_FILE,
                "extent_bytes": layout.nbytes,
                "hidden": layout.hidden,
                "inter": layout.inter,
                "num_experts": num_experts,
                "fields": {
                    k: {
                        "dtype": str(v[0]).removeprefix("torch."),
                        "shape": list(v[1]),
                        "offset": v[2],
                    }
                    for k, v in layout.fields.items()
                },
                "layers": {str(k): v for k, v in layers.items()},
            },
            native_top_k=native_top_k,
            source=source,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    @classmethod
    def load(cls, path: Path | str) -> Manifest:
        path = check_dir(path)
        raw = read_json(
            path / MANIFEST,
            "edge0 manifest; is this an edge0 directory? "
            "Build one with `edge0 convert HF_DIR OUT_DIR`",
        )
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{path / MANIFEST}: format_version {version!r}; this edge0 reads "
                f"version {FORMAT_VERSION}. Re-run edge0 convert."
            )
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"{path / MANIFEST}: {e}") from e

    def layout(self) -> ExtentLayout:
        """The extents as stored; directories from before the arrangement was recorded hold
        the n32-split codes that edge0 always wrote then."""
        int4 = self.quantization["experts"].get("layout", UNRECORDED.name)
        return ExtentLayout(self.experts["hidden"], self.experts["inter"], by_name(int4))

    def base_hash(self) -> str:
        """base_hash() of this manifest's directory."""
        base = {k: v for k, v in self.files.items() if k in (RESIDENT_FILE, EXPERTS_FILE)}
        return hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest()

    def save(self, path: Path) -> None:
        (path / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")


def base_hash(path: Path | str) -> str:
    """Identifies the base weights an adapter was trained on: a hash over the SHA-256s that
    edge0.json records for the resident and expert files."""
    return Manifest.load(path).base_hash()


@dataclass(frozen=True)
class Header:
    """One safetensors file as its header describes it: tensors and metadata, no data."""

    path: Path
    table: dict[str, TensorInfo]
    meta: dict[str, str]

    @classmethod
    def read(cls, path: Path) -> Header:
        return cls(path, *read_header(path))

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.table.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.table.values())


def _served(explicit: Path | None, default: Path, off: bool) -> Path | None:
    """The one rule for which adapter file serves: none when switched off, else the one asked
    for (which must exist), else the directory's own if it has one."""
    if off:
        return None
    if explicit is not None:
        return Path(explicit)
    return default if default.exists() else None


class ModelDir:
    """An edge0 directory opened once: its manifest, config, family and the headers of its
    resident, experts, LoRA and prerouter files, each read once, and no weight byte. The plan
    is made from it (engine/plan.py); `load_model`, `load_lora` and `load_heads` then read the
    weights, counted in `bytes_read`.

    `lora` and `prerouter` name adapter files to serve instead of the directory's own;
    `no_lora` and `no_prerouter` serve none."""

    def __init__(
        self,
        path: Path | str,
        lora: Path | None = None,
        prerouter: Path | None = None,
        no_lora: bool = False,
        no_prerouter: bool = False,
    ):
        self.path = path = check_dir(path)
        self.manifest = Manifest.load(path)
        self.family, self.config = load_config(path)
        if self.manifest.family != self.config.model_type:
            raise ValueError(
                f"{path}: edge0.json says {self.manifest.family}, "
                f"config.json {self.config.model_type}"
            )
        resident = path / RESIDENT_FILE
        if not resident.is_file():
            raise FileNotFoundError(f"{resident}: missing resident weights")
        self.resident = Header.read(resident)
        self.experts_path = path / EXPERTS_FILE
        self.experts, self.extent_bytes, self.experts_meta = read_table(self.experts_path)
        if self.extent_bytes != self.layout.nbytes:
            raise ValueError(
                f"{self.experts_path}: extent size {self.extent_bytes} != edge0.json "
                f"{self.layout.nbytes}"
            )
        found = (
            _served(lora, path / LORA_FILE, no_lora),
            _served(prerouter, path / PREROUTER_FILE, no_prerouter),
        )
        for f in found:
            if f is not None and not f.is_file():
                raise FileNotFoundError(f"{f}: no such adapter file")
        self.lora, self.heads = (Header.read(f) if f is not None else None for f in found)
        self.bytes_read = 0  # weight bytes read so far (resident weights, adapters)

    @property
    def layout(self) -> ExtentLayout:
        return self.manifest.layout()

    @property
    def stored_int4(self) -> Int4Layout:
        """The arrangement the experts file's header records (n32-split before it did)."""
        return by_name(self.experts_meta.get(LAYOUT_KEY, UNRECORDED.name))

    @cached_property
    def base_hash(self) -> str:
        return self.manifest.base_hash()

    @cached_property
    def skeleton(self) -> nn.Module:
        """The family's model on the meta device: no memory, for its shapes and state sizes."""
        from edge0.modeldir.loader import build

        return build(self.family, self.config, ExpertSlot)

    def load_model(
        self, dtype: torch.dtype, arrangement: Int4Layout, dequantized: bool = False
    ) -> nn.Module:
        """The model with its resident weights, int4 ones packed in `arrangement`; routed
        experts are computed by the executors a forward is handed (ExpertSlot). Dequantized:
        every weight in float, the experts too, from the int4 extents as the kernel sees them
        (the student path training runs on)."""
        from edge0.modeldir.loader import build, dequantized_experts, expert_prefixes, load_state
        from edge0.models.experts import ResidentExperts

        state = self._resident_state()
        cfg, source = self.config, str(self.resident.path)
        if not dequantized:
            model = build(self.family, cfg, ExpertSlot)
            int4.install(model, state, arrangement, source, dtype)
        else:
            shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
            model = build(self.family, cfg, lambda layer: ResidentExperts(*shape))
            state.update(dequantized_experts(self.path, self.manifest, expert_prefixes(model)))
            int4.dequantize_state(state)
        load_state(model, state, source, dtype)
        return model.eval()

    def _resident_state(self) -> dict[str, torch.Tensor]:
        try:
            state = load_file(str(self.resident.path))
        except SafetensorError as e:
            raise ValueError(
                f"{self.resident.path}: unreadable safetensors file ({e}); is it truncated?"
            ) from e
        self.bytes_read += self.resident.nbytes
        return state

    def load_lora(self, model: nn.Module, allow_other_base: bool = False) -> dict[str, str]:
        """Attach the served LoRA to `model` (none: {}); its metadata."""
        from edge0.models import lora

        if self.lora is None:
            return {}
        meta = lora.load(model, self.lora.path, self.base_hash, allow_other_base)
        self.bytes_read += self.lora.nbytes
        return meta

    def load_heads(self, moe_layers: list[int], dtype: torch.dtype):
        """(the served prerouter's heads, its metadata), or (None, {})."""
        from edge0.prerouter.head import Prerouter

        if self.heads is None:
            return None, {}
        cfg = self.config
        pre, meta = Prerouter.load(
            self.heads.path, cfg.hidden_size, cfg.num_experts, moe_layers, dtype
        )
        self.bytes_read += self.heads.nbytes
        return pre, meta
