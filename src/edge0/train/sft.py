"""Phase 2, `edge0 train sft MODEL_DIR --teacher DIR --data ...`: the LoRA on the student path.

1. Prompts are random windows of the training text; the full-precision teacher samples a
   continuation for each (cached in the run directory, with the data hash). With
   `source="corpus"` the sequences are instead random windows of the training text itself,
   `prompt_len + gen_len` tokens long, drawn afresh every step.
2. The student (dequantized int4 base, prerouter routing at the served K, LoRA) is trained
   with cross-entropy on the continuation tokens, or (`loss="kl"`) with KL to the teacher's
   whole distribution at each of them. The prompt is gate-routed and every continuation
   position is prediction-routed, exactly as the engine serves a request.
Heads come first (phase 1): the SFT signal would otherwise drown the heads' small gradients.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge0.engine.sampling import SamplingParams
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
    teacher_parts,
    train_lora,
)
from edge0.train.teacher_cache import TeacherCache, top_k_tail_kl

log = logging.getLogger(__name__)


@dataclass
class SFTConfig:
    top_k: int | None = None
    stage_width: int | None = None  # W > K: train on the path `--stage-width W` serves
    rank: int = 16
    alpha: float = 32.0
    # an adapter on each MoE router too (softmax-top-k families): it can re-weigh the experts
    # a layer runs and, at W > K, re-pick its K among the staged ones, which an attention
    # adapter cannot
    lora_routers: bool = False
    samples: int = 512
    prompt_len: int = 32
    gen_len: int = 96
    temperature: float = 1.0  # CE on T=1 samples estimates KL(teacher || student)
    # "ce": cross-entropy of the sampled tokens; "kl": KL(teacher || student) over the whole
    # vocabulary at each continuation position, the teacher scoring the same tokens (the
    # quantity CE estimates from one sample, without its variance)
    loss: str = "ce"
    # "teacher": the teacher's continuations of corpus prompts (a fixed set of `samples`);
    # "corpus": fresh windows of the corpus every step, so no sequence is seen twice and the
    # positions trained reach prompt_len + gen_len, as far as the text served does
    source: str = "teacher"
    gen_batch: int = 32
    # a teacher cache (train/teacher_cache.py): its windows, distilled on the teacher's
    # cached top-k + tail at each continuation position; no teacher is loaded
    teacher_cache: Path | None = None
    steps: int = 300
    batch: int = 8  # sequences per step over all ranks (the effective batch)
    micro_batch: int | None = None  # rows per forward of a rank's share (accumulated)
    lr: float = 1e-3
    save_every: int = 25
    seed: int = 0
    base: str = "auto"  # the student's base: int4 (CPU), dequantized, auto (student_base)
    process_budget: int | None = None  # bytes for the whole process (int4 base)
    checkpoint: bool = True  # int4 base: recompute each decoder layer in the backward pass
    fsdp: bool = False  # dequantized base under torchrun: shard it over the ranks (FSDP2)


def teacher_dataset(
    teacher_dir: Path,
    data: list[str],
    tokenizer,
    cfg: SFTConfig,
    gen: torch.Generator,
    device,
    progress: bool,
) -> tuple[torch.Tensor, str]:
    """[samples, prompt_len + gen_len] tokens: corpus prompts and teacher continuations."""
    stream, data_hash = common.token_stream(data, "train", tokenizer)
    prompts = common.random_windows(stream, cfg.samples, cfg.prompt_len - 1, gen)
    length = cfg.prompt_len + cfg.gen_len
    teacher = load_teacher(teacher_dir, device, rows=cfg.gen_batch, length=length)
    model, executors = teacher_parts(teacher)
    params = SamplingParams(temperature=cfg.temperature)
    out = []
    for i in tqdm(
        range(0, cfg.samples, cfg.gen_batch),
        desc="teacher samples",
        unit="batch",
        disable=not progress,
    ):
        out.append(
            sample(
                model,
                prompts[i : i + cfg.gen_batch].to(device),
                cfg.gen_len,
                params,
                gen,
                executors=executors,
            ).cpu()
        )
    close_teacher(teacher)
    tokens = torch.cat(out)
    digest = hashlib.sha256(data_hash.encode() + tokens.numpy().tobytes()).hexdigest()
    return tokens, digest


def continuation_loss(logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Mean CE of the continuation tokens (positions prompt_len..end) given their prefixes."""
    pred = logits[:, prompt_len - 1 : -1]
    return F.cross_entropy(
        pred.reshape(-1, pred.shape[-1]).float(), tokens[:, prompt_len:].reshape(-1)
    )


