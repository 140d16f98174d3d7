"""The models phases 2 and 3 train and compare, and batched sampling from them.

  teacher   the full-precision Hugging Face model, native K, gate routing
  student   the served model: the int4 base (frozen), prerouter routing at the served K
            (frozen heads), and the recovery LoRA (the only trainable parameters)

The student's base is one of two (`base`):
  int4         as the engine serves it: resident int4 projections, experts streamed from
               the engine's pool within its memory budget and computed by the int4 kernels
               (train/int4_base.py), each decoder layer checkpointed. Memory is the floor,
               the pool and one layer's activations. The CPU's kernels: CPU only.
  dequantized  every int4 weight dequantized to fp32 and held in memory (all experts too),
               on the GPU when there is one (`common.device_for`)
Shape legend: B batch, P prompt length, C continuation length, V vocab.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from edge0 import modeldir
from edge0.engine import decode
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.plan import resolve_top_k
from edge0.engine.sampling import Sampler, SamplingParams
from edge0.modeldir import loader
from edge0.models import lora
from edge0.models.base import Forward
from edge0.prerouter.head import Prerouter
from edge0.prerouter.runtime import PrerouterRuntime
from edge0.prerouter.student import TeacherForcedRouting, prediction_mask
from edge0.train import common, distributed, int4_base
from edge0.util import memory

BASES = ("int4", "dequantized")


@dataclass
class Student:
    model: torch.nn.Module
    prerouter: Prerouter | None
    top_k: int
    family: object
    base_hash: str
    stage_width: int | None = None  # W > K: consumers route among the W staged (eval arms)
    engine: object | None = None  # the int4 base's engine (its pool); None: dequantized
    checkpoint: bool = True  # int4 base: recompute each decoder layer in the backward pass

    @property
    def executors(self) -> dict | None:
        """Where each MoE layer's experts come from: the int4 base's pool, or the model."""
        return None if self.engine is None else int4_base.executors(self.engine)

    def forward(self, tokens: torch.Tensor, first_predicted: int | torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, V], prediction-routed from `first_predicted` on."""
        b, t = tokens.shape
        if self.prerouter is None:
            fwd = Forward()
        else:
            mask = prediction_mask(b, t, first_predicted).to(tokens.device)
            blocks = None
            if self.stage_width is not None:
                blocks = {c: self.model.moe_block(c) for c in self.prerouter.wiring.consumers}
            fwd = TeacherForcedRouting(
                self.prerouter, mask, stage_width=self.stage_width, blocks=blocks
            )
        if self.engine is not None:
            fwd.executors = self.executors
            if self.checkpoint:
                fwd.layers = int4_base.checkpointed_layers(self.model)
        return self.model(tokens, fwd)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def runtime(self) -> PrerouterRuntime | None:
        if self.prerouter is None:
            return None
        return PrerouterRuntime(self.prerouter, self.model, None, stage_width=self.stage_width)


def student_base(base: str, device: torch.device) -> str:
    """`base` with "auto" settled: the int4 base on the CPU, the dequantized one on a GPU
    (the int4 kernels are the CPU's)."""
    if base == "auto":
        return "int4" if device.type == "cpu" else "dequantized"
    return base


def placement(base: str, batch: int) -> tuple[torch.device, str, distributed.Ranks, int]:
    """Where phase 2 or 3 runs: (the device, the student's base with "auto" settled, this
    process's rank under torchrun, its rows of each global batch of `batch`)."""
    device = common.device_for()
    base = student_base(base, device)
    if base == "int4":
        device = torch.device("cpu")
    ranks = distributed.join(device.type)
    share = ranks.share(torch.empty(batch)).shape[0]
    return distributed.device(ranks, device), base, ranks, share


def base_options(
    process_budget: int | None, rows: int, length: int, dtype=torch.float32
) -> EngineOptions:
    """The int4 base's engine plan for training forwards of `rows` sequences of `length`
    tokens, within `process_budget` bytes for the whole process if given."""
    return EngineOptions(
        process_budget=process_budget,
        max_context=length,
        max_active=rows,
        dtype=dtype,
        prefix_cache=0,
    )


