"""Phase 1, `edge0 train heads MODEL_DIR --data ... --out FILE`: distill the prerouter heads.

The served model (dequantized int4 experts, served K) runs over the corpus with its own
routers. For every owner layer N and token t we keep the head input (N's MoE input, the
experts N executed at t and at t-1) and the target: the router logits of the consumer layer
at token t+1. Heads are the only trainable parameters; the loss is the cross-entropy of the
head's expert distribution against the consumer router's softmax (KL up to a constant), so a
head learns to imitate the next layer's router, not to fit text.

Reported per layer on held-out text: top-K recall |topK(head) ∩ topK(router)| / K, for the
trained heads and for the warm start (the consumer's router applied to the owner's state).
Shape legend: N tokens, D hidden, E experts, K served experts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge0 import loader, modeldir
from edge0.models.base import Forward
from edge0.plan import resolve_top_k
from edge0.prerouter.head import DEFAULT_WIDTH, Prerouter, Wiring, features
from edge0.routing import topk_onehot
from edge0.tokenizer import load_tokenizer
from edge0.train import common
from edge0.train.data import load_texts

log = logging.getLogger(__name__)


@dataclass
class HeadsConfig:
    top_k: int | None = None  # served K (default: native)
    width: int = DEFAULT_WIDTH
    start_layer: int | None = None
    train_tokens: int = 60_000
    heldout_tokens: int = 16_000
    seq_len: int = 256
    epochs: int = 6
    batch: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0


@torch.no_grad()
def collect(model, windows: torch.Tensor, wiring: Wiring, num_experts: int, progress: bool):
    """Head inputs per owner [N, D+2E] (fp16) and consumer router logits per consumer [N, E]."""
    feats = {o: [] for o in wiring.owners}
    targets = {c: [] for c in wiring.consumers}
    seen: dict[int, tuple] = {}

    def observe(layer, h, lg, idx):
        seen[layer] = (h, lg, idx)

    for w in tqdm(windows, desc="routing features", unit="window", disable=not progress):
        seen.clear()
        model.hidden(w[None], Forward(observer=observe))
        for o in wiring.owners:
            h, _, idx = seen[o]
            executed = topk_onehot(idx, num_experts)
            previous = torch.cat([torch.zeros(1, num_experts), executed[:-1]])
            feats[o].append(features(h, executed, previous)[:-1].half())  # positions 0..L-2
        for c in wiring.consumers:
            targets[c].append(seen[c][1][1:].float())  # router logits at positions 1..L-1
    return (
        {o: torch.cat(v) for o, v in feats.items()},
        {c: torch.cat(v) for c, v in targets.items()},
    )


def recall(pred: torch.Tensor, target: torch.Tensor, k: int) -> float:
    p = torch.topk(pred, k, dim=-1).indices
    t = torch.topk(target, k, dim=-1).indices
    hits = (p[:, :, None] == t[:, None, :]).any(-1).float().sum(-1)
    return float(hits.mean() / k)


def evaluate(pre: Prerouter, feats, targets, k: int) -> dict[int, float]:
    with torch.no_grad():
        return {
            c: recall(pre.head(o)(feats[o].float()), targets[c], k)
            for c, o in pre.wiring.owner_of.items()
        }


def train_heads(
    model_dir: Path, data: list[str], out: Path, cfg: HeadsConfig, progress: bool = True
) -> dict:
    model_dir, out = Path(model_dir), Path(out)
    run = out.with_name(out.name + ".run")
    run.mkdir(parents=True, exist_ok=True)
    gen = common.seed_everything(cfg.seed)
    manifest, model = loader.load_edge0_model(model_dir, experts="dequantized")
    mcfg = model.config
    k = resolve_top_k(cfg.top_k, manifest.served_top_k, manifest.native_top_k)
    model.set_top_k(k)
    wiring = Wiring.default(model.moe_layers, cfg.start_layer)
    tok = load_tokenizer(model_dir)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0

    cache = run / "features.pt"
    if cache.exists():
        data_state = torch.load(cache)
    else:
        train_docs, train_hash = load_texts(data, "train")
        stream = common.tokenize(train_docs, tok, eos)
        try:
            held_docs, held_hash = load_texts(data, "heldout")
            held = common.tokenize(held_docs, tok, eos)
        except ValueError:  # too few files for a held-out share: hold out the stream's tail
            cut = int(stream.numel() * 0.9)
            stream, held, held_hash = stream[:cut], stream[cut:], train_hash + ":tail"
        n_train = max(1, cfg.train_tokens // cfg.seq_len)
        n_held = max(1, cfg.heldout_tokens // cfg.seq_len)
        train_w = common.random_windows(stream, n_train, cfg.seq_len - 1, gen)
        held_w = common.fixed_windows(held, n_held, cfg.seq_len - 1)
        data_state = {
            "train": collect(model, train_w, wiring, mcfg.num_experts, progress),
            "heldout": collect(model, held_w, wiring, mcfg.num_experts, progress),
            "data_hash": hashlib.sha256(f"{train_hash}|{held_hash}".encode()).hexdigest(),
        }
        torch.save(data_state, cache)
    (tr_f, tr_t), (he_f, he_t) = data_state["train"], data_state["heldout"]

    pre = Prerouter(wiring, mcfg.hidden_size, mcfg.num_experts, cfg.width)
    routers = {c: model.moe_block(c).gate.weight.detach() for c in wiring.consumers}
    pre.warm_start(routers, seed=cfg.seed)
    warm = evaluate(pre, he_f, he_t, k)
    opt = torch.optim.AdamW(pre.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    runlog = common.RunLog.resume(run / "log.json", common.config_dict(cfg))
    epoch = 0
    state = common.load_state(run / "state.pt")
    if state is not None:
        pre.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["gen"])
        epoch = state["step"]
    n = next(iter(tr_f.values())).shape[0]
    steps_per_epoch = (n + cfg.batch - 1) // cfg.batch
    total = cfg.epochs * steps_per_epoch
    bar = tqdm(
        total=total,
        initial=epoch * steps_per_epoch,
        desc="heads",
        unit="step",
        disable=not progress,
    )
    t0 = time.perf_counter()
    while epoch < cfg.epochs:
        order = torch.randperm(n, generator=gen)
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            for group in opt.param_groups:
                group["lr"] = common.cosine_lr(
                    step, total, cfg.lr, steps_per_epoch // 2 + 1, cfg.lr / 10
                )
            idx = order[s * cfg.batch : (s + 1) * cfg.batch]
            loss = 0.0
            for c, o in wiring.owner_of.items():
                logp = F.log_softmax(pre.head(o)(tr_f[o][idx].float()), dim=-1)
                target = torch.softmax(tr_t[c][idx], dim=-1)
                loss = loss + -(target * logp).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item() / len(wiring.owner_of):.4f}")
        epoch += 1
        held = evaluate(pre, he_f, he_t, k)
        runlog.add(
            epoch=epoch,
            loss=round(loss.item() / len(wiring.owner_of), 5),
            heldout_recall={str(c): round(r, 4) for c, r in held.items()},
            elapsed_s=round(time.perf_counter() - t0, 1),
        )
        runlog.save()
        common.save_state(run / "state.pt", epoch, pre.state_dict(), opt, gen)
    bar.close()
    trained = evaluate(pre, he_f, he_t, k)
    meta = {
        "model": model_dir.name,
        "base_hash": modeldir.base_hash(model_dir),
        "K": str(k),
        "data_hash": data_state["data_hash"],
        "phase": "1",
        "seed": str(cfg.seed),
    }
    pre.save(out, meta)
    report = {
        "K": k,
        "consumers": wiring.consumers,
        "warm_start_recall": {str(c): warm[c] for c in wiring.consumers},
        "trained_recall": {str(c): trained[c] for c in wiring.consumers},
        "train_tokens": n,
        "heldout_tokens": next(iter(he_f.values())).shape[0],
    }
    (run / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
