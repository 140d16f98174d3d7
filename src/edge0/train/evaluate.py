"""`edge0 eval`: price every approximation on held-out text, one arm at a time.

Arms (each adds one thing to the one above it):
  teacher              full precision, native K, gate routing
  int4 native K        the dequantized int4 experts, gate routing, native K
  + int4 floor         ... and the resident floor in int4 as well (what `edge0 convert` writes
                       by default), when MODEL_DIR keeps its floor in bf16: the teacher is
                       converted into a scratch folder for it
  int8 activations     the "int4 native K" arm again (not the floor arm's), with every routed
                       expert's and (int4 floor) attention projection's inputs quantized as
                       `--int4-activations int8` quantizes them, per group of 64
                       (quant.fake_quantize_activations); `int8_activations=False` skips it
  KV bfloat16, KV int8 the "int4 native K" arm again with its keys and values kept in a KV
                       cache as `--kv-dtype` stores them (bf16, the default; int8, a scale
                       per 32 channels); KL also against the same model's fp32 keys
                       (bf16) and against the bf16 cache (int8); `kv_arms=False` skips them
  int4 served K        ... serving K experts per token
  + prerouter          ... consumer layers routed by the heads' predictions
  + LoRA (phase 2)     ... with the SFT adapter
  + LoRA (phase 3)     ... with the on-policy adapter: the served model where the pool reads
  gate routing + LoRA  "int4 served K" with the phase-3 adapter: the model served where the
                       pool holds every expert (no prerouter there: EngineOptions
                       .prerouter_always)
  W=N arms             the prerouter stages N > K experts and each consumer's router picks
                       its K among them (`--stage-width N`), without and with the phase-3
                       LoRA; N = 1.5K and 2K unless `stage_widths` says otherwise

Metrics per token over fixed held-out windows: perplexity, top-1 agreement with the teacher,
and mean KL(teacher || arm). Prediction routing starts at position 1 of each window (position
0 has no previous token), i.e. the window is scored as if the model had generated it.
Int4 arms run the dequantized weights in fp32 (the engine's int4 kernel additionally rounds
activations to bf16: relative L2 ~4e-3 per expert output, docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge0 import modeldir
from edge0.convert import convert
from edge0.engine.plan import resolve_top_k
from edge0.formats import quant
from edge0.models import lora
from edge0.models.base import Forward
from edge0.models.experts import ResidentExperts
from edge0.models.layers import KV_DTYPES, Attention
from edge0.text.tokenizer import load_tokenizer
from edge0.train import common
from edge0.train.student import load_student, load_teacher


@dataclass
class EvalConfig:
    teacher: Path
    data: tuple[str, ...] = ("stdlib",)
    top_k: int | None = None
    windows: int = 32
    seq_len: int = 256
    prerouter: Path | None = None
    lora_sft: Path | None = None
    lora_opd: Path | None = None
    stage_widths: tuple[int, ...] | None = None  # W > K arms (None: 1.5K and 2K)
    int4_floor: bool = True  # price an int4 resident floor when MODEL_DIR's is bf16
    int8_activations: bool = True  # price --int4-activations int8 at native K
    kv_arms: bool = True  # price --kv-dtype bfloat16 and int8 at native K


def default_paths(model_dir: Path, cfg: EvalConfig) -> EvalConfig:
    """Fill in the adapter files that sit in the model directory."""
    cfg.prerouter = cfg.prerouter or _if_exists(model_dir / modeldir.PREROUTER_FILE)
    cfg.lora_sft = cfg.lora_sft or _if_exists(model_dir / modeldir.LORA_SFT_FILE)
    cfg.lora_opd = cfg.lora_opd or _if_exists(model_dir / modeldir.LORA_FILE)
    return cfg


def _if_exists(p: Path) -> Path | None:
    return p if p.exists() else None


def arms(model_dir: Path, cfg: EvalConfig) -> list[tuple[str, object]]:
    """(label, callable tokens -> logits) for every arm the files allow."""
    teacher = load_teacher(cfg.teacher)
    manifest = modeldir.Manifest.load(model_dir)
    native = load_student(model_dir, top_k=manifest.native_top_k, heads=False)
    floor = manifest.quantization.get("resident", "bf16")
    out = [
        ("teacher (full precision, native K)", lambda t: teacher(t)),
        (
            f"int4, native routing, native K={native.top_k}"
            + (" (int4 floor)" if floor == "int4" else ""),
            lambda t: native.forward(t, 1),
        ),
    ]
    if cfg.int4_floor and floor != "int4":
        out.append((f"+ int4 floor, native K={native.top_k}", _int4_floor(cfg)))
    if cfg.int8_activations:
        int8 = load_student(model_dir, top_k=manifest.native_top_k, heads=False)
        int8_activations(int8.model, attention=floor == "int4")
        label = f"int4, native routing, native K={native.top_k}, int8 activations"
        out.append((label, lambda t: int8.forward(t, 1)))
    if cfg.kv_arms:
        for name in ("bfloat16", "int8"):  # the native-K arm's model, with a cache
            out.append((f"{out[1][0]}, KV {name}", _cached(native.model, KV_DTYPES[name])))
    served_k = resolve_top_k(cfg.top_k, manifest.served_top_k, manifest.native_top_k)
    if served_k != native.top_k:
        served = load_student(model_dir, top_k=served_k, heads=False)
        out.append((f"int4, native routing, served K={served_k}", lambda t: served.forward(t, 1)))
    if cfg.prerouter is not None:
        pre = load_student(model_dir, top_k=served_k, heads=cfg.prerouter)
        out.append((f"+ prerouter routing (K={served_k})", lambda t: pre.forward(t, 1)))
        opd = None
        for label, path in (("+ LoRA after phase 2", cfg.lora_sft), ("+ phase 3", cfg.lora_opd)):
            if path is not None:
                s = load_student(model_dir, top_k=served_k, heads=cfg.prerouter, lora_file=path)
                out.append((label, (lambda st: lambda t: st.forward(t, 1))(s)))
                opd = s if label == "+ phase 3" else opd
        if cfg.lora_opd is not None:
            gate = load_student(model_dir, top_k=served_k, heads=False, lora_file=cfg.lora_opd)
            label = f"gate routing, served K={served_k}, + phase 3 (every expert in memory)"
            out.append((label, lambda t: gate.forward(t, 1)))
        for w in stage_widths(cfg, served_k, pre.model.config.num_experts):
            out.append((f"W={w}: prerouter stages {w}, router picks K", _wide(pre, w)))
            if opd is not None:  # the same phase-3 model, routed at W
                out.append((f"W={w}: + phase 3", _wide(opd, w)))
    return out


def kv_references(labels: list[str]) -> dict[str, str]:
    """The arm each KV arm is also compared with: bf16 storage with the same model without a
    cache (its keys exact: fp32), int8 with bf16 storage."""
    out = {}
    for label in labels:
        base, _, kv = label.rpartition(", KV ")
        if kv == "bfloat16" and base in labels:
            out[label] = base
        elif kv == "int8" and f"{base}, KV bfloat16" in labels:
            out[label] = f"{base}, KV bfloat16"
    return out


def _cached(model, kv_dtype: torch.dtype):
    """The model over a window with its keys and values kept in a cache of `kv_dtype` (what
    a decoding request attends to: every position's keys as stored)."""

    def forward(t):
        cache = model.new_cache(t.shape[1], next(model.parameters()).dtype, kv_dtype=kv_dtype)
        return model(t, Forward(cache))

    return forward


def int8_activations(model: torch.nn.Module, attention: bool) -> None:
    """Quantize what the engine's int8 kernels take as int8 (`--int4-activations int8`): the
    inputs of every routed expert's projections and, with `attention` (an int4 floor), of
    every Attention's projections (the engine: of the layers its native layer op serves,
    native_layers.py `servable`). The rest (a shared expert, a dense MLP, the LM head) keeps
    float activations here, as in the other int4 arms; the engine rounds them to bf16."""
    for m in model.modules():
        if isinstance(m, ResidentExperts):
            m.inputs = quant.fake_quantize_activations
        elif attention and isinstance(m, Attention):
            for p in (m.q_proj, m.k_proj, m.v_proj, m.o_proj):
                p.register_forward_pre_hook(
                    lambda _m, args: (quant.fake_quantize_activations(args[0]), *args[1:])
                )


def _int4_floor(cfg: EvalConfig):
    """The teacher converted as `edge0 convert` does by default (int4 floor and experts) into
    a scratch folder that lives as long as the arm."""
    scratch = tempfile.TemporaryDirectory(prefix="edge0-eval-")
    convert(cfg.teacher, Path(scratch.name), force=True, progress=False)
    student = load_student(scratch.name, heads=False)  # a fresh conversion serves native K

    def forward(t, _scratch=scratch):  # holds the folder until the arm is dropped
        return student.forward(t, 1)

    return forward


def stage_widths(cfg: EvalConfig, k: int, num_experts: int) -> list[int]:
    """The W > K arms: those asked for, else 1.5K and 2K (at most every expert)."""
    asked = cfg.stage_widths if cfg.stage_widths is not None else (math.ceil(1.5 * k), 2 * k)
    return sorted({min(w, num_experts) for w in asked if w > k})


def _wide(student, w: int):
    wide = dataclasses.replace(student, stage_width=w)  # the same model and heads
    return lambda t: wide.forward(t, 1)


@torch.no_grad()
def evaluate(model_dir: Path, cfg: EvalConfig, progress: bool = True) -> dict:
    model_dir = Path(model_dir)
    cfg = default_paths(model_dir, cfg)
    tok = load_tokenizer(model_dir)
    stream, data_hash = common.token_stream(list(cfg.data), "heldout", tok)
    windows = common.fixed_windows(stream, cfg.windows, cfg.seq_len)
    models = arms(model_dir, cfg)
    sums = {label: {"nll": 0.0, "agree": 0, "kl": 0.0, "kl_vs": 0.0} for label, _ in models}
    vs = kv_references([label for label, _ in models])
    n = 0
    for w in tqdm(windows, desc="eval", unit="window", disable=not progress):
        x, y = w[None, :-1], w[None, 1:]
        ref, kept = None, {}
        for label, fn in models:
            logp = F.log_softmax(fn(x).float(), dim=-1)[0]  # [T, V]
            if ref is None:
                ref = logp
            if label in vs.values():
                kept[label] = logp
            s = sums[label]
            s["nll"] -= logp.gather(-1, y[0][:, None]).sum().item()
            s["agree"] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            s["kl"] += (ref.exp() * (ref - logp)).sum().item()
            if label in vs:
                r = kept[vs[label]]
                s["kl_vs"] += (r.exp() * (r - logp)).sum().item()
        n += y.numel()
    rows = []
    teacher_ppl = math.exp(sums[models[0][0]]["nll"] / n)
    for label, _ in models:
        s = sums[label]
        ppl = math.exp(s["nll"] / n)
        rows.append(
            {
                "arm": label,
                "perplexity": ppl,
                "ppl_vs_teacher": ppl / teacher_ppl - 1,
                "top1_agreement": s["agree"] / n,
                "kl_teacher_arm": s["kl"] / n,
            }
        )
        if label in vs:
            rows[-1].update(vs=vs[label], kl_vs_arm=s["kl_vs"] / n)
    return {
        "model": str(model_dir),
        "teacher": str(cfg.teacher),
        "tokens": n,
        "windows": len(windows),
        "seq_len": cfg.seq_len,
        "data_hash": data_hash,
        "arms": rows,
        "files": {
            "prerouter": str(cfg.prerouter),
            "lora_phase2": str(cfg.lora_sft),
            "lora_phase3": str(cfg.lora_opd),
        },
    }


def table(result: dict) -> str:
    lines = [
        "| arm | held-out ppl | vs teacher | top-1 agree | KL(teacher‖arm) |",
        "|---|---|---|---|---|",
    ]
    for r in result["arms"]:
        lines.append(
            f"| {r['arm']} | {r['perplexity']:.3f} | {100 * r['ppl_vs_teacher']:+.2f}% | "
            f"{100 * r['top1_agreement']:.2f}% | {r['kl_teacher_arm']:.4f} |"
        )
    vs = [r for r in result["arms"] if "kl_vs_arm" in r]
    if vs:
        lines.append("")
    lines += [f"{r['arm']}: KL({r['vs']}‖arm) {r['kl_vs_arm']:.2e}" for r in vs]
    lines.append(
        f"\n{result['tokens']} held-out tokens in {result['windows']} windows of "
        f"{result['seq_len']}"
    )
    return "\n".join(lines)


@torch.no_grad()
def lora_retention(
    model_dir: Path,
    lora_path: Path,
    prompt_ids: list[int],
    top_k: int | None = None,
    heads: Path | None | bool = None,
) -> dict:
    """What survives of the adapter if it is merged into the weights instead of served beside.

    For each target W: delta = (alpha/r) B A. Merging into bf16 (edge0's resident format)
    rounds W + delta to bf16; merging as the reference did re-quantizes W + delta to int4
    (group 64), except for a router, which stays float in every format. Weight-level
    retention per target: sum(actual * delta) / sum(delta^2), with actual = merged - base
    (both dequantized). Logits-level: 1 - |U - M| / |U - B| on the
    first-token logits of `prompt_ids` (U unmerged, M merged, B no adapter).
    """
    from edge0.formats import quant

    student = load_student(model_dir, top_k=top_k, heads=heads, lora_file=lora_path)
    model = student.model
    x = torch.tensor([prompt_ids])
    first = len(prompt_ids)  # the whole prompt is gate-routed, like a prefill

    def first_logits():
        return student.forward(x, first)[0, -1].float()

    loras = lora.adapters(model)
    # a router is float in every format: merged as into bf16
    router_targets = lora.router_targets(model)
    routers = set(lora.target_paths(model, router_targets)) if router_targets else set()
    saved = {name: m.base.weight.data.clone() for name, m in loras.items()}
    results = {}
    for scheme in ("bf16", "int4"):
        per_target, merged = {}, {}
        for name, m in loras.items():
            w, delta = saved[name].float(), m.delta_weight().float()
            if scheme == "bf16" or name in routers:
                base = w.bfloat16().float()
                merged[name] = (base + delta).bfloat16().float()
            else:  # as if the projection itself were served in int4, as in the reference
                base = quant.dequantize_affine(*quant.quantize_affine(w))
                merged[name] = quant.dequantize_affine(*quant.quantize_affine(base + delta))
            actual = merged[name] - base
            per_target[name] = float(
                (actual * delta).sum() / (delta * delta).sum().clamp_min(1e-30)
            )
            m.base.weight.data.copy_(base)
        lora.set_enabled(model, True)
        u = first_logits()
        lora.set_enabled(model, False)
        b = first_logits()
        for name, m in loras.items():
            m.base.weight.data.copy_(merged[name])
        m_logits = first_logits()
        results[scheme] = {
            "weight_retention_mean": sum(per_target.values()) / len(per_target),
            "weight_retention_per_target": per_target,
            "logits_retention": float(1 - (u - m_logits).norm() / (u - b).norm()),
        }
    for name, m in loras.items():
        m.base.weight.data.copy_(saved[name])
    lora.set_enabled(model, True)
    return {"lora": str(lora_path), "targets": len(loras), **results}


def retention_table(r: dict) -> str:
    lines = [
        "| merge into | weight-level retention (mean over targets) | logits-level retention |",
        "|---|---|---|",
    ]
    for scheme, label in (
        ("bf16", "bf16 weights (edge0's resident format)"),
        ("int4", "int4 group-64, re-quantized (the reference's case)"),
    ):
        s = r[scheme]
        lines.append(
            f"| {label} | {100 * s['weight_retention_mean']:.1f}% | "
            f"{100 * s['logits_retention']:.1f}% |"
        )
    return "\n".join(lines)


def dump(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")
