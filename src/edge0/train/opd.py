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

With `--round-steps R` the phase runs in rounds, so that the teacher is not in memory while
the student samples and trains: the student samples the next R steps' sequences, the teacher
is loaded, scores them into RUN/round-<r>[.rank<n>].safetensors (what the loss needs: per
position the top-k ids, their log-probabilities and the log of the tail mass) and is closed
again, then the student trains R steps from that file. A round's samples come from the
student as it was at the round's start (R = 1 is the per-step loop's arithmetic). A resumed
run reuses a finished round file and makes an unfinished one again from the checkpoint it
resumes, which is the round's start.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from edge0.engine.sampling import SamplingParams
from edge0.models import lora
from edge0.text.tokenizer import load_tokenizer
from edge0.train import common
from edge0.train.student import (
    base_options,
    close_teacher,
    finish,
    load_student,
    load_teacher,
    placement,
    sample,
    train_lora,
)
from edge0.train.teacher_cache import top_k_and_tail
from edge0.util import memory

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
    fsdp: bool = False  # dequantized base under torchrun: shard it over the ranks (FSDP2)
    round_steps: int = 0  # > 0: sample, score (teacher loaded for that alone), train in rounds


TAIL_FLOOR = 1e-6  # the least probability a tail outcome is given


def reverse_kl_topk_tail(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int
) -> torch.Tensor:
    """Mean over positions of KL(q || p) on the teacher's top-k tokens plus a tail outcome."""
    return reverse_kl_scored(student_logits, *top_k_and_tail(teacher_logits, k))


def reverse_kl_scored(
    student_logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, tail: torch.Tensor
) -> torch.Tensor:
    """reverse_kl_topk_tail from the teacher's top-k ids [..., k], their log-probabilities
    [..., k] and the log of its tail mass [...] (teacher_cache.top_k_and_tail)."""
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    lq = logq.gather(-1, ids.long())
    q_tail = (1 - lq.exp().sum(-1)).clamp_min(TAIL_FLOOR)
    log_p_tail = tail.float().clamp_min(torch.log(torch.tensor(TAIL_FLOOR)))
    kl = (lq.exp() * (lq - logprobs.float())).sum(-1) + q_tail * (q_tail.log() - log_p_tail)
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
    length = cfg.prompt_len + cfg.gen_len
    rounds = cfg.round_steps > 0
    # per step the teacher stays loaded, first, so that the student's plan counts it; in
    # rounds it is loaded only to score each round
    teacher = None if rounds else load_teacher(teacher_dir, device, rows=share, length=length)
    student = load_student(
        model_dir,
        top_k=cfg.top_k,
        heads=heads,
        lora_file=init,
        device=device,
        stage_width=cfg.stage_width,
        base=base,
        options=base_options(cfg.process_budget, share, length),
        shard=ranks if cfg.fsdp else None,
    )
    student.checkpoint = cfg.checkpoint
    runtime = student.runtime()
    sampling = SamplingParams(temperature=cfg.temperature)
    p = cfg.prompt_len

    # this process's time: sampling, scoring (loading the teacher included), rounds
    spent = {"sample_s": 0.0, "score_s": 0.0, "rounds": 0}

    def samples() -> torch.Tensor:
        """This rank's sequences for the next step: corpus prompts continued by the
        student."""
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
        spent["sample_s"] += time.perf_counter() - t0
        student.model.train()
        return seqs

    def scored(model, seqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return top_k_and_tail(model(seqs)[:, p - 1 : -1], cfg.teacher_topk)

    def batch_fn(step: int) -> tuple[torch.Tensor, ...]:
        seqs = samples()
        t0 = time.perf_counter()
        ids, logprobs, tail = scored(teacher, seqs)
        spent["score_s"] += time.perf_counter() - t0
        return seqs, ids, logprobs, tail

    held: dict = {}  # the round in memory: {"round": r, "tensors": [...]}

    def round_fn(step: int) -> tuple[torch.Tensor, ...]:
        r, at = divmod(step, cfg.round_steps)
        if held.get("round") != r:
            held["round"], held["tensors"] = r, _round(r, step)
        return tuple(t[at * share : (at + 1) * share].to(device) for t in held["tensors"])

    def _round(r: int, step: int) -> list[torch.Tensor]:
        """Round r's sequences and their teacher scores (this rank's), made now or read."""
        name = f"round-{r:05d}" + (f".rank{ranks.rank}" if ranks.world > 1 else "")
        path = run / f"{name}.safetensors"
        if not path.exists():
            if step != r * cfg.round_steps:
                raise RuntimeError(f"{path} is missing: a run resumed mid-round needs it")
            todo = min(cfg.round_steps, cfg.steps - step)
            seqs = [samples() for _ in range(todo)]
            t0 = time.perf_counter()
            teacher = load_teacher(teacher_dir, device, rows=share, length=length)
            try:
                parts = [scored(teacher, x) for x in seqs]
            finally:
                close_teacher(teacher)
                del teacher
                gc.collect()
                memory.release_freed()
            spent["score_s"] += time.perf_counter() - t0
            ids, logprobs, tail = (torch.cat(t) for t in zip(*parts, strict=True))
            tensors = {
                "tokens": torch.cat(seqs).cpu(),
                "ids": ids.to(torch.int32).cpu(),
                "logprobs": logprobs.cpu(),
                "tail": tail.cpu(),
                # the shared generator after the round's sampling: a run resumed at the
                # round's start that finds this file goes on from there
                "generator": gen.get_state(),
            }
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, path)
            spent["rounds"] += 1
            for old in run.glob(f"round-{r - 2:05d}*.safetensors"):  # two rounds are kept
                old.unlink()
        f = load_file(str(path))
        if step == r * cfg.round_steps:
            gen.set_state(f["generator"])
        return [f["tokens"], f["ids"], f["logprobs"], f["tail"]]

    def loss_fn(part: tuple[torch.Tensor, ...], forward) -> torch.Tensor:
        seqs, ids, logprobs, tail = part
        logits = forward(seqs, p)[:, p - 1 : -1]
        return reverse_kl_scored(logits, ids, logprobs, tail)

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
        batch_fn=round_fn if rounds else batch_fn,
        loss_fn=loss_fn,
        micro_batch=cfg.micro_batch,
        desc="opd",
        progress=progress,
        ranks=ranks,
    )
    spent["train_s"] = time.perf_counter() - t_loop - spent["sample_s"] - spent["score_s"]
    close_teacher(teacher)
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
        **{k: round(v, 1) if isinstance(v, float) else v for k, v in spent.items()},
    }
