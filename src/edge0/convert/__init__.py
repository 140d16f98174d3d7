"""`edge0 convert HF_DIR OUT_DIR`: a Hugging Face MoE checkpoint -> an edge0 model directory.

Routed experts are quantized to int4 affine group-64 and written as one aligned extent per
expert (experts.safetensors); everything else is kept in bf16 (model.safetensors). Tensors
are read and written one at a time (fused expert tensors one layer at a time), so peak memory
stays near one layer of the source however large the checkpoint is. The output is built in
OUT_DIR.partial and renamed when complete: an interrupted convert leaves no half model.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import resource
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from edge0 import modeldir
from edge0.formats import int4_layout, quant
from edge0.formats.checkpoint import (
    Checkpoint,
    ExpertSource,
    ServedCheckpoint,
    check_dir,
)
from edge0.formats.extents import ExtentLayout
from edge0.formats.format import EXPERT_FORMATS, INT4
from edge0.formats.writer import StreamingSafetensors
from edge0.modeldir.loader import build, expert_prefixes
from edge0.models import int4, load_config
from edge0.models.experts import ExpertSlot
from edge0.store.expert_file import FILE_NAME as EXPERTS_FILE
from edge0.store.expert_file import LAYOUT_KEY, ExtentsWriter
from edge0.util import memory
from edge0.util.fs import recover_dir, replace_dir

log = logging.getLogger(__name__)

RESIDENT_FORMATS = ("int4", "bf16")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass
class ConvertReport:
    out_dir: Path
    resident_bytes: int
    expert_bytes: int
    num_extents: int
    extent_bytes: int
    seconds: float
    peak_rss_bytes: int
    peak_anon_bytes: int
    peak_file_bytes: int
    source_bytes: int
    # relative L2 error per tensor class where the source's values were requantized (GGUF)
    quant_errors: list[dict] = field(default_factory=list)


def expected_resident(fam, cfg) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the non-expert tensors the family's model declares."""
    model = build(fam, cfg, ExpertSlot)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def convert(
    hf_dir: Path | str,
    out_dir: Path | str,
    *,
    force: bool = False,
    progress: bool = True,
    int4: str | None = None,
    resident: str = "int4",
    experts: str = "int4",
) -> ConvertReport:
    """`int4` names the arrangement of the expert codes (int4_layout.py); the default is this
    machine's kernel's, so serving here never repacks. Any arrangement serves everywhere.
    `resident` is "int4" (projections and embeddings as int4, models/int4.py) or "bf16".
    `experts` is "int4" (served) or "bf16" (the weights themselves: a teacher's store)."""
    return with_peaks(_convert, hf_dir, out_dir, force, progress, int4, resident, experts)


def with_peaks(run: Callable[..., ConvertReport], *args) -> ConvertReport:
    """run(*args)'s report with the peak anonymous and file-backed memory sampled during it."""
    with memory.PeakSampler() as peaks:
        report = run(*args)
    report.peak_anon_bytes, report.peak_file_bytes = peaks.peak_anon, peaks.peak_file
    return report


def _convert(hf_dir, out_dir, force, progress, int4, resident, experts) -> ConvertReport:
    t0 = time.perf_counter()

    src = check_dir(hf_dir, "Hugging Face model directory")
    out = check_out_dir(out_dir, force)
    fam, cfg = load_config(src)
    ckpt = ServedCheckpoint(Checkpoint(src), fam, cfg)
    moe_layers(cfg, src)  # a model without MoE layers is an error
    prefixes = expert_prefixes(build(fam, cfg, ExpertSlot))
    sources = {i: ExpertSource(ckpt, prefix, cfg.num_experts) for i, prefix in prefixes.items()}
    for source in sources.values():
        source.check_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
    return write_model_dir(
        src,
        out,
        fam,
        cfg,
        ckpt,
        sources,
        progress=progress,
        t0=t0,
        int4=int4,
        resident=resident,
        experts=experts,
    )


def check_out_dir(out_dir: Path | str, force: bool) -> Path:
    out = Path(out_dir)
    recover_dir(out)  # a replacement killed between its renames: the old model back first
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
    return out


def moe_layers(cfg, src: Path) -> list[int]:
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    if not layers:
        raise ValueError(f"{src / 'config.json'}: the model has no MoE layers to stream")
    return layers


