"""`edge0 train teacher OUT_DIR`: pre-train a small Qwen3-MoE from scratch on the stdlib corpus.

The result is a plain Hugging Face directory (config.json, bf16 model.safetensors with
per-expert keys, tokenizer with a chat template) that transformers loads and llama.cpp's
converter accepts. Training uses our own model code with resident float experts, the
next-token loss plus the Switch-style load-balancing loss (so experts do not collapse), AdamW,
warm-up and cosine decay over several passes of the corpus. Held-out perplexity is measured
after every pass; the run stops early when a pass no longer improves it, and the weights of
the best pass are the ones written. An interrupted run resumes bit-exactly from
OUT_DIR/run/state.pt (same command, same thread count): weights, optimizer, schedule, the
pass order of the data and the early-stopping record all continue where they were.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge0.formats.writer import StreamingSafetensors
from edge0.modeldir import loader
from edge0.models import qwen3_moe
from edge0.models.base import Forward
from edge0.models.experts import ResidentExperts
from edge0.text.tokenizer import load_tokenizer
from edge0.train import common, teacher_data
from edge0.train.passes import PassOrder

log = logging.getLogger(__name__)


@dataclass
class TeacherConfig:
    # shape
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 32
    top_k: int = 8
    expert_width: int = 128
    vocab: int = 8192
    # data and schedule: `passes` over the training stream, or exactly `steps` if set
    data: tuple[str, ...] = ("stdlib",)
    extra_train: tuple[str, ...] = ()  # train-only sources: "site-packages" or paths
    extra_chars: int = 0  # at most this many characters of them
    seq_len: int = 256
    batch: int = 8
    passes: int = 4
    steps: int | None = None
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    # early stopping: stop after `patience` passes whose clean held-out perplexity
    # (train/teacher_data.py) is not below the best so far by `min_improvement` (relative)
    patience: int = 1
    min_improvement: float = 0.0
    # held-out evaluation (edge0 eval's protocol: 64 windows of 256 tokens), also every
    # `eval_every` steps within a pass when > 0; checkpoints every `save_every` steps
    eval_windows: int = 64
    eval_seq_len: int = 256
    eval_every: int = 0
    save_every: int = 100
    seed: int = 0
    # speed (docs/training.md has the measurements behind the defaults)
    compile: bool = False
    autocast_bf16: bool = False

    def hf_config(self) -> dict:
        return qwen3_moe.hf_config(
            vocab=self.vocab,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            experts=self.experts,
            top_k=self.top_k,
            expert_width=self.expert_width,
            tie_word_embeddings=True,
            router_aux_loss_coef=self.aux_coef,
        )


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss, E * sum_e (fraction routed to e) * (mean prob of e)."""
    num_experts = logits[0].shape[-1]
    frac, prob = 0.0, 0.0
    for lg in logits:
        p = torch.softmax(lg.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        frac = frac + F.one_hot(chosen, num_experts).sum(1).float().mean(0)
        prob = prob + p.mean(0)
    return num_experts * (frac / len(logits) * prob / len(logits)).sum()


def build_model(cfg: TeacherConfig, experts: type[ResidentExperts] = ResidentExperts):
    """A freshly initialised teacher; `experts` is the module class of every MoE layer."""
    mcfg = qwen3_moe.Config.from_dict(cfg.hf_config())
    model = loader.build(
        qwen3_moe,
        mcfg,
        lambda layer: experts(mcfg.num_experts, mcfg.hidden_size, mcfg.moe_intermediate_size),
    )
    common.init_weights(model)
    return model


def lm_loss(model, batch: torch.Tensor, aux_coef: float, top_k: int):
    """Mean next-token cross-entropy and the load-balancing loss for one batch [B, L+1]."""
    logits_seen: list[torch.Tensor] = []
    fwd = Forward(observer=lambda layer, h, lg, idx: logits_seen.append(lg))
    out = model(batch[:, :-1], fwd)
    ce = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), batch[:, 1:].reshape(-1))
    aux = load_balancing_loss(logits_seen, top_k) if aux_coef else torch.zeros(())
    return ce, aux


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        out = model(w[:, :-1])
        total += F.cross_entropy(
            out.reshape(-1, out.shape[-1]).float(), w[:, 1:].reshape(-1), reduction="sum"
        ).item()
        n += w[:, 1:].numel()
    model.train()
    return float(torch.exp(torch.tensor(total / n)))


