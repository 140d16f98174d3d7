"""`edge0 convert MODEL.gguf OUT_DIR`: a llama.cpp GGUF file -> an edge0 model directory.

The file is read with llama.cpp's own `gguf` package (formats/gguf.py): its metadata becomes
config.json (per architecture, below), its embedded tokenizer becomes tokenizer.json through
transformers' GGUF tokenizer builder, and tensor names are mapped by the package's
TensorNameMap, the table llama.cpp's converter wrote them with. Weights are dequantized to
fp32 as the file defines them (exact for F32, F16, BF16 and Q8_0) and then stored as any
edge0 model is: routed experts as int4 affine group 64, resident weights as int4 or bf16.
Q4_0's group of 32 with an fp16 scale is not edge0's group of 64, and the K-quants' nested
scales are not affine pairs, so those are requantized. Every tensor class records how far the
stored weights are from the file's own dequantized values (relative L2), in the report and in
edge0.json's provenance.

Architectures: qwen3moe, qwen2moe, olmoe, and llama with experts (Mixtral). llama.cpp's
converter permutes a llama model's q/k rows for its interleaved RoPE; that is undone.
Shape legend: E experts, D hidden, I expert width, R rows.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edge0.convert import (
    ConvertReport,
    check_out_dir,
    expected_resident,
    moe_layers,
    with_peaks,
    write_model_dir,
)
from edge0.formats import quant
from edge0.formats.checkpoint import sha256_file
from edge0.formats.extents import ExtentLayout
from edge0.formats.gguf import EXACT_TYPES, GGUFFile
from edge0.modeldir.loader import build, expert_prefixes
from edge0.models import ARCHITECTURES, family, int4
from edge0.models.experts import ExpertSlot


@dataclass(frozen=True)
class Arch:
    model_type: str
    norm_topk_prob: bool  # what llama.cpp's graph does when the file does not say
    permuted_qk: bool = False  # the converter permuted q/k rows (llama's interleaved rope)


ARCHES = {
    "qwen3moe": Arch("qwen3_moe", norm_topk_prob=True),
    "qwen2moe": Arch("qwen2_moe", norm_topk_prob=False),
    "olmoe": Arch("olmoe", norm_topk_prob=False),
    "llama": Arch("mixtral", norm_topk_prob=True, permuted_qk=True),
}
EXPERT_KINDS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
FUSED_GATE_UP = "ffn_gate_up_exps"
CONTROL = 3  # tokenizer.ggml.token_type of a control token
# control tokens llama.cpp's vocabulary treats as ends of generation, whatever eos says
END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
)
# general.sampling.* -> generation_config.json
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def arch_of(g: GGUFFile) -> Arch:
    arch = ARCHES.get(g.arch)
    if arch is None or not g.arch_value("expert_count"):
        what = "a model without experts" if arch is not None else f"architecture {g.arch!r}"
        raise ValueError(
            f"{g.path}: {what} is not one edge0 imports; GGUF MoE architectures: "
            f"{', '.join(ARCHES)} (llama with experts)"
        )
    return arch


def hf_config(g: GGUFFile, arch: Arch) -> dict:
    """config.json for the file, with transformers' field names."""
    v = g.arch_value
    hidden, heads = int(v("embedding_length")), int(v("attention.head_count"))
    head_dim = int(v("attention.key_length", hidden // heads))
    rope_dims = v("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(
            f"{g.path}: rope.dimension_count {rope_dims} is not the head dimension {head_dim}; "
            "edge0's families rotate whole heads"
        )
    cfg = {
        # transformers' class for the family, as config.json names it
        "architectures": [next(a for a, t in ARCHITECTURES.items() if t == arch.model_type)],
        "model_type": arch.model_type,
        "vocab_size": g.shape("token_embd.weight")[0],
        "hidden_size": hidden,
        "num_hidden_layers": int(v("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(v("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(v("context_length", 4096)),
        "rms_norm_eps": as_written(v("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": as_written(v("rope.freq_base", 10000.0)),
        "num_experts": int(v("expert_count")),
        "num_experts_per_tok": int(v("expert_used_count")),
        "intermediate_size": int(v("feed_forward_length", 0)),
        "norm_topk_prob": bool(v("expert_weights_norm", arch.norm_topk_prob)),
        "tie_word_embeddings": "output.weight" not in g,
        "torch_dtype": "bfloat16",
    }
    if arch.model_type == "mixtral":
        cfg["num_local_experts"] = cfg["num_experts"]  # its expert width is intermediate_size
    else:
        cfg["moe_intermediate_size"] = int(v("expert_feed_forward_length"))
    if v("expert_shared_feed_forward_length") is not None:
        cfg["shared_expert_intermediate_size"] = int(v("expert_shared_feed_forward_length"))
    for key in ("bos_token_id", "eos_token_id"):
        if g.value(f"tokenizer.ggml.{key}") is not None:
            cfg[key] = int(g.value(f"tokenizer.ggml.{key}"))
    scaling = v("rope.scaling.type")
    if scaling not in (None, "none"):
        rope = {"rope_type": scaling, "factor": float(v("rope.scaling.factor", 1.0))}
        if v("rope.scaling.original_context_length") is not None:
            rope["original_max_position_embeddings"] = int(
                v("rope.scaling.original_context_length")
            )
        for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if v(f"rope.scaling.{key}") is not None:
                rope[ours] = float(v(f"rope.scaling.{key}"))
        cfg["rope_scaling"] = rope
    return cfg


def as_written(x: float) -> float:
    """A float32 metadata value as the float it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


def stop_tokens(g: GGUFFile) -> list[int]:
    """The ids that end an answer, as llama.cpp finds them: the file's end-of-text, -turn and
    -message ids, and every control token spelled as one of the known ends of generation."""
    stops = [
        int(t)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (t := g.value(f"tokenizer.ggml.{key}")) is not None
    ]
    tokens, types = g.value("tokenizer.ggml.tokens", []), g.value("tokenizer.ggml.token_type", [])
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):  # types may be absent
        if kind == CONTROL and text in END_OF_GENERATION and i not in stops:
            stops.append(i)
    return stops


def generation_config(g: GGUFFile) -> dict:
    """Stop tokens (end of text and end of turn) and the file's recommended sampling."""
    out: dict = {"eos_token_id": stop_tokens(g)}
    if g.value("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(g.value("tokenizer.ggml.bos_token_id"))
    for key, name in SAMPLING_KEYS.items():
        if (value := g.value(f"general.sampling.{key}")) is not None:
            out[name] = as_written(value) if isinstance(value, float) else value
    if any(name in out for name in SAMPLING_KEYS.values()):
        out["do_sample"] = True
    return out


def write_tokenizer(g: GGUFFile, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) from the tokenizer
    llama.cpp embedded, built by transformers' GGUF tokenizer builder."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer, config = get_gguf_tokenizer(str(g.path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    config = {k: v for k, v in {**config, **extra}.items() if v is not None}
    PreTrainedTokenizerFast(tokenizer_object=backend, **config).save_pretrained(str(folder))


class ErrorTally:
    """Relative L2 error of the stored weights against the file's dequantized values, per
    tensor class (the GGUF kind, its ggml type, and what edge0 stores it as)."""

    def __init__(self):
        self.sums: dict[tuple[str, str, str], list[float]] = {}

    def add(self, kind: str, source: str, stored: str, ref: torch.Tensor, got: torch.Tensor):
        s = self.sums.setdefault((kind, source, stored), [0.0, 0.0])
        s[0] += float((got.float() - ref).double().square().sum())
        s[1] += float(ref.double().square().sum())

    def rows(self) -> list[dict]:
        return [
            {
                "tensor": kind,
                "gguf": source,
                "stored": stored,
                "rel_l2": math.sqrt(err / ref) if ref else 0.0,
            }
            for (kind, source, stored), (err, ref) in sorted(self.sums.items())
        ]


def kind_of(name: str) -> str:
    """blk.3.ffn_down_exps.weight -> ffn_down_exps; output.weight -> output."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


class GGUFCheckpoint:
    """A GGUF file seen as our model's resident tensors (what `write_model_dir` reads): our
    names, our shapes, fp32 values; each value handed out is tallied against what it becomes."""

    def __init__(self, g: GGUFFile, fam, cfg, arch: Arch):
        import gguf

        self.g, self.path, self.files = g, g.path, [g.path]
        self.cfg, self.arch = cfg, arch
        self.keep_fp32 = tuple(getattr(fam, "KEEP_FP32", ()))
        self.errors = ErrorTally()
        names = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        tmap = gguf.get_tensor_name_map(names[g.arch], cfg.num_hidden_layers)
        self.expected = expected_resident(fam, cfg)
        self.entries: dict[str, str] = {}  # ours -> GGUF name
        for key in self.expected:
            module, _, suffix = key.rpartition(".")
            stored = tmap.get_name(module)
            if stored is not None and f"{stored}.{suffix}" in g:
                self.entries[key] = f"{stored}.{suffix}"
        self.layers = moe_layers(cfg, g.path)
        experts = {f"blk.{i}.{k}.weight" for i in self.layers for k in EXPERT_KINDS.values()}
        experts |= {f"blk.{i}.{FUSED_GATE_UP}.weight" for i in self.layers}
        used = set(self.entries.values()) | experts
        unused = [n for n in g.tensors if n not in used]
        if unused:
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            raise ValueError(
                f"{g.path}: tensor {unused[0]!r}{more} has no place in edge0's "
                f"{arch.model_type} model"
            )

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> list[int]:
        got = self.g.shape(self.entries[key])
        want = self.expected[key]
        # llama.cpp drops or adds unit axes (a [1, D] gate is stored [D]); same values
        return list(want) if math.prod(got) == math.prod(want) else list(got)

    def _values(self, key: str) -> torch.Tensor:
        t = self.g.get(self.entries[key]).reshape(self.shape(key))
        if self.arch.permuted_qk and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.cfg.num_attention_heads
            if key.endswith("k_proj.weight"):
                heads = self.cfg.num_key_value_heads
            t = unpermute(t, heads)
        return t

    def get(self, key: str) -> torch.Tensor:
        """The tensor under our name in fp32; the writer stores it in bf16 (fp32 for the
        family's KEEP_FP32 names), and that rounding is tallied here."""
        t = self._values(key)
        stored = torch.float32 if key.endswith(self.keep_fp32) else torch.bfloat16
        name = self.entries[key]
        self.errors.add(kind_of(name), self.g.type_name(name), str(stored)[6:], t, t.to(stored))
        return t

    def quantized(self, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A resident weight edge0 keeps in int4: quantized here, its error tallied."""
        t = self._values(key)
        parts = int4.quantize(t)
        name = self.entries[key]
        self.errors.add(kind_of(name), self.g.type_name(name), "int4", t, int4.dequantize(*parts))
        return parts

    def hashes(self) -> dict[str, str]:
        return {self.path.name: sha256_file(self.path)}


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (each head's rows from [pairs interleaved] back
    to [first halves | second halves], transformers' rotate-half order)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFExperts:
    """One MoE layer's stacked experts ([E, I, D] gate and up, [E, D, I] down, any ggml type);
    `extent(e, layout)` dequantizes expert e and requantizes it to int4 group 64."""

    def __init__(self, ckpt: GGUFCheckpoint, cfg, layer: int, prefix: str):
        self.ckpt, self.g, self.layer, self.prefix = ckpt, ckpt.g, layer, prefix
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        fused = f"blk.{layer}.{FUSED_GATE_UP}.weight"
        self.fused = fused in self.g
        want = {f"blk.{layer}.{EXPERT_KINDS['down']}.weight": (e, d, i)}
        if self.fused:
            want[fused] = (e, 2 * i, d)
        else:
            for kind in ("gate", "up"):
                want[f"blk.{layer}.{EXPERT_KINDS[kind]}.weight"] = (e, i, d)
        for name, shape in want.items():
            if name not in self.g:
                raise ValueError(f"{self.g.path}: expert tensor {name!r} is missing")
            if self.g.shape(name) != shape:
                raise ValueError(
                    f"{self.g.path}: expert tensor {name!r} has shape {self.g.shape(name)}, "
                    f"the metadata implies {shape}"
                )
        self.names = {k: f"blk.{layer}.{v}.weight" for k, v in EXPERT_KINDS.items()}
        self.names["gate_up"] = fused

    def keys(self) -> list[str]:
        return [f"{self.prefix}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]

    def _get(self, kind: str, e: int) -> torch.Tensor:
        return self.g.get(self.names[kind], e)

    def extent(self, e: int, layout: ExtentLayout) -> torch.Tensor:
        """Expert e requantized into one extent; the error of each part is tallied."""
        if self.fused:
            w13 = self._get("gate_up", e)
        else:
            w13 = torch.cat([self._get("gate", e), self._get("up", e)])
        w2 = self._get("down", e)
        q13, s13, b13 = quant.quantize_affine(w13)
        q2, s2, b2 = quant.quantize_affine(w2)
        got13, got2 = quant.dequantize_affine(q13, s13, b13), quant.dequantize_affine(q2, s2, b2)
        i = w2.shape[1]
        parts = [("down", w2, got2)]
        if self.fused:
            parts.append(("gate_up", w13, got13))
        else:
            parts += [("gate", w13[:i], got13[:i]), ("up", w13[i:], got13[i:])]
        for kind, ref, got in parts:
            name = self.names[kind]
            self.ckpt.errors.add(kind_of(name), self.g.type_name(name), "int4", ref, got)
        return layout.pack_quantized(q13, s13, b13, q2, s2, b2)

    def release(self) -> None:
        pass


def import_gguf(
    gguf_path: Path | str,
    out_dir: Path | str,
    *,
    force: bool = False,
    progress: bool = True,
    int4: str | None = None,
    resident: str = "int4",
) -> ConvertReport:
    """Build an edge0 directory from a GGUF file; `int4` and `resident` as for
    `convert.convert`. The report's `quant_errors` holds the relative L2 error per class."""
    return with_peaks(_import, gguf_path, out_dir, force, progress, int4, resident)


def _import(gguf_path, out_dir, force, progress, int4_layout, resident) -> ConvertReport:
    t0 = time.perf_counter()
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    out = check_out_dir(out_dir, force)
    g = GGUFFile(path)
    arch = arch_of(g)
    config = hf_config(g, arch)
    fam = family(config["model_type"], str(path))
    try:
        cfg = fam.Config.from_dict(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    ckpt = GGUFCheckpoint(g, fam, cfg, arch)
    prefixes = expert_prefixes(build(fam, cfg, ExpertSlot))
    sources = {i: GGUFExperts(ckpt, cfg, i, prefixes[i]) for i in ckpt.layers}
    types = sorted({g.type_name(n) for n in g.tensors})
    source = {
        "path": str(path.resolve()),
        "format": "gguf",
        "gguf_architecture": g.arch,
        "gguf_types": types,
        "exact": all(t in EXACT_TYPES for t in types),
        "files": ckpt.hashes(),
    }

    def write_extra(tmp: Path) -> None:
        write_tokenizer(g, tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(g), indent=2) + "\n"
        )
        source["quant_errors"] = ckpt.errors.rows()  # complete now: every tensor was written

    report = write_model_dir(
        None,  # nothing beside the file is copied: config and tokenizer come from within
        out,
        fam,
        cfg,
        ckpt,
        sources,
        progress=progress,
        t0=t0,
        source=source,
        config=config,
        extra=write_extra,
        int4=int4_layout,
        resident=resident,
    )
    report.quant_errors = ckpt.errors.rows()
    return report