class EngineTeacher:
    """A teacher served by edge0 from its own model directory (`edge0 convert` of it): the
    native K through its own routers, resident weights and experts as converted (int4, or
    the checkpoint's bf16 weights with `edge0 convert --experts bf16`: a teacher without
    int4's error) read through a pool of every expert where they fit in a quarter of the
    free memory, else of what does, at least `pool_layers` layers' experts (a whole-layer
    forward needs one; the second lets the next layer's reads start), or `expert_cache`
    bytes. Called as the HF teacher is: tokens [B, T] -> logits [B, T, V]. Its pool is
    filled at load, so that a student's plan made after it counts it."""

    def __init__(
        self,
        path: Path,
        rows: int,
        length: int,
        pool_layers: int = 2,
        expert_cache: int | None = None,
    ):
        manifest = modeldir.Manifest.load(path)
        experts = manifest.experts
        layer = experts["num_experts"] * experts["extent_bytes"]
        every = layer * max(pool_layers, len(experts.get("layers", {})))
        # as serving without a budget: every expert where they fit in a quarter of what the
        # process may still take, so that sampling from it reads each expert once (a batched
        # decode step routes to nearly every expert of a layer: with two layers' experts
        # pooled, sampling sft's default 512 continuations from the bench shape re-read
        # 2.6 GiB a step, 4 TB in all); never fewer than `pool_layers` layers' experts
        if expert_cache is None:
            room = memory.MachineMemory.now().available // 4
            expert_cache = max(pool_layers * layer, min(every, room))
        options = EngineOptions(
            top_k=manifest.native_top_k,
            expert_cache=expert_cache,
            max_context=length,
            max_active=rows,
            no_prerouter=True,
            no_lora=True,
            prefix_cache=0,
            preload=False,
            int4_activations="bf16",  # the exact option: the teacher as near its model as edge0 is
        )
        self.engine = load_engine(path, options)
        self.model = self.engine.model
        self._fill_pool()

    @property
    def executors(self) -> dict:
        return int4_base.executors(self.engine)

    def _fill_pool(self) -> None:
        n = self.engine.config.num_experts
        for layer in self.engine.moe_layers:
            if self.engine.pool.available() < n:
                break
            entries = self.engine.pool.request(layer, list(range(n)))
            self.engine.pool.wait(entries)
            self.engine.pool.release(entries)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, Forward(executors=self.executors))

    def close(self) -> None:
        self.engine.close()


def load_teacher(
    path: Path | str,
    device: torch.device | None = None,
    rows: int = 8,
    length: int = 4096,
):
    """The teacher: a Hugging Face directory (full precision, in memory, on `device`), or an
    edge0 model directory, served by edge0 on the CPU within a small pool (EngineTeacher,
    planned for forwards of `rows` sequences of `length` tokens)."""
    path = Path(path)
    if (path / modeldir.MANIFEST).exists():
        return EngineTeacher(path, rows, length)
    model = loader.load_hf_model(path)
    model.requires_grad_(False)
    return model.to(device or "cpu")


def close_teacher(teacher) -> None:
    """Let go of what load_teacher returned (or None): an edge0-served teacher's engine is
    closed (its pool and I/O threads); a Hugging Face model goes with its last reference."""
    if isinstance(teacher, EngineTeacher):
        teacher.close()


def teacher_parts(teacher) -> tuple[torch.nn.Module, dict | None]:
    """(the teacher's model, where its experts come from) for sampling from it."""
    if isinstance(teacher, EngineTeacher):
        return teacher.model, teacher.executors
    return teacher, None


