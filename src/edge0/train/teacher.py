"""`edge0 train teacher OUT_DIR`: pre-train a small Qwen3-MoE from scratch on the stdlib corpus.

The result is a plain Hugging Face directory (config.json, bf16 model.safetensors with
per-expert keys, tokenizer with a chat template) that transformers loads and llama.cpp's
converter accepts. Training uses our own model code with resident float experts, the
next-token loss plus the Switch-style load-balancing loss (so experts do not collapse), AdamW,
warm-up and cosine decay. Interrupted runs resume from OUT_DIR/run/state.pt.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge0 import loader
from edge0.models import qwen3_moe
from edge0.models.base import Forward
from edge0.models.experts import ResidentExperts
from edge0.store.writer import StreamingSafetensors
from edge0.tokenizer import load_tokenizer
from edge0.tokenizer_train import train_bpe
from edge0.train import common
from edge0.train.data import load_texts

log = logging.getLogger(__name__)


@dataclass
class TeacherConfig:
    layers: int = 8
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 32
    top_k: int = 8
    expert_width: int = 128
    vocab: int = 8192
    seq_len: int = 256
    batch: int = 16
    steps: int = 2000
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    eval_every: int = 250
    save_every: int = 100
    eval_windows: int = 64
    seed: int = 0
    data: tuple[str, ...] = ("stdlib",)

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


def build_model(cfg: TeacherConfig) -> qwen3_moe.Model:
    mcfg = qwen3_moe.Config.from_dict(cfg.hf_config())
    model = loader.build(
        qwen3_moe,
        mcfg,
        lambda layer: ResidentExperts(
            mcfg.num_experts, mcfg.hidden_size, mcfg.moe_intermediate_size
        ),
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


def corpus_streams(out: Path, vocab: int, data: list[str]):
    """(tokenizer, {"train", "heldout" token streams and their hashes}); trains the
    tokenizer on the training text on first use."""
    train_docs, train_hash = load_texts(data, "train")
    if not (out / "tokenizer.json").exists():
        train_bpe(train_docs, vocab, out)
    tok = load_tokenizer(out)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cache = out / "run" / "tokens.pt"
    if cache.exists():
        return tok, torch.load(cache)
    held_docs, held_hash = load_texts(data, "heldout")
    streams = {
        "train": common.tokenize(train_docs, tok, eos),
        "heldout": common.tokenize(held_docs, tok, eos),
        "train_hash": train_hash,
        "heldout_hash": held_hash,
    }
    torch.save(streams, cache)
    return tok, streams


def train_teacher(out: Path, cfg: TeacherConfig, progress: bool = True) -> dict:
    out = Path(out)
    (out / "run").mkdir(parents=True, exist_ok=True)
    gen = common.seed_everything(cfg.seed)
    tok, streams = corpus_streams(out, cfg.vocab, list(cfg.data))
    if len(tok) > cfg.vocab:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than --vocab {cfg.vocab}")
    model = build_model(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    runlog = common.RunLog.resume(out / "run" / "log.json", common.config_dict(cfg))
    step = 0
    state = common.load_state(out / "run" / "state.pt")
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["gen"])
        step = state["step"]
        log.info("resuming teacher training at step %d", step)
    evals = common.fixed_windows(streams["heldout"], cfg.eval_windows, cfg.seq_len)
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="teacher", unit="step", disable=not progress)
    t0 = time.perf_counter()
    while step < cfg.steps:
        lr = common.cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = common.random_windows(streams["train"], cfg.batch, cfg.seq_len, gen)
        ce, aux = lm_loss(model, batch, cfg.aux_coef, cfg.top_k)
        loss = ce + cfg.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        entry = {
            "step": step,
            "loss": round(ce.item(), 4),
            "aux": round(aux.item(), 4),
            "lr": lr,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
        if step % cfg.eval_every == 0 or step == cfg.steps:
            entry["heldout_ppl"] = round(perplexity(model, evals), 3)
        runlog.add(**entry)
        bar.set_postfix(loss=f"{ce.item():.3f}", ppl=entry.get("heldout_ppl", ""))
        bar.update(1)
        if step % cfg.save_every == 0 or step == cfg.steps:
            common.save_state(out / "run" / "state.pt", step, model.state_dict(), opt, gen)
            runlog.save()
    bar.close()
    final_ppl = perplexity(model, evals)
    save_hf(model, cfg, out)
    summary = {
        "steps": step,
        "heldout_ppl": final_ppl,
        "train_tokens": step * cfg.batch * cfg.seq_len,
        "train_hash": streams["train_hash"],
        "heldout_hash": streams["heldout_hash"],
    }
    (out / "run" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


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
