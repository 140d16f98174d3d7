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
import logging
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from edge0.formats.checkpoint import TensorInfo, check_dir, read_header, read_json, sha256_file
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import recorded as recorded_format
from edge0.formats.int4_layout import UNRECORDED, Int4Layout, by_name
from edge0.formats.integrity import ModelDataError, file_checksum, hex64
from edge0.models import int4, load_config
from edge0.models.experts import ExpertSlot
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import LAYOUT_KEY, LayerExtents, read_table
from edge0.util.fs import write_atomic

log = logging.getLogger(__name__)

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
    # xxh3-64 of every file but the experts (whose extents carry their own): checked as the
    # resident and adapter files are loaded (formats/integrity.py); none before it was recorded
    checksums: dict = field(default_factory=dict)

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
                "experts": layout.format.describe(layout.int4.name),
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
        recorded = self.quantization["experts"]
        int4 = recorded.get("layout", UNRECORDED.name)
        return ExtentLayout(
            self.experts["hidden"], self.experts["inter"], by_name(int4), recorded_format(recorded)
        )

    def base_hash(self) -> str:
        """base_hash() of this manifest's directory."""
        base = {k: v for k, v in self.files.items() if k in (RESIDENT_FILE, EXPERTS_FILE)}
        return hashlib.sha256(json.dumps(base, sort_keys=True).encode()).hexdigest()

    def hash_files(self, path: Path, names: list[str] | None = None) -> None:
        """Record the SHA-256 (and, but for the experts, the xxh3-64) of `names` in directory
        `path`, every file but the manifest when None."""
        if names is None:
            names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
        for name in names:
            self.files[name] = sha256_file(path / name)
            if name != EXPERTS_FILE:
                self.checksums[name] = hex64(file_checksum(path / name))
        self.files = dict(sorted(self.files.items()))
        self.checksums = dict(sorted(self.checksums.items()))

    def save(self, path: Path) -> None:
        """Write edge0.json atomically: a kill leaves the old manifest or the new one."""
        write_atomic(path / MANIFEST, (json.dumps(asdict(self), indent=2) + "\n").encode())

    def check_file(self, path: Path) -> None:
        """ModelDataError if a file's bytes differ from its recorded xxh3-64 (none recorded:
        nothing to check)."""
        want = self.checksums.get(path.name)
        if want is not None and hex64(file_checksum(path)) != want:
            raise ModelDataError(
                f"{path}: does not match the checksum edge0.json records (the file is damaged "
                "or was replaced); run `edge0 verify` on the model directory"
            )


def experts_header_problems(
    manifest: Manifest, table: dict[int, LayerExtents], extent_bytes: int
) -> list[str]:
    """How an experts file's header differs from edge0.json: the extent size, and each
    layer's offset and count where recorded."""
    out = []
    want = manifest.layout().nbytes
    if extent_bytes != want:
        out.append(f"extent size {extent_bytes}, edge0.json {want}")
    for key, rec in manifest.experts.get("layers", {}).items():
        got = table.get(int(key))
        if got is None or (got.offset, got.count) != (rec["offset"], rec["count"]):
            found = "absent" if got is None else f"at offset {got.offset}, {got.count} experts"
            out.append(
                f"layer {key}'s extents {found}; edge0.json: offset {rec['offset']}, "
                f"{rec['count']} experts"
            )
    return out


def record_file(model_dir: Path, path: Path) -> None:
    """After writing `path` (an adapter a training phase saved): if it is a file of the edge0
    directory `model_dir`, edge0.json records its hashes, so `edge0 verify` and loading check
    the new bytes."""
    path, model_dir = Path(path).resolve(), Path(model_dir).resolve()
    if path.parent != model_dir or not (model_dir / MANIFEST).is_file():
        return
    manifest = Manifest.load(model_dir)
    manifest.hash_files(model_dir, [path.name])
    manifest.save(model_dir)


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