def write_model_dir(
    src: Path | None,
    out: Path,
    fam,
    cfg,
    ckpt,
    sources: dict,
    *,
    progress: bool,
    t0: float,
    source: dict | None = None,
    config: dict | None = None,
    extra: Callable[[Path], None] | None = None,
    int4: str | None = None,
    resident: str = "int4",
    experts: str = "int4",
) -> ConvertReport:
    """Write an edge0 directory from any checkpoint view and per-layer expert sources.

    `ckpt` needs keys/shape/get/files/hashes (resident tensors under our module names);
    each source needs keys/extent/release. `config` replaces config.json's content,
    `source` the manifest's provenance, and `extra(tmp)` adds files before hashing; config and
    tokenizer files are copied from `src` unless it is None. `int4` names the codes'
    arrangement (default: this machine's kernel's); `resident` is "int4" or "bf16"; `experts`
    the experts' format (format.EXPERT_FORMATS). A checkpoint that offers `quantized(key)`
    gives int4 resident weights itself (MLX keeps its values; GGUF tallies the error).
    """
    if resident not in RESIDENT_FORMATS:
        raise ValueError(f"resident must be one of {RESIDENT_FORMATS}, not {resident!r}")
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {tuple(EXPERT_FORMATS)}, not {experts!r}")
    arrangement = int4_layout.by_name(int4) if int4 else int4_layout.host_layout()
    layout = ExtentLayout(
        cfg.hidden_size, cfg.moe_intermediate_size, arrangement, EXPERT_FORMATS[experts]
    )
    skip = {k for s in sources.values() for k in s.keys()}
    meta_model = build(fam, cfg, ExpertSlot)
    expected = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    keys = _check_resident(ckpt, expected, skip)
    as_int4 = set()
    if resident == "int4":
        as_int4 = meta_model.int4_weights(getattr(fam, "NOT_INT4", ()))

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    keep_fp32 = getattr(fam, "KEEP_FP32", ())
    need = len(sources) * cfg.num_experts * layout.nbytes
    need += _resident_bytes(ckpt, keys, keep_fp32, as_int4)
    _check_free_space(out.parent, need)
    tmp.mkdir(parents=True)
    try:
        resident_bytes = _write_resident(
            ckpt, keys, tmp / modeldir.RESIDENT_FILE, progress, keep_fp32, as_int4
        )
        table = _write_experts(cfg, sources, layout, tmp / EXPERTS_FILE, progress)
        for name in ("config.json",) + TOKENIZER_FILES if src is not None else ():
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if extra is not None:
            extra(tmp)
        manifest = modeldir.Manifest.new(
            family=cfg.model_type,
            layout=layout,
            num_experts=cfg.num_experts,
            native_top_k=cfg.num_experts_per_tok,
            layers=table,
            source=source or {"path": str(src.resolve()), "files": ckpt.hashes()},
            resident=resident,
        )
        manifest.hash_files(tmp)
        _bind_adapters(tmp, manifest)
        manifest.save(tmp)
        replace_dir(tmp, out)  # a kill at any moment leaves the old model or the new one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertReport(
        out_dir=out,
        resident_bytes=resident_bytes,
        expert_bytes=len(sources) * cfg.num_experts * layout.nbytes,
        num_extents=len(sources) * cfg.num_experts,
        extent_bytes=layout.nbytes,
        seconds=time.perf_counter() - t0,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_anon_bytes=0,
        peak_file_bytes=0,
        source_bytes=sum(f.stat().st_size for f in ckpt.files),
    )


def _check_resident(
    ckpt: Checkpoint, expected: dict[str, tuple[int, ...]], skip: set[str]
) -> list[str]:
    """Resident tensor names in declaration order; errors name a missing/extra/misshapen one.
    `skip`: expert tensors and tensors the family does not serve."""
    present = [k for k in ckpt.keys() if k not in skip]
    extra = [k for k in present if k not in expected]
    if extra:
        raise ValueError(
            f"{ckpt.path}: unexpected tensor {extra[0]!r} (and {len(extra) - 1} more)"
            if len(extra) > 1
            else f"{ckpt.path}: unexpected tensor {extra[0]!r}"
        )
    missing = [k for k in expected if k not in ckpt]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"{ckpt.path}: missing tensor {missing[0]!r}{more}, which config.json implies"
        )
    for k in expected:
        if tuple(ckpt.shape(k)) != expected[k]:
            raise ValueError(
                f"{ckpt.path}: tensor {k!r} has shape {tuple(ckpt.shape(k))}, "
                f"config.json implies {expected[k]}"
            )
    return list(expected)


