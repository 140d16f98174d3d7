"""Phase 1, `edge0 train heads MODEL_DIR --data ... --out FILE`: distill the prerouter heads.

The served model runs over the corpus the way a prefill serves it (int4 experts read from the
pool within `--memory-budget`, served K, each layer's own router; Engine.route). For every
owner layer N and token t we keep the head input (N's MoE input, the experts N executed at t
and at t-1) and the target: the router logits of the consumer layer at token t+1. They go to
files in the run folder, mapped rather than held, so neither the model's experts nor the
data have to fit in memory. Heads are the only trainable parameters; the loss is the
cross-entropy of the head's expert distribution against the consumer router's softmax (KL up
to a constant), so a head learns to imitate the next layer's router, not to fit text.

Reported per layer on held-out text: top-K recall |topK(head) ∩ topK(router)| / K, for the
trained heads and for the warm start (the consumer's router applied to the owner's state).

Under torchrun (`torchrun --nproc_per_node N -m edge0 train heads ...`, train/distributed.py)
every rank draws the same windows and routes its own contiguous share of them (the windows
are rounded up to a multiple of N), into its own files under `RUN/rank<r>/`. Each step every
rank takes batch / N rows of its own data, and DDP averages the heads' gradients: the
effective batch is `--batch`. Held-out recall is summed over the ranks' shares. Rank 0 writes
the checkpoints (with every rank's order generator) and the heads; every rank resumes from
them.
Shape legend: N tokens, D hidden, E experts, K served experts, B windows, T window length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from edge0 import modeldir
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.models.base import Forward
from edge0.models.routing import topk_onehot
from edge0.prerouter.head import DEFAULT_WIDTH, Prerouter, Wiring, features
from edge0.text.tokenizer import load_tokenizer
from edge0.train import common, distributed
from edge0.util import memory

log = logging.getLogger(__name__)


@dataclass
class HeadsConfig:
    top_k: int | None = None  # served K (default: native)
    width: int = DEFAULT_WIDTH
    start_layer: int | None = None
    train_tokens: int = 60_000
    heldout_tokens: int = 16_000
    seq_len: int = 256
    # windows per routing forward: one read (and, for busy experts, one dequantization) of a
    # layer's experts serves them all; fewer where a forward's working memory must be small
    windows_per_forward: int = 16
    memory_budget: int | None = None  # bytes for the model while collecting (default: the plan's)
    process_budget: int | None = None  # bytes for the whole process instead (--memory-budget)
    epochs: int = 6
    batch: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0


class Features:
    """Head inputs per owner [N, D+2E] (fp16) and consumer router logits per consumer [N, E]
    (fp32), in files under `folder` mapped into memory (file-backed pages, not anonymous
    ones). `rows` fixes N; mode "w+" creates the files, "c" maps finished ones (never
    written back)."""

    def __init__(self, folder: Path, wiring: Wiring, rows: int, d: int, e: int, mode: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.rows = rows
        self._maps: list[np.memmap] = []

        def mapped(name: str, width: int, dtype) -> torch.Tensor:
            m = np.memmap(folder / name, dtype, mode, shape=(rows, width))
            self._maps.append(m)
            return torch.from_numpy(m)

        self.feats = {o: mapped(f"features-{o}.f16", d + 2 * e, np.float16) for o in wiring.owners}
        self.targets = {c: mapped(f"targets-{c}.f32", e, np.float32) for c in wiring.consumers}

    def flush(self) -> None:
        """Write what was collected to the files."""
        for m in self._maps:
            m.flush()


@torch.no_grad()
@torch.inference_mode()
def route(engine, windows: torch.Tensor, observer) -> None:
    """Run token windows [B, T] through the engine's model as a prefill does (int4 experts
    from its pool, each layer's own router, nothing cached) so that `observer(layer, h,
    logits, indices)` sees every MoE layer's routing: the routing served, within the memory
    the plan allows."""
    with engine.whole_layers(windows.numel()) as executors:
        engine.model.hidden(windows, Forward(observer=observer, executors=executors))


def collect(
    engine,
    windows: torch.Tensor,
    wiring: Wiring,
    folder: Path,
    progress: bool,
    desc: str,
    per_forward: int,
) -> Features:
    """Route `windows` [n, T] through the engine, `per_forward` at a time, into
    Features: positions 0..T-2 of each window as head inputs, 1..T-1 as targets. Each layer's
    rows are written as the layer's routing is seen, so no layer's state is kept."""
    n, t = windows.shape
    e, d = engine.config.num_experts, engine.config.hidden_size
    out = Features(folder, wiring, n * (t - 1), d, e, "w+")
    owners, consumers = set(wiring.owners), set(wiring.consumers)
    at, b = 0, 0

    def observe(layer, h, logits, idx):
        rows = slice(at, at + b * (t - 1))
        if layer in owners:
            executed = topk_onehot(idx, e).view(b, t, e)
            previous = torch.cat([torch.zeros(b, 1, e), executed[:, :-1]], dim=1)
            x = features(h.view(b, t, d), executed, previous)[:, :-1]
            out.feats[layer][rows] = x.reshape(-1, x.shape[-1]).half()
        if layer in consumers:
            out.targets[layer][rows] = logits.view(b, t, e)[:, 1:].reshape(-1, e).float()

    for start in tqdm(range(0, n, per_forward), desc=desc, unit="forward", disable=not progress):
        batch = windows[start : start + per_forward]
        b = batch.shape[0]
        route(engine, batch, observe)
        at += b * (t - 1)
        # written back now: clean pages can be dropped under a memory cap, dirty ones not
        out.flush()
        memory.release_freed()
    return out


def local_order(n: int, gen: torch.Generator, chunk: int = 1024, group: int = 8) -> torch.Tensor:
    """An epoch's order of n rows that visits the mapped files a few chunks at a time: chunks
    of `chunk` consecutive rows in random order, each `group` of them shuffled together.

    A full permutation touches the files' pages at random; where the page cache cannot hold
    the files (training under a memory cap) that re-reads a page for nearly every row. Here
    a group's pages (~0.5 GB on the bench shape) are read once an epoch, in file order.
    """
    chunks = torch.randperm((n + chunk - 1) // chunk, generator=gen).tolist()
    parts = []
    for g in range(0, len(chunks), group):
        rows = torch.cat(
            [torch.arange(c * chunk, min(n, (c + 1) * chunk)) for c in chunks[g : g + group]]
        )
        parts.append(rows[torch.randperm(len(rows), generator=gen)])
    return torch.cat(parts)


def recall(pred: torch.Tensor, target: torch.Tensor, k: int) -> float:
    p = torch.topk(pred, k, dim=-1).indices
    t = torch.topk(target, k, dim=-1).indices
    hits = (p[:, :, None] == t[:, None, :]).any(-1).float().sum(-1)
    return float(hits.mean() / k)


def evaluate(
    pre: Prerouter,
    data: Features,
    k: int,
    chunk: int = 4096,
    ranks: distributed.Ranks | None = None,
) -> dict[int, float]:
    """Held-out top-K recall per consumer, `chunk` rows at a time (over every rank's share
    of the held-out rows where there are several ranks)."""
    hits = dict.fromkeys(pre.wiring.consumers, 0.0)
    with torch.no_grad():
        for i in range(0, data.rows, chunk):
            for c, o in pre.wiring.owner_of.items():
                pred = pre.head(o)(data.feats[o][i : i + chunk].float())
                target = data.targets[c][i : i + chunk]
                hits[c] += recall(pred, target, k) * pred.shape[0]
    consumers = list(hits)
    totals = torch.tensor([hits[c] for c in consumers] + [data.rows], dtype=torch.float64)
    totals = distributed.total(totals, ranks or distributed.Ranks())
    return {c: float(totals[i] / totals[-1]) for i, c in enumerate(consumers)}


def train_heads(
    model_dir: Path, data: list[str], out: Path, cfg: HeadsConfig, progress: bool = True
) -> dict:
    model_dir, out = Path(model_dir), Path(out)
    ranks = distributed.join("cpu")
    if cfg.batch % ranks.world:
        raise ValueError(f"--batch ({cfg.batch}) must be a multiple of the ranks ({ranks.world})")
    progress = progress and ranks.main
    run = out.with_name(out.name + ".run")
    run.mkdir(parents=True, exist_ok=True)
    options = EngineOptions(
        top_k=cfg.top_k,
        memory_budget=cfg.memory_budget,
        process_budget=cfg.process_budget,
        max_context=cfg.seq_len,
        # a routing forward is windows_per_forward windows of seq_len tokens: planned as that
        # many fresh prompts prefilled together (with their state, which routing does not
        # keep: an overestimate), so its working memory is inside the budget
        max_active=cfg.windows_per_forward,
        no_prerouter=True,
        no_lora=True,
    )
    with memory.PeakSampler(interval_s=0.1) as peaks:
        engine = load_engine(model_dir, options)
        try:
            k, config, plan = engine.top_k, engine.config, engine.plan
            wiring = Wiring.default(engine.model.moe_layers, cfg.start_layer)
            train, heldout, data_hash = _collected(engine, data, run, wiring, cfg, progress, ranks)
            # the warm start's weights; the model and its pool are not needed to train
            routers = {
                c: engine.model.moe_block(c).gate.weight.detach().clone() for c in wiring.consumers
            }
        finally:
            engine.close()
            del engine
        pre, report = _train(train, heldout, routers, wiring, k, config, cfg, run, progress, ranks)
        meta = {
            "model": model_dir.name,
            "base_hash": modeldir.base_hash(model_dir),
            "K": str(k),
            "data_hash": data_hash,
            "phase": "1",
            "seed": str(cfg.seed),
        }
        if ranks.main:
            pre.save(out, meta)
            modeldir.record_file(model_dir, out)  # edge0.json records the new bytes
        ranks.barrier()
    report["pool_bytes"], report["experts_bytes"] = plan.pool_bytes, plan.experts_bytes
    report["peak_anon_bytes"], report["peak_file_bytes"] = peaks.peak_anon, peaks.peak_file
    report["ranks"] = ranks.world
    if ranks.main:
        (run / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _collected(
    engine,
    data: list[str],
    run: Path,
    wiring: Wiring,
    cfg: HeadsConfig,
    progress: bool,
    ranks: distributed.Ranks,
) -> tuple[Features, Features, str]:
    """(train, held-out, data hash): collected now, or mapped from an earlier run of the same
    data and settings (features.json is written once both are complete). On several ranks,
    this rank's share of the windows, in RUN/rank<r>/."""
    e, d = engine.config.num_experts, engine.config.hidden_size
    if ranks.world > 1:
        run = run / f"rank{ranks.rank}"
        run.mkdir(exist_ok=True)
    done = run / "features.json"
    settings = {
        "data": list(data),
        "K": engine.top_k,
        "owners": wiring.owners,
        "train_tokens": cfg.train_tokens,
        "heldout_tokens": cfg.heldout_tokens,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "ranks": ranks.world,
    }
    if done.exists():
        record = json.loads(done.read_text())
        if record["settings"] == settings:
            return (
                Features(run / "train", wiring, record["train_rows"], d, e, "c"),
                Features(run / "heldout", wiring, record["heldout_rows"], d, e, "c"),
                record["data_hash"],
            )
        done.unlink()
    gen = common.seed_everything(cfg.seed)
    tok = load_tokenizer(engine.path)
    stream, train_hash = common.token_stream(data, "train", tok)
    try:
        held, held_hash = common.token_stream(data, "heldout", tok)
    except ValueError:  # too few files for a held-out share: hold out the stream's tail
        cut = int(stream.numel() * 0.9)
        stream, held, held_hash = stream[:cut], stream[cut:], train_hash + ":tail"
    # windows of seq_len tokens give seq_len - 1 rows each: enough of them for at least the
    # tokens asked for (the shipped heads' 1 M once gave 996,030)
    # (a multiple of the ranks, which each route an equal share)
    n_train = _windows(cfg.train_tokens, cfg.seq_len, ranks.world)
    n_held = _windows(cfg.heldout_tokens, cfg.seq_len, ranks.world)
    train_w = ranks.share(common.random_windows(stream, n_train, cfg.seq_len - 1, gen))
    held_w = ranks.share(common.fixed_windows(held, n_held, cfg.seq_len - 1))
    per = cfg.windows_per_forward
    train = collect(engine, train_w, wiring, run / "train", progress, "routing features", per)
    heldout = collect(engine, held_w, wiring, run / "heldout", progress, "held-out features", per)
    digest = hashlib.sha256(f"{train_hash}|{held_hash}".encode()).hexdigest()
    record = {
        "settings": settings,
        "train_rows": train.rows,
        "heldout_rows": heldout.rows,
        "data_hash": digest,
    }
    done.write_text(json.dumps(record, indent=2) + "\n")
    return train, heldout, digest


def _windows(tokens: int, seq_len: int, world: int) -> int:
    """Windows of seq_len tokens for at least `tokens` rows, rounded up to a multiple of the
    ranks."""
    n = max(1, math.ceil(tokens / (seq_len - 1)))
    return math.ceil(n / world) * world


def _train(
    train: Features,
    heldout: Features,
    routers: dict[int, torch.Tensor],
    wiring: Wiring,
    k: int,
    mcfg,
    cfg: HeadsConfig,
    run: Path,
    progress: bool,
    ranks: distributed.Ranks,
) -> tuple[Prerouter, dict]:
    """Train the heads on collected data: the trained heads and the recall report. On
    several ranks each takes its share of every batch from its own data (whose row count is
    every rank's: equal shares of windows of one length)."""
    # seeded again: a run that maps earlier features trains exactly as a fresh one
    gen = common.seed_everything(cfg.seed)
    if ranks.rank:  # each rank orders its own rows
        gen.manual_seed(cfg.seed + 7919 * ranks.rank)
    pre = Prerouter(wiring, mcfg.hidden_size, mcfg.num_experts, cfg.width)
    pre.warm_start(routers, seed=cfg.seed)
    warm = evaluate(pre, heldout, k, ranks=ranks)
    params = list(pre.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    runlog = common.RunLog.resume(
        run / "log.json", {**common.config_dict(cfg), "ranks": ranks.world}
    )
    epoch = 0
    state = common.load_state(run / "state.pt")
    if state is not None:
        gens = state["extra"].get("gens", [state["gen"]])
        if len(gens) != ranks.world:
            raise ValueError(
                f"{run / 'state.pt'} was written by a run of {len(gens)} rank(s), not "
                f"{ranks.world}: resume it with as many, or remove {run} to start again"
            )
        pre.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(gens[ranks.rank])
        epoch = state["step"]

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        loss = 0.0
        for c, o in wiring.owner_of.items():
            logp = F.log_softmax(pre.head(o)(train.feats[o][idx].float()), dim=-1)
            target = torch.softmax(train.targets[c][idx], dim=-1)
            loss = loss + -(target * logp).sum(-1).mean()
        return loss

    forward = distributed.wrap(params, batch_loss, ranks)  # DDP averages the gradients
    n = train.rows
    share = cfg.batch // ranks.world
    steps_per_epoch = (n + share - 1) // share
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
        order = local_order(n, gen)
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            for group in opt.param_groups:
                group["lr"] = common.cosine_lr(
                    step, total, cfg.lr, steps_per_epoch // 2 + 1, cfg.lr / 10
                )
            loss = forward(order[s * share : (s + 1) * share])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item() / len(wiring.owner_of):.4f}")
        epoch += 1
        held = evaluate(pre, heldout, k, ranks=ranks)
        value = distributed.mean(loss.detach(), ranks) / len(wiring.owner_of)
        runlog.add(
            epoch=epoch,
            loss=round(value, 5),
            heldout_recall={str(c): round(r, 4) for c, r in held.items()},
            elapsed_s=round(time.perf_counter() - t0, 1),
        )
        gens = distributed.gather(gen.get_state(), ranks)
        if ranks.main:
            runlog.save()
            common.save_state(
                run / "state.pt", epoch, pre.state_dict(), opt, gen, extra={"gens": gens}
            )
        ranks.barrier()  # no rank runs ahead of a checkpoint it could resume from
    bar.close()
    trained = evaluate(pre, heldout, k, ranks=ranks)
    report = {
        "K": k,
        "consumers": wiring.consumers,
        "warm_start_recall": {str(c): warm[c] for c in wiring.consumers},
        "trained_recall": {str(c): trained[c] for c in wiring.consumers},
        "train_tokens": n,
        "heldout_tokens": heldout.rows,
    }
    return pre, report