_WARNED: set[Path] = set()  # adapter files already said to record no base (once a process)
_LAYER = re.compile(r"(?:model\.|model\.language_model\.)?layers\.(\d+)\.")


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
        self._check_experts_header()
        self._check_config()
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

    def _check_experts_header(self) -> None:
        """The experts file's header against edge0.json (two layers' names swapped in the
        header, say, would serve one layer's experts for the other's)."""
        problems = experts_header_problems(self.manifest, self.experts, self.extent_bytes)
        if problems:
            raise ModelDataError(
                f"{self.experts_path}: {problems[0]}: the header is damaged or from another "
                "model; run `edge0 verify` on the model directory"
            )

    def _check_config(self) -> None:
        """config.json's sizes against the files, before anything is built from them: its
        layers against the resident weights' (a count of a million would otherwise build a
        million modules first), its expert shape against edge0.json's."""
        cfg, ex, where = self.config, self.manifest.experts, self.path / "config.json"
        layers = {int(m[1]) for k in self.resident.table if (m := _LAYER.match(k))}
        if layers and cfg.num_hidden_layers != max(layers) + 1:
            raise ValueError(
                f"{where}: num_hidden_layers is {cfg.num_hidden_layers}, but "
                f"{self.resident.path.name} holds layers 0 to {max(layers)}"
            )
        for name, want in (
            ("hidden_size", ex["hidden"]),
            ("moe_intermediate_size", ex["inter"]),
            ("num_experts", ex["num_experts"]),
        ):
            if getattr(cfg, name) != want:
                raise ValueError(
                    f"{where}: {name} is {getattr(cfg, name)}, but edge0.json's experts were "
                    f"written with {want}"
                )
        if any(i not in range(cfg.num_hidden_layers) for i in self.experts):
            raise ValueError(f"{where}: {self.experts_path.name} holds layers past the model's")

    @property
    def stored_int4(self) -> Int4Layout:
        """The arrangement the experts file's header records (n32-split before it did)."""
        return by_name(self.experts_meta.get(LAYOUT_KEY, UNRECORDED.name))

    @cached_property
    def base_hash(self) -> str:
        return self.manifest.base_hash()

    @cached_property
    def tokenizer(self):
        """The directory's tokenizer, loaded once."""
        from edge0.text.tokenizer import load_tokenizer

        return load_tokenizer(self.path)

    @cached_property
    def skeleton(self) -> nn.Module:
        """The family's model on the meta device: no memory, for its shapes and state sizes."""
        from edge0.modeldir.loader import build

        return build(self.family, self.config, ExpertSlot)

    def dequantized_skeleton(self) -> nn.Module:
        """The family's model on the meta device with every expert resident (ResidentExperts):
        what load_model(dequantized=True) fills, or a sharded student fills rank by rank."""
        from edge0.modeldir.loader import build
        from edge0.models.experts import ResidentExperts

        cfg = self.config
        shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        return build(self.family, cfg, lambda layer: ResidentExperts(*shape))

    def load_model(
        self, dtype: torch.dtype, arrangement: Int4Layout, dequantized: bool = False
    ) -> nn.Module:
        """The model with its resident weights, int4 ones packed in `arrangement`; routed
        experts are computed by the executors a forward is handed (ExpertSlot). Dequantized:
        every weight in float, the experts too, from the int4 extents as the kernel sees them
        (the student path training runs on)."""
        from edge0.modeldir.loader import build, dequantized_experts, expert_prefixes, load_state

        state = self._resident_state()
        cfg, source = self.config, str(self.resident.path)
        if not dequantized:
            model = build(self.family, cfg, ExpertSlot)
            int4.install(model, state, arrangement, source, dtype)
        else:
            model = self.dequantized_skeleton()
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
        self.manifest.check_file(self.resident.path)  # (its pages are in the cache now)
        return state

    def _check_own(self, path: Path) -> None:
        """An adapter file of this directory against its recorded checksum."""
        if path.resolve().parent == self.path.resolve():
            self.manifest.check_file(path)

    def check_bound(self, header: Header, option: str, allow_other: bool) -> None:
        """An adapter against the base it records (its metadata's base_hash): another base is
        a ValueError unless `allow_other` (the option named `option`); none recorded (an
        adapter imported or written before it was) is said once, naming the risk."""
        recorded = header.meta.get("base_hash")
        if recorded is None:
            if header.path not in _WARNED:
                _WARNED.add(header.path)
                log.warning(
                    "%s records no base_hash: nothing shows it was trained on this model's "
                    "weights; a mismatch would serve worse text without an error",
                    header.path,
                )
        elif recorded != self.base_hash and not allow_other:
            raise ValueError(
                f"{header.path} was trained for another base (base_hash {recorded[:12]}..., "
                f"this model {self.base_hash[:12]}...); set {option} to load it anyway"
            )

    def load_lora(self, model: nn.Module, allow_other_base: bool = False) -> dict[str, str]:
        """Attach the served LoRA to `model` (none: {}), checked against this base; its
        metadata."""
        from edge0.models import lora

        if self.lora is None:
            return {}
        self._check_own(self.lora.path)
        self.check_bound(self.lora, "lora_any_base", allow_other_base)
        meta = lora.load(model, self.lora.path, self.base_hash, True)
        self.bytes_read += self.lora.nbytes
        return meta

    def load_heads(
        self, moe_layers: list[int], dtype: torch.dtype, top_k: int, allow_other: bool = False
    ):
        """(the served prerouter's heads, its metadata), or (None, {}). Heads trained on
        another base, or for another K than `top_k`, are a ValueError unless `allow_other`."""
        from edge0.prerouter.head import Prerouter

        if self.heads is None:
            return None, {}
        self._check_own(self.heads.path)
        self.check_bound(self.heads, "prerouter_any_base", allow_other)
        trained = self.heads.meta.get("K")
        if trained is not None and int(trained) != top_k and not allow_other:
            raise ValueError(
                f"{self.heads.path} was trained to predict K={trained} experts, and K={top_k} "
                "is served; serve top_k "
                f"{trained}, or set prerouter_any_base to use them anyway"
            )
        cfg = self.config
        pre, meta = Prerouter.load(
            self.heads.path, cfg.hidden_size, cfg.num_experts, moe_layers, dtype
        )
        self.bytes_read += self.heads.nbytes
        return pre, meta