def _bind_adapters(folder: Path, manifest: modeldir.Manifest) -> None:
    """Adapters written into a new directory without a base_hash (imported beside the
    checkpoint they were trained on) get this model's, so that loading them on another base
    is refused, as for adapters edge0 trained."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = manifest.base_hash()
    for name in (modeldir.LORA_FILE, modeldir.PREROUTER_FILE):
        path = folder / name
        if not path.is_file():
            continue
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "base_hash" not in meta:
            save_file(tensors, str(path), metadata=meta | {"base_hash": base})
            manifest.hash_files(folder, [name])


def _resident_bytes(ckpt, keys: list[str], keep_fp32: tuple[str, ...], as_int4: set[str]) -> int:
    """What _write_resident writes for these tensors, near enough (headers aside)."""
    total = 0
    for k in keys:
        shape = tuple(ckpt.shape(k))
        if k in as_int4:
            total += INT4.held_bytes(*shape)
        else:
            total += math.prod(shape) * (4 if k.endswith(keep_fp32) else 2)
    return total


def _check_free_space(folder: Path, need: int) -> None:
    """OSError (ENOSPC) naming both sizes where `folder`'s file system has less than `need`
    bytes free: refused before anything is written."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"the converted model needs {memory.format_bytes(need)}, and only "
            f"{memory.format_bytes(free)} are free there",
            str(folder),
        )


def _write_resident(
    ckpt,
    keys: list[str],
    path: Path,
    progress: bool,
    keep_fp32: tuple[str, ...] = (),
    as_int4: set[str] = frozenset(),
) -> int:
    """bf16, except names ending in one of the family's `KEEP_FP32` suffixes (routers and
    selection biases, whose bf16 rounding would change which experts are chosen), and the
    weights in `as_int4`: MLX affine int4, as `.weight` U32 words with `.scales`/`.biases`."""
    specs = []
    for k in keys:
        shape = tuple(ckpt.shape(k))
        if k in as_int4:
            n, width = shape
            groups = (n, width // quant.GROUP)
            module = k.removesuffix(".weight")
            specs += [
                (k, torch.uint32, (n, width // 8)),
                (f"{module}.scales", torch.bfloat16, groups),
                (f"{module}.biases", torch.bfloat16, groups),
            ]
        else:
            dtype = torch.float32 if k.endswith(keep_fp32) else torch.bfloat16
            specs.append((k, dtype, shape))
    dtypes = {name: dtype for name, dtype, _ in specs}
    writer = StreamingSafetensors(path, specs, metadata={"format": "pt", "edge0": "resident"})
    total = 0
    quantized = getattr(ckpt, "quantized", lambda key: None)
    for k in tqdm(keys, desc="resident weights", unit="tensor", disable=not progress):
        if k in as_int4:
            module = k.removesuffix(".weight")
            parts = quantized(k) or int4.quantize(ckpt.get(k))  # MLX int4 kept as it is
            out = dict(zip((k, f"{module}.scales", f"{module}.biases"), parts, strict=True))
        else:
            out = {k: ckpt.get(k).to(dtypes[k])}
        for name, t in out.items():
            writer.write(name, t)
            total += t.numel() * t.element_size()
    writer.close()
    return total


def _write_experts(
    cfg, sources: dict[int, ExpertSource], layout: ExtentLayout, path: Path, progress: bool
) -> dict[int, dict[str, int]]:
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    meta = {
        "format": "edge0-extents",
        "extent_bytes": str(layout.nbytes),
        "hidden": str(d),
        "inter": str(i),
        LAYOUT_KEY: layout.int4.name,
    }
    writer = ExtentsWriter(path, {layer: cfg.num_experts for layer in sources}, layout.nbytes, meta)
    table, offset = {}, writer.data_start
    bar = tqdm(
        total=len(sources) * cfg.num_experts,
        desc=f"experts -> {layout.format.name}",
        unit="expert",
        disable=not progress,
    )
    # the next extent is made (read, quantized or drawn) on a second thread while this one is
    # written: torch, numpy and file writes release the GIL, so the disk need not wait
    with ThreadPoolExecutor(1, thread_name_prefix="edge0-extent") as pool:
        for layer, source in sources.items():
            table[layer] = {"offset": offset, "count": cfg.num_experts}
            ahead = pool.submit(source.extent, 0, layout)
            for e in range(cfg.num_experts):
                extent = ahead.result()
                if e + 1 < cfg.num_experts:
                    ahead = pool.submit(source.extent, e + 1, layout)
                writer.write(layer, extent[None])
                bar.update(1)
            source.release()
            offset += cfg.num_experts * layout.nbytes
    bar.close()
    writer.close()
    return table