def load_student(
    model_dir: Path | str,
    *,
    top_k: int | None = None,
    heads: Path | None | bool = None,
    lora_file: Path | None = None,
    new_lora: tuple[int, float] | None = None,
    seed: int = 0,
    device: torch.device | None = None,
    stage_width: int | None = None,
    lora_routers: bool = False,
    base: str = "dequantized",
    options: EngineOptions | None = None,
    shard: distributed.Ranks | None = None,
) -> Student:
    """The served model for training/eval. heads: a file, None (MODEL_DIR/prerouter.safetensors
    if present) or False (gate routing). lora_file loads an adapter; new_lora=(r, alpha)
    attaches a fresh one to every family LORA_TARGET, and with lora_routers to every MoE
    router that is a plain Linear as well. stage_width W > K: each consumer's router picks
    its K among the W experts the prediction stages (`--stage-width`). base: "int4" (the
    engine's, planned with `options`: its budget, context and rows) or "dequantized".
    shard: the ranks to shard the dequantized base and the LoRA over (FSDP2, `--fsdp`:
    train/distributed.py); each rank reads and dequantizes only its part of each weight
    into `device`, so it never holds the whole base."""
    model_dir = Path(model_dir)
    engine = None
    sharded = shard is not None and shard.world > 1
    if sharded and base != "dequantized":
        raise ValueError(
            "--fsdp shards the dequantized base (--base dequantized); the int4 base is "
            "each rank's own engine, its experts streamed from disk"
        )
    if base == "int4":
        if device is not None and device.type != "cpu":
            raise ValueError(
                "the int4 base computes with the CPU's int4 kernels; on a GPU use the "
                "dequantized base (--base dequantized)"
            )
        memory.map_large_allocations()  # the backward's scratch goes back when freed
        # its kernels take bf16 activations, the exact option: the backward's gradient (dy·W,
        # train/int4_base.py) is that arithmetic's; serving's int8 is priced by `edge0 eval`
        opts = replace(
            options or EngineOptions(),
            top_k=top_k,
            no_prerouter=True,
            no_lora=True,
            int4_activations="bf16",
        )
        engine = load_engine(model_dir, opts)
        model, k = engine.model, engine.top_k
    elif sharded:  # built on the meta device, filled rank by rank once sharded (below)
        md = modeldir.ModelDir(model_dir, no_lora=True, no_prerouter=True)
        manifest, model = md.manifest, md.dequantized_skeleton()
        k = resolve_top_k(top_k, manifest.served_top_k, manifest.native_top_k)
        model.set_top_k(k)
    elif base == "dequantized":
        manifest, model = loader.load_edge0_model(model_dir, experts="dequantized")
        k = resolve_top_k(top_k, manifest.served_top_k, manifest.native_top_k)
        model.set_top_k(k)
    else:
        raise ValueError(f"base must be one of {', '.join(BASES)}, not {base!r}")
    model.requires_grad_(False)
    cfg = model.config
    pre = None
    if heads is not False:
        path = heads or model_dir / modeldir.PREROUTER_FILE
        if heads is not None or path.exists():
            pre, _ = Prerouter.load(path, cfg.hidden_size, cfg.num_experts, model.moe_layers)
            pre.requires_grad_(False)
    from edge0 import models

    fam = models.family(cfg.model_type)
    base_hash = modeldir.base_hash(model_dir)
    if lora_file is not None:
        lora.load(model, lora_file, base_hash=base_hash)
    elif new_lora is not None:
        r, alpha = new_lora
        targets = fam.LORA_TARGETS + (lora.router_targets(model) if lora_routers else ())
        lora.attach(
            model,
            lora.target_paths(model, targets),
            r,
            alpha,
            torch.Generator().manual_seed(seed),
        )
    device = device or torch.device("cpu")
    if sharded:
        _fill_sharded(md, model, shard, device)
    else:
        model.to(device)
    if pre is not None:
        pre.to(device)
    if stage_width is not None and stage_width < k:
        raise ValueError(f"the stage width ({stage_width}) must be at least K ({k})")
    wide = stage_width if stage_width is not None and stage_width > k else None
    return Student(model, pre, k, fam, base_hash, stage_width=wide, engine=engine)


def _fill_sharded(
    md: modeldir.ModelDir, model: torch.nn.Module, ranks: distributed.Ranks, device: torch.device
) -> None:
    """Shard a student built on the meta device (its LoRA, if any, already in host memory)
    over the ranks, then fill this rank's part of every weight: the base's read and
    dequantized from the directory, the adapter's from its initial values."""
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type == "cpu"}
    lora_parameters(model)  # trainable before sharding: FSDP reduces their grads
    distributed.shard(model, list(model.backbone.layers), ranks, device)
    wrapped = [f"{path}.base." for path in lora.adapters(model)]

    def base_name(name: str) -> str:  # a LoRA-wrapped projection's weight as stored
        prefix = next((w for w in wrapped if name.startswith(w)), None)
        return name if prefix is None else prefix.removesuffix("base.") + name[len(prefix) :]

    with loader.DequantizedTensors(md, model) as read:

        def source(name: str, rows: range) -> torch.Tensor:
            if name in adapter:
                return adapter[name][rows.start : rows.stop]
            return read(base_name(name), rows)

        distributed.materialize(model, device, source, ranks)
    model.eval()


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = []
    for m in lora.adapters(model).values():
        m.lora_A.requires_grad_(True)
        m.lora_B.requires_grad_(True)
        params += [m.lora_A, m.lora_B]
    if not params:
        raise ValueError("the student carries no LoRA to train")
    return params


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    steps: int,
    params: SamplingParams,
    gen: torch.Generator,
    runtime: PrerouterRuntime | None = None,
    executors: dict | None = None,
) -> torch.Tensor:
    """Continue B equal-length prompts [B, P] by `steps` sampled tokens -> [B, P + steps].

    With a runtime (the student) the prompt is gate-routed and every generated token is
    prediction-routed, as the engine serves it; without one every layer uses its gate.
    `executors`: where the experts come from (an int4 base's pool), else the model's own.
    """
    b = prompts.shape[0]
    dtype = next(model.parameters()).dtype
    cache = model.new_cache(prompts.shape[1] + steps, dtype, batch=b, device=prompts.device)
    sampler = Sampler(params)
    sampler.generator = gen
    pre = runtime.new_state(rows=b) if runtime is not None else None
    logits = decode.prefill(model, cache, prompts, pre, executors)
    out = [prompts]
    for i in range(steps):
        nxt = torch.stack([torch.tensor(sampler(row)) for row in logits])[:, None].to(
            prompts.device
        )
        out.append(nxt)
        if i + 1 == steps:
            break
        logits = decode.step(model, cache, nxt, pre, executors)
    return torch.cat(out, dim=1)


