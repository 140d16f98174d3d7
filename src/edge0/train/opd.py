"""Phase 3, `edge0 train opd`: on-policy distillation through the served path.

Each step: corpus prompts; the current student (starting from the phase-2 LoRA) samples a
continuation as the engine would serve it; the full-precision teacher scores the same
tokens; the loss is the reverse KL on the teacher's top-k tokens plus one tail outcome that
carries the probability mass outside them:

  S = teacher top-k,   p_tail = 1 - sum_S p,   q_tail = 1 - sum_S q
  loss = sum_{i in S} q_i log(q_i / p_i) + q_tail log(q_tail / p_tail)

Reverse KL is mode-seeking: the student is not asked to cover all of the teacher's
support, and the tail term keeps it from putting mass where the teacher puts little.
The gradient flows through the prediction-routed student forward into the LoRA only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edge0.engine.sampling import SamplingParams
from edge0.models import lora
from edge0.text.tokenizer import load_tokenizer
from edge0.train import common
from edge0.train.student import (
    base_options,
    finish,
    load_student,
    load_teacher,
    placement,
    sample,
    train_lora,
)

log = logging.getLogger(__name__)


@dataclass
class OPDConfig:
    top_k: int | None = None
    stage_width: int | None = None  # W > K: train on the path `--stage-width W` serves
    prompt_len: int = 32
    gen_len: int = 64
    batch: int = 8  # sequences per step over all ranks (the effective batch)
    micro_batch: int | None = None  # rows per forward of a rank's share (accumulated)
    steps: int = 100
    lr: float = 3e-4
    teacher_topk: int = 16
    temperature: float = 1.0
    save_every: int = 10
    seed: int = 0
    base: str = "auto"  # the student's base: int4 (CPU), dequantized, auto (student_base)
    process_budget: int | None = None  # bytes for the whole process (int4 base)
    checkpoint: bool = True  # int4 base: recompute each decoder layer in the backward pass


def reverse_kl_topk_tail(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int
) -> torch.Tensor:
    """Mean over positions of KL(q || p) on the teacher's top-k tokens plus a tail outcome."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    logp = torch.log_softmax(teacher_logits.float(), dim=-1)
    top = torch.topk(logp, k, dim=-1).indices
    lq, lp = logq.gather(-1, top), logp.gather(-1, top)
    q = lq.exp()
    eps = 1e-6
    q_tail = (1 - q.sum(-1)).clamp_min(eps)
    p_tail = (1 - lp.exp().sum(-1)).clamp_min(eps)
    kl = (q * (lq - lp)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    return kl.mean()


def train_opd(
    model_dir: Path,
    teacher_dir: Path,
    data: list[str],
    init: Path,
    out: Path,
    cfg: OPDConfig,
    heads: Path | None = None,
    progress: bool = True,
) -> dict:
    model_dir, out = Path(model_dir), Path(out)
    run = out.with_name(out.name + ".run")
    run.mkdir(parents=True, exist_ok=True)
    device, base, ranks, share = placement(cfg.base, cfg.batch)
    progress = progress and ranks.main
    gen = common.seed_everything(cfg.seed)
    tok = load_tokenizer(model_dir)
    stream, data_hash = common.token_stream(data, "train", tok)
    teacher = load_teacher(teacher_dir, device, rows=share, length=cfg.prompt_len + cfg.gen_len)
    student = load_student(
        model_dir,
        top_k=cfg.top_k,
        heads=heads,
        lora_file=init,
        device=device,
        stage_width=cfg.stage_width,
        base=base,
        options=base_options(cfg.process_budget, share, cfg.prompt_len + cfg.gen_len),
    )
    student.checkpoint = cfg.checkpoint
    runtime = student.runtime()
    sampling = SamplingParams(temperature=cfg.temperature)
    p = cfg.prompt_len

    spent = {"sample_s": 0.0, "score_s": 0.0}  # this process's steps: sampling, scoring

    def batch_fn(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = common.random_windows(stream, cfg.batch, p - 1, gen)  # the global batch
        prompts = ranks.share(prompts).to(device)
        # each rank samples its rows with its own generator, drawn from the shared one: the
        # shared one stays in step on every rank (one rank: the rows' samples as before)
        own = gen
        if ranks.world > 1:
            seeds = torch.randint(0, 2**62, (ranks.world,), generator=gen)
            own = torch.Generator().manual_seed(int(seeds[ranks.rank]))
        student.model.eval()
        t0 = time.perf_counter()
        seqs = sample(
            student.model, prompts, cfg.gen_len, sampling, own, runtime, student.executors
        )
        t1 = time.perf_counter()
        with torch.no_grad():
            target = teacher(seqs)[:, p - 1 : -1]
        spent["sample_s"] += t1 - t0
        spent["score_s"] += time.perf_counter() - t1
        student.model.train()
        return seqs, target

    def loss_fn(part: tuple[torch.Tensor, torch.Tensor], forward) -> torch.Tensor:
        seqs, target = part
        logits = forward(seqs, p)[:, p - 1 : -1]
        return reverse_kl_topk_tail(logits, target, cfg.teacher_topk)

    t_loop = time.perf_counter()
    runlog = train_lora(
        student,
        run,
        common.config_dict(cfg),
        steps=cfg.steps,
        lr=cfg.lr,
        warmup=max(1, cfg.steps // 10),
        save_every=cfg.save_every,
        gen=gen,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        micro_batch=cfg.micro_batch,
        desc="opd",
        progress=progress,
        ranks=ranks,
    )
    spent["train_s"] = time.perf_counter() - t_loop - spent["sample_s"] - spent["score_s"]
    init_meta = lora.read(init).metadata
    meta = {
        "model": model_dir.name,
        "base_hash": student.base_hash,
        "phase": "3",
        "data_hash": data_hash,
        "init_data_hash": init_meta.get("data_hash", ""),
        "K": str(student.top_k),
        "W": str(student.stage_width or student.top_k),
        "seed": str(cfg.seed),
        "teacher_topk": str(cfg.teacher_topk),
        "student_base": base,
    }
    return {
        **finish(student, model_dir, out, meta, runlog, base, ranks),
        **{k: round(v, 1) for k, v in spent.items()},
    }
