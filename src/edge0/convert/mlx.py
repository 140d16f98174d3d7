"""`edge0 convert --from-mlx MLX_DIR OUT_DIR`: an MLX affine-quantized checkpoint -> edge0.

Routed experts (`<layer>.mlp.switch_mlp.{gate,up,down}_proj`, stacked [E, out, in/8] u32) are
moved without arithmetic: the words are unpacked into 4-bit codes and laid into extents next
to MLX's own scales and biases, so every stored weight is exactly MLX's scale * q + bias.
Every other quantized weight (4-bit attention, embeddings, lm_head; 8-bit routers) is
dequantized with that formula to bf16, because edge0 keeps resident weights in float.
Names lose MLX's `language_model.` level and take our module paths; the `prerouter_*` and
`lora_*` files shipped beside the shards become prerouter.safetensors and lora.safetensors.
Shape legend: E experts, D hidden, I expert width, R rows, W packed words per row.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from edge0 import modeldir
from edge0.convert import (
    ConvertReport,
    check_out_dir,
    expected_resident,
    moe_layers,
    with_peaks,
    write_model_dir,
)
from edge0.formats.checkpoint import (
    DTYPES,
    Checkpoint,
    TensorInfo,
    check_dir,
    is_adapter_file,
    read_json,
    sha256_file,
)
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import INT4
from edge0.formats.mlx import CONFIG_KEYS, QuantConfig, QuantTensor, dequantize, split_quantized
from edge0.formats.mlx import unpack as unpack_words
from edge0.modeldir.loader import build
from edge0.models import load_config
from edge0.models.experts import ExpertSlot
from edge0.models.layers import ZeroCenteredRMSNorm

log = logging.getLogger(__name__)

MLX_PROJ = ("gate_proj", "up_proj", "down_proj")  # switch_mlp stack names in every MLX family
NOT_SERVED_ROOTS = ("vision_tower", "visual", "multi_modal_projector", "mtp")
# the 8B release keeps a copy of its prerouter inside the checkpoint, `<layer>.mlp.pregate.*`;
# the reference ignores it and serves the heads of prerouter_edge0_8b.safetensors, as edge0 does
IN_CHECKPOINT_HEADS = ".mlp.pregate."
PREROUTER_KEY = re.compile(
    r"(?:layers|pregate)\.(\d+)\.(?:mlp\.prerouter\.)?(fc1|fc2|linear_init)\.weight"
)
LORA_KEY = re.compile(r"(.+)\.lora_([AB])")
_DEQUANT_CHUNK = 1 << 24  # fp32 elements per dequantization step (64 MiB)


def candidates(name: str) -> list[str]:
    """Names an MLX tensor may have in our model, most literal first: as stored, without the
    `language_model.` level, or with that level moved under `model.` (Hugging Face nesting)."""
    out = [name]
    if name.startswith("language_model."):
        rest = name.removeprefix("language_model.")
        out.append(rest)  # language_model.model.x -> model.x, language_model.lm_head -> lm_head
        if rest.startswith("model."):
            out.append("model.language_model." + rest.removeprefix("model."))
    if name.startswith("model.language_model."):
        out.append("model." + name.removeprefix("model.language_model."))
    return out


def switch_prefixes(model) -> dict[int, str]:
    """Where MLX stacks each layer's experts, in our names: the MoE block + `.switch_mlp`."""
    return {i: f"{model.moe_block_path(i)}.switch_mlp" for i in model.moe_layers}


def zero_centred_norms(model) -> set[str]:
    """Weights of RMSNorms that scale by (1 + w): MLX's sanitize stores them as 1 + w."""
    return {
        f"{name}.weight"
        for name, mod in model.named_modules()
        if isinstance(mod, ZeroCenteredRMSNorm)
    }