def train_lora(
    student: Student,
    run: Path,
    config: dict,
    *,
    steps: int,
    lr: float,
    warmup: int,
    save_every: int,
    gen: torch.Generator,
    batch_fn,
    loss_fn,
    desc: str,
    progress: bool,
    ranks: distributed.Ranks | None = None,
    micro_batch: int | None = None,
) -> common.RunLog:
    """The loop phases 2 and 3 share: AdamW on the LoRA only, warm-up + cosine, clipping,
    a JSON log of every loss, and resumable checkpoints of the trainables every save_every.

    `batch_fn(step)` returns this rank's share of the step's batch as a tuple of tensors
    [rows, ...]; `loss_fn(part, forward)` the mean loss over a part of it, computing the
    student through `forward` (Student.forward, wrapped in DistributedDataParallel on
    several ranks: train/distributed.py). With `micro_batch` the share is computed that many
    rows at a time, their gradients added with weights rows / share (accumulation): the
    same step in less activation memory, and the same arithmetic per row as N ranks of
    micro_batch rows each."""
    ranks = ranks or distributed.Ranks()
    params = lora_parameters(student.model)
    forward = distributed.wrap(params, student.forward, ranks, student.model)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    runlog = common.RunLog.resume(run / "log.json", config)
    step = 0
    state = common.load_state(run / "state.pt")
    if state is not None:
        distributed.load_full_state(student.model, opt, state["model"], state["optimizer"])
        gen.set_state(state["gen"])
        step = state["step"]
    bar = tqdm(
        total=steps, initial=step, desc=desc, unit="step", disable=not (progress and ranks.main)
    )
    t0 = time.perf_counter()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = common.cosine_lr(step, steps, lr, warmup, lr / 10)
        share = batch_fn(step)
        rows = share[0].shape[0]
        parts = list(zip(*(t.split(micro_batch or rows) for t in share), strict=True))
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # DDP averages the gradients over the ranks in the last part's backward pass
            with contextlib.nullcontext() if last else distributed.no_sync(forward, student.model):
                part_loss = loss_fn(part, forward) * (part[0].shape[0] / rows)
                part_loss.backward()
            loss = loss + part_loss.detach().cpu()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        memory.release_freed()  # the step's freed scratch back to the system
        step += 1
        value = distributed.mean(loss.detach(), ranks)  # the whole batch's loss
        runlog.add(step=step, loss=round(value, 5), elapsed_s=round(time.perf_counter() - t0, 1))
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}")
        if step % save_every == 0 or step == steps:
            # (gathered from every rank when the student is sharded)
            trainable, opt_state = distributed.full_state(
                student.model, opt, lambda k: ".lora_" in k
            )
            if ranks.main:
                common.save_state(run / "state.pt", step, trainable, opt_state, gen)
                runlog.save()
            ranks.barrier()  # no rank runs ahead of a checkpoint it could resume from
    bar.close()
    return runlog


def step_seconds(runlog: common.RunLog) -> float:
    """Mean seconds a step of this run took (its logged entries' elapsed times; each process
    that resumed the run counts from its own start). A mean, not a median: in rounds
    (phase 3's --round-steps) a round's first step also samples and scores the round."""
    times = [e["elapsed_s"] for e in runlog.entries]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    gaps = [g if g >= 0 else b for g, b in zip(gaps, times, strict=True)]
    return sum(gaps) / len(gaps) if gaps else 0.0


def finish(
    student: Student,
    model_dir: Path,
    out: Path,
    meta: dict,
    runlog: common.RunLog,
    base: str,
    ranks: distributed.Ranks,
) -> dict:
    """End of phase 2 or 3: rank 0 writes the adapter with its metadata and records it in
    the model's edge0.json; every rank waits for that and closes its student. Returns what
    both phases report: steps, final loss, the base and seconds a step."""
    with distributed.gathered(student.model):  # a sharded student's adapter, whole
        if ranks.main:
            lora.save(student.model, out, meta)
            modeldir.record_file(model_dir, out)  # edge0.json records the new bytes
    ranks.barrier()
    student.close()
    return {
        "steps": runlog.entries[-1]["step"],
        "final_loss": runlog.entries[-1]["loss"],
        "base": base,
        "step_s": step_seconds(runlog),
    }