def forward_kl(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p || q), p = softmax(target) (teacher), q = softmax(logits)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    logp = torch.log_softmax(target.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def train_sft(
    model_dir: Path,
    teacher_dir: Path,
    data: list[str],
    out: Path,
    cfg: SFTConfig,
    heads: Path | None = None,
    progress: bool = True,
) -> dict:
    if cfg.loss not in ("ce", "kl"):
        raise ValueError(f"loss must be 'ce' or 'kl', got {cfg.loss!r}")
    if cfg.source not in ("teacher", "corpus"):
        raise ValueError(f"source must be 'teacher' or 'corpus', got {cfg.source!r}")
    model_dir, out = Path(model_dir), Path(out)
    run = out.with_name(out.name + ".run")
    run.mkdir(parents=True, exist_ok=True)
    device, base, ranks, share = placement(cfg.base, cfg.batch)
    progress = progress and ranks.main
    gen = common.seed_everything(cfg.seed)
    tok = load_tokenizer(model_dir)
    p, gen_len = cfg.prompt_len, cfg.gen_len
    stream = tokens = cache = None  # corpus windows are cut from `stream`; teacher samples are
    # `tokens`; a teacher cache's windows come with the teacher's top-k + tail
    if cfg.teacher_cache is not None:
        cache = TeacherCache(cfg.teacher_cache)
        cache.check(len(tok))
        p, gen_len, data_hash = cache.prompt_len, cache.gen_len, cache.meta["data_hash"]
    elif cfg.source == "corpus":
        stream, data_hash = common.token_stream(data, "train", tok)
    else:
        samples = run / "dataset.pt"
        if ranks.main and not samples.exists():  # rank 0 samples the teacher, the others wait
            tokens, digest = teacher_dataset(teacher_dir, data, tok, cfg, gen, device, progress)
            torch.save({"tokens": tokens, "data_hash": digest, "gen": gen.get_state()}, samples)
        ranks.barrier()
        dataset = torch.load(samples)
        tokens, data_hash = dataset["tokens"], dataset["data_hash"]
        if "gen" in dataset:  # every rank draws batches from where sampling left the generator
            gen.set_state(dataset["gen"])
    teacher = None  # first: an edge0 teacher's pool is then counted by the student's plan
    if cfg.loss == "kl" and cache is None:
        teacher = load_teacher(teacher_dir, device, rows=share, length=p + gen_len)
    student = load_student(
        model_dir,
        top_k=cfg.top_k,
        heads=heads,
        new_lora=(cfg.rank, cfg.alpha),
        seed=cfg.seed,
        device=device,
        stage_width=cfg.stage_width,
        lora_routers=cfg.lora_routers,
        base=base,
        options=base_options(cfg.process_budget, share, p + gen_len),
        shard=ranks if cfg.fsdp else None,
    )
    student.checkpoint = cfg.checkpoint
    student.model.train()

    def batch_fn(step: int) -> tuple[torch.Tensor, ...]:
        if cache is not None:  # [B] of the cache's windows, with the teacher's top-k + tail
            index = torch.randint(0, cache.windows, (cfg.batch,), generator=gen)
            return tuple(t.to(device) for t in cache.rows(ranks.share(index)))
        if tokens is None:  # [B, P + C] fresh corpus windows
            batch = common.random_windows(stream, cfg.batch, p + cfg.gen_len - 1, gen)
        else:
            batch = tokens[torch.randint(0, tokens.shape[0], (cfg.batch,), generator=gen)]
        return (ranks.share(batch).to(device),)  # every rank drew the same global batch

    def loss_fn(part: tuple[torch.Tensor, ...], forward) -> torch.Tensor:
        if cache is not None:
            batch, ids, logprobs, tail = part
            return top_k_tail_kl(forward(batch, p)[:, p - 1 : -1], ids, logprobs, tail)
        (batch,) = part
        logits = forward(batch, p)
        if teacher is None:
            return continuation_loss(logits, batch, p)
        with torch.no_grad():
            target = teacher(batch)[:, p - 1 : -1]
        return forward_kl(logits[:, p - 1 : -1], target)

    runlog = train_lora(
        student,
        run,
        common.config_dict(cfg),
        steps=cfg.steps,
        lr=cfg.lr,
        warmup=max(1, cfg.steps // 20),
        save_every=cfg.save_every,
        gen=gen,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        micro_batch=cfg.micro_batch,
        desc="sft",
        progress=progress,
        ranks=ranks,
    )
    meta = {
        "model": model_dir.name,
        "base_hash": student.base_hash,
        "phase": "2",
        "data_hash": data_hash,
        "K": str(student.top_k),
        "W": str(student.stage_width or student.top_k),
        "seed": str(cfg.seed),
        "loss": "top-k + tail KL (teacher cache)" if cache is not None else cfg.loss,
        "source": "teacher cache" if cache is not None else cfg.source,
        "student_base": base,
    }
    return {
        **finish(student, model_dir, out, meta, runlog, base, ranks),
        "samples": None if tokens is None else tokens.shape[0],
        "cache_windows": None if cache is None else cache.windows,
    }