class MLXCheckpoint:
    """An MLX directory seen as our model's tensors: our names, logical shapes, float values.

    Offers what `convert.write_model_dir` reads (keys, shape, get, files, hashes) and, per MoE
    layer, the quantized expert stacks. Tensors are read one at a time (experts one expert
    at a time, by byte range), never memory-mapped.
    """

    def __init__(self, path: Path, fam, cfg, raw_config: dict):
        self.path = path
        self.raw = Checkpoint(path)
        self.files = self.raw.files
        self.quant = QuantConfig.from_config(raw_config, str(path / "config.json"))
        if self.quant is None:
            raise ValueError(
                f"{path / 'config.json'}: no MLX `quantization` block, so this is not an MLX "
                "quantized checkpoint; convert it without --from-mlx"
            )
        # a vision tower or MTP layers are never served: not even their quantization is read
        table = {k: self.raw.info(k) for k in self.raw.keys()}
        self.skipped = [
            k for k in table if k.split(".")[0] in NOT_SERVED_ROOTS or IN_CHECKPOINT_HEADS in k
        ]
        for k in self.skipped:
            del table[k]
        quantized, plain = split_quantized(table, self.quant, str(path))
        self.expected = expected_resident(fam, cfg)
        self.layers = moe_layers(cfg, path)
        model = build(fam, cfg, ExpertSlot)
        self.switch = switch_prefixes(model)
        # mlx-lm stacks a layer's experts as `switch_mlp`; the 8B release as `experts`
        stacks = {
            f"{stack}.{p}.weight": (i, p)
            for i in self.layers
            for stack in (self.switch[i], f"{model.moe_block_path(i)}.experts")
            for p in MLX_PROJ
        }
        targets = set(self.expected) | set(stacks)
        self.entries: dict[str, tuple[str, QuantTensor | None]] = {}  # ours -> (stored, quant)
        self.stacks: dict[int, dict[str, QuantTensor]] = {i: {} for i in self.layers}
        self.stack_names: dict[int, list[str]] = {i: [] for i in self.layers}
        stored = {f"{m}.weight": q for m, q in quantized.items()} | dict.fromkeys(plain)
        for key, qt in stored.items():
            names = [fam.sanitize(cfg, n) for n in candidates(key)]
            ours = next((n for n in names if n in targets), None)
            if ours is None and None in names:  # the family does not serve it
                self.skipped.append(key)
                continue
            ours = ours or key  # not ours: write_model_dir reports it as unexpected, by name
            if ours in stacks:
                layer, proj = stacks[ours]
                if qt is None:
                    raise ValueError(
                        f"{path}: expert stack {key!r} is not quantized; --from-mlx reads "
                        "int4 experts (convert a float checkpoint without --from-mlx)"
                    )
                self.stacks[layer][proj] = qt
                self.stack_names[layer].append(ours)
            self.entries[ours] = (key, qt)
        if self.skipped:
            log.info(
                "%s: %d tensors not served (vision / MTP / in-checkpoint heads) skipped",
                path,
                len(self.skipped),
            )
        convs = [k for k, (_, qt) in self.entries.items() if qt is None and self._is_conv(k)]
        # mlx-lm's sanitize moves conv1d to [C, W, 1] and shifts norms in the same pass
        self.sanitized = all(self.raw.shape(self.entries[k][0])[-1] == 1 for k in convs)
        self.shifted = zero_centred_norms(model) if self.sanitized else set()
        self._fds: dict[Path, int] = {}

    def _is_conv(self, name: str) -> bool:
        want = self.expected.get(name)
        return want is not None and len(want) == 3 and want[1] == 1 and want[2] > 1

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> list[int]:
        stored, qt = self.entries[key]
        if qt is not None:
            return list(qt.shape)
        shape = self.raw.shape(stored)
        if self._is_conv(key) and shape[-1] == 1:  # MLX [C, W, 1] -> ours [C, 1, W]
            shape = [shape[0], 1, shape[1]]
        return shape

    def get(self, key: str) -> torch.Tensor:
        """The tensor under our name: dequantized to bf16, or as stored with MLX's layout and
        norm offset undone (float arithmetic in fp32, then the writer's bf16)."""
        stored, qt = self.entries[key]
        if qt is not None:
            return self._dequantize(qt)
        t = self.raw.get(stored)
        if self._is_conv(key) and t.shape[-1] == 1:
            t = t.transpose(1, 2).contiguous()
        if key in self.shifted:
            t = t.float() - 1.0  # MLX stores 1 + w; exact in bf16 while 1 + w >= 0.5 (Sterbenz)
        return t

    def quantized(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A weight stored as 4-bit group-64 with bf16 scales, as its (words, scales, biases):
        exactly edge0's int4 resident format, so it is kept bit for bit. None otherwise."""
        stored, qt = self.entries[key]
        if qt is None or not INT4.accepts(qt.params.bits, qt.params.group_size):
            return None
        if qt.scales.dtype != "BF16" or len(qt.shape) != 2:
            return None
        return tuple(self.raw.get(f"{qt.module}.{part}") for part in ("weight", "scales", "biases"))

    def _dequantize(self, qt: QuantTensor) -> torch.Tensor:
        packed = self.raw.get(f"{qt.module}.weight")
        scales, biases = self.raw.get(f"{qt.module}.scales"), self.raw.get(f"{qt.module}.biases")
        width = qt.shape[-1]
        rows = packed.reshape(-1, packed.shape[-1])  # [R, W]
        s, b = scales.reshape(rows.shape[0], -1), biases.reshape(rows.shape[0], -1)
        out = torch.empty(rows.shape[0], width, dtype=torch.bfloat16)
        step = max(1, _DEQUANT_CHUNK // width)  # bounds the fp32 temporary of an embedding
        for r in range(0, rows.shape[0], step):
            q = unpack_words(rows[r : r + step], qt.params.bits)
            out[r : r + step] = dequantize(
                q, s[r : r + step], b[r : r + step], qt.params.group_size
            )
        return out.reshape(qt.shape)

    def read_rows(self, info: TensorInfo, first: int, count: int) -> torch.Tensor:
        """Rows [first, first + count) of a tensor along its leading axis, by one pread."""
        row = info.nbytes // info.shape[0]
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        data = os.pread(fd, row * count, info.start + first * row)
        if len(data) != row * count:
            raise ValueError(f"{info.file}: short read at byte {info.start + first * row}")
        t = torch.frombuffer(bytearray(data), dtype=DTYPES[info.dtype])
        return t.reshape(count, *info.shape[1:])

    def hashes(self) -> dict[str, str]:
        return self.raw.hashes()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class MLXExperts:
    """One MoE layer's stacked int4 experts; `extent(e, layout)` repacks expert e's codes."""

    def __init__(self, ckpt: MLXCheckpoint, fam, cfg, layer: int, scales_warned: set[str]):
        self.ckpt, self.layer = ckpt, layer
        stacks = ckpt.stacks[layer]
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        want = {"gate_proj": (e, i, d), "up_proj": (e, i, d), "down_proj": (e, d, i)}
        for proj, shape in want.items():
            qt = stacks.get(proj)
            if qt is None:
                raise ValueError(
                    f"{ckpt.path}: expert tensor {ckpt.switch[layer]}.{proj}.weight "
                    "is missing (looked for it with and without a language_model. prefix)"
                )
            p = qt.params
            if not INT4.accepts(p.bits, p.group_size):
                raise ValueError(
                    f"{ckpt.path}: {qt.module}.weight is {p.bits}-bit group {p.group_size}; "
                    f"edge0 extents hold {INT4.name} experts (convert the float checkpoint instead)"
                )
            if qt.shape != shape:
                raise ValueError(
                    f"{ckpt.path}: expert tensor {qt.module}.weight has logical shape "
                    f"{qt.shape}, config.json implies {shape}"
                )
            if qt.scales.dtype != "BF16" and qt.scales.dtype not in scales_warned:
                scales_warned.add(qt.scales.dtype)
                log.warning(
                    "%s: expert scales are %s; extents store bf16, so they are rounded "
                    "(exact only for BF16 scales)",
                    ckpt.path,
                    qt.scales.dtype,
                )
        self.stacks = stacks

    def keys(self) -> list[str]:
        return self.ckpt.stack_names[self.layer]

    def _codes(self, proj: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qt = self.stacks[proj]
        q = unpack_words(self.ckpt.read_rows(qt.weight, e, 1)[0], 4)  # [out, in]
        s = self.ckpt.read_rows(qt.scales, e, 1)[0]
        b = self.ckpt.read_rows(qt.biases, e, 1)[0]
        return q, s, b

    def extent(self, e: int, layout: ExtentLayout) -> torch.Tensor:
        """Expert e as one extent: MLX's codes and (scale, bias) pairs, repacked, no rounding."""
        (qg, sg, bg), (qu, su, bu) = self._codes("gate_proj", e), self._codes("up_proj", e)
        q2, s2, b2 = self._codes("down_proj", e)
        return layout.pack_quantized(  # w13 = gate rows then up rows [2I, D]
            torch.cat([qg, qu]), torch.cat([sg, su]), torch.cat([bg, bu]), q2, s2, b2
        )

    def release(self) -> None:
        pass


def import_mlx(
    mlx_dir: Path | str,
    out_dir: Path | str,
    *,
    force: bool = False,
    progress: bool = True,
    int4: str | None = None,
    resident: str = "int4",
) -> ConvertReport:
    """Build an edge0 directory from an MLX affine int4 checkpoint and its adapter files.
    `int4` and `resident` as for `convert.convert`; int4 resident weights keep MLX's values."""
    return with_peaks(_import, mlx_dir, out_dir, force, progress, int4, resident)


def _import(mlx_dir, out_dir, force, progress, int4, resident) -> ConvertReport:
    t0 = time.perf_counter()
    src = check_dir(mlx_dir, "MLX model directory")
    out = check_out_dir(out_dir, force)
    raw_config = read_json(src / "config.json", "model configuration")
    fam, cfg = load_config(src)
    adapters = find_adapters(src)
    ckpt = MLXCheckpoint(src, fam, cfg, raw_config)
    try:
        warned: set[str] = set()
        sources = {i: MLXExperts(ckpt, fam, cfg, i, warned) for i in ckpt.layers}
        config = {k: v for k, v in raw_config.items() if k not in CONFIG_KEYS}  # now bf16

        def write_adapters(tmp: Path) -> None:
            if "prerouter" in adapters:
                import_prerouter(adapters["prerouter"], tmp / modeldir.PREROUTER_FILE, cfg, ckpt)
            if "lora" in adapters:
                import_lora(adapters["lora"], tmp / modeldir.LORA_FILE, fam, ckpt)

        source = {
            "path": str(src.resolve()),
            "format": "mlx",
            "quantization": ckpt.quant.summary(),
            "skipped_tensors": len(ckpt.skipped),
            "adapters": {k: p.name for k, p in adapters.items()},
            "files": ckpt.hashes() | {p.name: sha256_file(p) for p in adapters.values()},
        }
        return write_model_dir(
            src,
            out,
            fam,
            cfg,
            ckpt,
            sources,
            progress=progress,
            t0=t0,
            source=source,
            config=config,
            extra=write_adapters,
            int4=int4,
            resident=resident,
        )
    finally:
        ckpt.close()


def find_adapters(path: Path) -> dict[str, Path]:
    """The prerouter and LoRA files beside the shards ({kind: file}); several of a kind is an
    error because which one was trained for these weights cannot be guessed."""
    found: dict[str, list[Path]] = {}
    for p in sorted(path.glob("*.safetensors")):
        if is_adapter_file(p):
            kind = "prerouter" if p.name.startswith("prerouter") else "lora"
            found.setdefault(kind, []).append(p)
    for kind, files in found.items():
        if len(files) > 1:
            raise ValueError(
                f"{path}: {len(files)} {kind} files ({', '.join(f.name for f in files)}); "
                "keep the one trained for these weights"
            )
    return {kind: files[0] for kind, files in found.items()}


def _read_adapter(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from e
    return tensors, meta


def _provenance(meta: dict[str, str], kind: str, src: Path) -> dict[str, str]:
    """The file's own metadata (model, K, r, alpha, owners, source, ...) plus where and when
    this copy came from; an existing `kind` must agree."""
    if meta.get("kind", kind) != kind:
        raise ValueError(f"{src}: metadata kind is {meta['kind']!r}, expected {kind!r}")
    return {
        **meta,
        "kind": kind,
        "format_version": meta.get("format_version", "1"),
        "imported_from": src.name,
        "imported_sha256": sha256_file(src),
        "imported": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def import_prerouter(src: Path, dst: Path, cfg, ckpt: MLXCheckpoint) -> int:
    """prerouter_*.safetensors -> prerouter.safetensors, keys `layers.{owner}.{fc1,fc2,
    linear_init}.weight` (legacy `pregate.N.*` / `layers.N.mlp.prerouter.*` renamed); returns
    the number of heads. Shapes are checked against hidden D and E experts."""
    tensors, meta = _read_adapter(src)
    f_in = cfg.hidden_size + 2 * cfg.num_experts  # [h | executed one-hot | previous one-hot]
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = PREROUTER_KEY.fullmatch(key)
        if m is None:
            raise ValueError(
                f"{src}: unexpected tensor {key!r}; a prerouter file holds "
                "layers.N.fc1.weight, layers.N.fc2.weight and layers.N.linear_init.weight"
            )
        owner, part = int(m[1]), m[2]
        if owner not in ckpt.layers:
            raise ValueError(f"{src}: {key}: layer {owner} is not an MoE layer of this model")
        out[f"layers.{owner}.{part}.weight"] = t.contiguous()
    owners = sorted({int(k.split(".")[1]) for k in out})
    for o in owners:
        fc1 = out.get(f"layers.{o}.fc1.weight")
        width = fc1.shape[0] if fc1 is not None else -1
        want = {
            "fc1": (width, f_in),
            "fc2": (cfg.num_experts, width),
            "linear_init": (cfg.num_experts, f_in),
        }
        for part, shape in want.items():
            key = f"layers.{o}.{part}.weight"
            if key not in out:
                raise ValueError(f"{src}: head {o} has no {key}")
            if tuple(out[key].shape) != shape:
                raise ValueError(
                    f"{src}: {key} has shape {tuple(out[key].shape)}, this model needs {shape} "
                    f"(hidden {cfg.hidden_size}, {cfg.num_experts} experts)"
                )
    meta = _provenance(meta, "prerouter", src)
    meta.setdefault("owners", json.dumps(owners))
    save_file(dict(sorted(out.items())), str(dst), metadata=meta)
    log.info("%s: %d prerouter heads from %s", dst, len(owners), src.name)
    return len(owners)


def import_lora(src: Path, dst: Path, fam, ckpt: MLXCheckpoint) -> int:
    """lora_*.safetensors -> lora.safetensors, keys `<our module path>.lora_A` [r, in] and
    `.lora_B` [out, r]; every target must be one of the family's LORA_TARGETS. The metadata
    must give alpha; `r` and `targets` are (re)written from the tensors under our names.
    Returns the number of targets."""
    tensors, meta = _read_adapter(src)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = LORA_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"{src}: unexpected tensor {key!r}; expected <module>.lora_A/B")
        pairs.setdefault(m[1], {})[m[2]] = t
    allowed = tuple(getattr(fam, "LORA_TARGETS", ()))
    out: dict[str, torch.Tensor] = {}
    for module, ab in pairs.items():
        weight = next((n for n in candidates(f"{module}.weight") if n in ckpt.expected), None)
        if weight is None:
            raise ValueError(f"{src}: LoRA target {module!r} is not a linear layer of this model")
        ours = weight.removesuffix(".weight")
        rel = re.sub(r"^.*?\blayers\.\d+\.", "", ours)
        if rel not in allowed:
            raise ValueError(
                f"{src}: LoRA target {module!r} ({rel}) is not one this family serves: "
                f"{', '.join(allowed) or 'none'}"
            )
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{src}: {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        n_out, n_in = ckpt.expected[weight]
        fits = a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1]
        if not fits or a.shape[1] != n_in or b.shape[0] != n_out:
            raise ValueError(
                f"{src}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit a [{n_out}, {n_in}] weight (want [r, {n_in}] and [{n_out}, r])"
            )
        out[f"{ours}.lora_A"], out[f"{ours}.lora_B"] = a.contiguous(), b.contiguous()
    if "alpha" not in meta:
        raise ValueError(f"{src}: metadata lacks 'alpha', so the LoRA scale alpha / r is unknown")
    ranks = {t.shape[0] for k, t in out.items() if k.endswith(".lora_A")}
    if len(ranks) != 1 or int(meta.get("r", next(iter(ranks), 0))) not in ranks:
        raise ValueError(f"{src}: ranks {sorted(ranks)} disagree with metadata r={meta.get('r')}")
    meta = _provenance(meta, "lora", src)
    meta["r"] = str(ranks.pop())
    meta["targets"] = json.dumps(sorted(k.removesuffix(".lora_A") for k in out if "lora_A" in k))
    save_file(dict(sorted(out.items())), str(dst), metadata=meta)
    log.info("%s: %d LoRA targets from %s", dst, len(pairs), src.name)
    return len(pairs)
