"""The edge0 model directory and its manifest, edge0.json.

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
from pathlib import Path

from edge0.formats.checkpoint import check_dir, read_json
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import INT4
from edge0.formats.int4_layout import UNRECORDED, by_name

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
                "file": "experts.safetensors",
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

    def save(self, path: Path) -> None:
        (path / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")


def base_hash(path: Path | str) -> str:
    """Identifies the base weights an adapter was trained on: a hash over the SHA-256s that
    edge0.json records for the resident and expert files."""
    files = Manifest.load(path).files
    base = {k: v for k, v in files.items() if k in (RESIDENT_FILE, "experts.safetensors")}
    return hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest()