@dataclass
class Progress:
    """What a resumed run must know besides weights and optimizer: the early-stopping record
    and every pass's result."""

    best_ppl: float = float("inf")  # clean held-out perplexity of the best state
    best_heldout_ppl: float = float("inf")  # and its perplexity on the whole held-out split
    best_step: int = 0
    stale_passes: int = 0
    stopped_early: bool = False
    passes: list[dict] = field(default_factory=list)


class TrainStep:
    """One optimizer step: forward (optionally compiled, optionally under bf16 autocast),
    backward, gradient clipping, AdamW."""

    def __init__(self, model: qwen3_moe.Model, cfg: TeacherConfig):
        self.model, self.cfg = model, cfg
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        self.loss_fn = torch.compile(lm_loss) if cfg.compile else lm_loss

    def __call__(self, batch: torch.Tensor, lr: float) -> tuple[float, float]:
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = lr
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if cfg.autocast_bf16
            else contextlib.nullcontext()
        )
        with autocast:
            ce, aux = self.loss_fn(self.model, batch, cfg.aux_coef, cfg.top_k)
        loss = ce + cfg.aux_coef * aux
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return ce.item(), aux.item()


def train_teacher(
    out: Path, cfg: TeacherConfig, progress: bool = True, stop_at: int | None = None
) -> dict:
    """Train (or resume) the teacher in OUT; write the best pass's weights as a HF directory.

    `stop_at` ends this invocation after that global step, checkpointed, as an interruption
    would (re-running the same call continues); the summary then says `"finished": False`.
    """
    out = Path(out)
    (out / "run").mkdir(parents=True, exist_ok=True)
    common.seed_everything(cfg.seed)
    tok, data = teacher_data.load(
        out, cfg.vocab, list(cfg.data), list(cfg.extra_train), cfg.extra_chars
    )
    if len(tok) > cfg.vocab:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than --vocab {cfg.vocab}")
    order = PassOrder(data.train.numel(), cfg.seq_len, cfg.batch, cfg.seed)
    total = cfg.steps or cfg.passes * order.steps_per_pass
    model = build_model(cfg)
    train_step = TrainStep(model, cfg)
    runlog = common.RunLog.resume(out / "run" / "log.json", common.config_dict(cfg))
    state_path, best_path = out / "run" / "state.pt", out / "run" / "best.pt"
    step, prog = 0, Progress()
    state = common.load_state(state_path)
    if state is not None:
        model.load_state_dict(state["model"])
        train_step.opt.load_state_dict(state["optimizer"])
        step = state["step"]
        prog = Progress(**state["extra"]["progress"])
        if state["extra"].get("threads") != torch.get_num_threads():
            log.warning(
                "resuming with %d torch threads, the checkpoint was written with %s: the "
                "result will not be bit-identical to an uninterrupted run",
                torch.get_num_threads(),
                state["extra"].get("threads"),
            )
        runlog.entries = [e for e in runlog.entries if e["step"] <= step]
        log.info("resuming teacher training at step %d", step)
    clean = data.heldout_clean
    if clean.numel() <= cfg.eval_seq_len:
        log.warning(
            "every held-out document shares text with the training text: early stopping "
            "watches the whole held-out split"
        )
        clean = data.heldout
    windows = {
        name: common.fixed_windows(stream, cfg.eval_windows, cfg.eval_seq_len)
        for name, stream in (
            ("heldout", data.heldout),
            ("heldout_clean", clean),
            ("train", data.train),
        )
    }

    def checkpoint() -> None:
        runlog.save()  # first: entries past the checkpoint's step are dropped on resume
        extra = {"progress": vars(prog), "threads": torch.get_num_threads()}
        common.save_state(state_path, step, model.state_dict(), train_step.opt, None, extra)

    model.train()
    bar = tqdm(total=total, initial=step, desc="teacher", unit="step", disable=not progress)
    t0 = time.perf_counter()
    while step < total and not prog.stopped_early and step != stop_at:
        lr = common.cosine_lr(step, total, cfg.lr, cfg.warmup, cfg.min_lr)
        ce, aux = train_step(order.batch_at(data.train, step), lr)
        if not math.isfinite(ce):
            raise FloatingPointError(
                f"step {step + 1}: training loss is {ce}, the run diverged; lower --lr "
                f"(now {cfg.lr}) and start over in a new OUT_DIR"
            )
        step += 1
        entry = {
            "step": step,
            "loss": round(ce, 4),
            "aux": round(aux, 4),
            "lr": lr,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
        end_of_pass = step % order.steps_per_pass == 0
        if end_of_pass or (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
            for name in ("heldout", "heldout_clean"):
                entry[f"{name}_ppl"] = round(perplexity(model, windows[name]), 3)
        if end_of_pass:
            entry["train_ppl"] = round(perplexity(model, windows["train"]), 3)
            end_pass(prog, model, best_path, cfg, entry)
        elif step == total and entry["heldout_clean_ppl"] < prog.best_ppl:
            # the schedule ended inside a pass: its last state competes with the passes
            prog.best_ppl, prog.best_step = entry["heldout_clean_ppl"], step
            prog.best_heldout_ppl = entry["heldout_ppl"]
            save_weights(model, best_path)
        runlog.add(**entry)
        if "heldout_ppl" in entry:
            bar.set_postfix(
                loss=f"{ce:.3f}", ppl=entry["heldout_ppl"], clean=entry["heldout_clean_ppl"]
            )
        else:
            bar.set_postfix(loss=f"{ce:.3f}", refresh=False)
        bar.update(1)
        if step % cfg.save_every == 0 or end_of_pass or step in (total, stop_at):
            checkpoint()
    bar.close()
    if step < total and not prog.stopped_early:
        return {"finished": False, "steps": step, "passes": prog.passes}
    model.load_state_dict(torch.load(best_path))
    save_hf(model, cfg, out)
    summary = {
        "finished": True,
        "steps": step,
        "steps_per_pass": order.steps_per_pass,
        "best_step": prog.best_step,
        "stopped_early": prog.stopped_early,
        "heldout_ppl": prog.best_heldout_ppl,
        "heldout_clean_ppl": prog.best_ppl,
        "passes": prog.passes,
        "train_tokens": step * cfg.batch * cfg.seq_len,
        "data": data.info,
    }
    (out / "run" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def save_weights(model: torch.nn.Module, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)


def end_pass(
    prog: Progress, model: torch.nn.Module, best_path: Path, cfg: TeacherConfig, entry: dict
) -> None:
    """Record a finished pass; keep its weights if it is the best so far; decide stopping."""
    entry["pass"] = len(prog.passes) + 1
    record = {
        k: entry[k] for k in ("pass", "step", "heldout_ppl", "heldout_clean_ppl", "train_ppl")
    }
    prog.passes.append(record)
    log.info(
        "pass %(pass)d (step %(step)d): held-out ppl %(heldout_ppl).3f, clean "
        "%(heldout_clean_ppl).3f, train %(train_ppl).3f",
        record,
    )
    if record["heldout_clean_ppl"] < prog.best_ppl * (1 - cfg.min_improvement):
        prog.best_ppl, prog.best_step = record["heldout_clean_ppl"], record["step"]
        prog.best_heldout_ppl = record["heldout_ppl"]
        prog.stale_passes = 0
        save_weights(model, best_path)
    else:
        prog.stale_passes += 1
        prog.stopped_early = prog.stale_passes >= cfg.patience


def save_hf(model: qwen3_moe.Model, cfg: TeacherConfig, out: Path) -> None:
    """bf16 safetensors with transformers' per-expert key layout, config.json, generation config."""
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, p in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e in range(p.shape[0]):
                gate, up = p[e].chunk(2, dim=0)
                tensors += [
                    (f"{prefix}.{e}.gate_proj.weight", gate),
                    (f"{prefix}.{e}.up_proj.weight", up),
                ]
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            tensors += [(f"{prefix}.{e}.down_proj.weight", p[e]) for e in range(p.shape[0])]
        else:
            tensors.append((name, p))
    tensors.sort(key=lambda kv: kv[0])
    w = StreamingSafetensors(
        out / "model.safetensors",
        [(n, torch.bfloat16, tuple(t.shape)) for n, t in tensors],
        metadata={"format": "pt"},
    )
    for n, t in tensors:
        w.write(n, t.detach().to(torch.bfloat16).contiguous())
    w.close()
    (out / "config.json").write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
    tok = load_tokenizer(out)
    gen_cfg = {
        "eos_token_id": [
            tok.convert_tokens_to_ids("<|im_end|>"),
            tok.convert_tokens_to_ids("<|endoftext|>"),
        ],
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.95,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
