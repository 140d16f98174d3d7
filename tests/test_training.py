"""The three training phases and the quality harness, end to end on a small *trained* model.

A 2-layer Qwen3-MoE teacher is pre-trained here on real text (a slice of the stdlib), so
routing carries information; then convert (int4), phase 1 heads at half the native K,
phase 2 SFT, phase 3 on-policy distillation, and `evaluate`.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from edge0.cli import main as cli
from edge0.convert import convert
from edge0.models import lora
from edge0.text.tokenizer import load_tokenizer
from edge0.train import common, evaluate
from edge0.train.data import load_texts
from edge0.train.heads import HeadsConfig, train_heads
from edge0.train.opd import OPDConfig, reverse_kl_topk_tail, train_opd
from edge0.train.sft import SFTConfig, forward_kl, train_sft
from edge0.train.teacher import TeacherConfig, train_teacher

pytestmark = pytest.mark.slow


def stdlib_slice(dst: Path, count: int = 60) -> Path:
    """Real text: the first `count` mid-sized stdlib modules, copied so held-out shares exist."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if 4_000 < p.stat().st_size < 30_000)[:count]
    dst.mkdir()
    for f in files:
        (dst / f.name).write_text(f.read_text(encoding="utf-8"))
    return dst


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    data = [str(stdlib_slice(tmp / "data"))]
    teacher_cfg = TeacherConfig(
        layers=2,
        hidden=64,
        heads=2,
        kv_heads=1,
        head_dim=32,
        experts=8,
        top_k=4,
        expert_width=64,
        vocab=512,
        seq_len=64,
        batch=16,
        steps=250,
        lr=5e-3,
        warmup=20,
        eval_every=125,
        eval_windows=16,
        save_every=125,
        data=tuple(data),
    )
    summary = train_teacher(tmp / "teacher", teacher_cfg, progress=False)
    convert(tmp / "teacher", tmp / "e0", progress=False)
    served_k = 2
    heads = train_heads(
        tmp / "e0",
        data,
        tmp / "e0" / "prerouter.safetensors",
        HeadsConfig(
            top_k=served_k, width=64, train_tokens=6000, heldout_tokens=2000, seq_len=64, epochs=3
        ),
        progress=False,
    )
    sft_cfg = SFTConfig(
        top_k=served_k,
        rank=8,
        alpha=16,
        samples=1024,
        prompt_len=16,
        gen_len=32,
        gen_batch=128,
        steps=200,
        batch=16,
        lr=2e-3,
    )

    train_sft(
        tmp / "e0",
        tmp / "teacher",
        data,
        tmp / "e0" / "lora-phase2.safetensors",
        sft_cfg,
        progress=False,
    )
    opd_cfg = OPDConfig(
        top_k=served_k, prompt_len=16, gen_len=24, batch=8, steps=15, lr=5e-4, teacher_topk=8
    )
    train_opd(
        tmp / "e0",
        tmp / "teacher",
        data,
        tmp / "e0" / "lora-phase2.safetensors",
        tmp / "e0" / "lora.safetensors",
        opd_cfg,
        progress=False,
    )
    result = evaluate.evaluate(
        tmp / "e0",
        evaluate.EvalConfig(
            teacher=tmp / "teacher", data=tuple(data), top_k=served_k, windows=16, seq_len=64
        ),
        progress=False,
    )
    print(evaluate.table(result))
    return {
        "tmp": tmp,
        "data": data,
        "teacher": summary,
        "heads": heads,
        "eval": result,
        "sft_cfg": sft_cfg,
    }


def kl(result: dict, prefix: str) -> float:
    return next(r["kl_teacher_arm"] for r in result["arms"] if r["arm"].startswith(prefix))


def test_teacher_learned_something(pipeline):
    entries = json.loads((pipeline["tmp"] / "teacher" / "run" / "log.json").read_text())["entries"]
    assert entries[-1]["loss"] < entries[0]["loss"] - 1.5
    assert pipeline["teacher"]["heldout_ppl"] < 100  # vocab 512: uniform would be 512


def test_eval_table_has_every_arm(pipeline):
    labels = [r["arm"] for r in pipeline["eval"]["arms"]]
    # 6 + int8 activations + KV bf16 and int8 + gate routing with the phase-3 LoRA, and
    # W = 1.5K, 2K (+ phase 3)
    assert labels[0].startswith("teacher") and len(labels) == 8 + 2 + 4
    assert labels[9].startswith("gate routing, served K") and "phase 3" in labels[9]
    assert labels[2].endswith("int8 activations")  # this model's floor is int4: no floor arm
    assert labels[3:5] == [f"{labels[1]}, KV bfloat16", f"{labels[1]}, KV int8"]
    teacher = pipeline["eval"]["arms"][0]
    assert teacher["kl_teacher_arm"] == pytest.approx(0.0, abs=1e-6)
    assert teacher["top1_agreement"] == 1.0


def test_each_approximation_costs_and_phase2_pays_back(pipeline):
    r = pipeline["eval"]
    int4_native = kl(r, "int4, native routing, native")
    served = kl(r, "int4, native routing, served")
    routed = kl(r, "+ prerouter")
    phase2 = kl(r, "+ LoRA after phase 2")
    phase3 = kl(r, "+ phase 3")
    assert int4_native < served  # halving K costs
    assert phase2 < 0.9 * routed  # the LoRA recovers a real share of the gap
    assert phase3 < 1.05 * phase2 and phase3 < routed  # on-policy does not undo it


def test_heads_beat_the_warm_start(pipeline):
    h = pipeline["heads"]
    assert sum(h["trained_recall"].values()) > sum(h["warm_start_recall"].values())


def test_training_is_reproducible_with_a_seed(pipeline, tmp_path):
    tmp, data = pipeline["tmp"], pipeline["data"]
    cfg = SFTConfig(
        top_k=2,
        rank=4,
        alpha=8,
        samples=16,
        prompt_len=16,
        gen_len=8,
        gen_batch=16,
        steps=4,
        batch=4,
        seed=7,
    )
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        train_sft(tmp / "e0", tmp / "teacher", data, out, cfg, progress=False)
        outs.append(load_file(str(out)))
        log = json.loads((tmp_path / f"{name}.safetensors.run" / "log.json").read_text())
        assert [e["step"] for e in log["entries"]] == [1, 2, 3, 4]
    assert outs[0].keys() == outs[1].keys()
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])


def test_reverse_kl_with_tail_is_zero_only_at_the_teacher():
    p = torch.randn(5, 50)
    assert reverse_kl_topk_tail(p, p, 8).item() == pytest.approx(0.0, abs=1e-6)
    assert reverse_kl_topk_tail(p + torch.randn(5, 50), p, 8).item() > 1e-3


def test_forward_kl_is_zero_only_at_the_teacher():
    p = torch.randn(5, 50)
    assert forward_kl(p, p).item() == pytest.approx(0.0, abs=1e-6)
    q = p + torch.randn(5, 50)
    expected = (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1).mean()
    assert forward_kl(q, p).item() == pytest.approx(expected.item(), rel=1e-5)
    assert forward_kl(q, p).item() > 1e-3


@pytest.mark.parametrize("source", ["teacher", "corpus"])
def test_phase2_with_the_teachers_distribution_learns(pipeline, tmp_path, source):
    """`loss="kl"`: the teacher scores the sequences (its own samples, or corpus windows) and
    the LoRA learns its whole distribution there; the loss falls over a short run."""
    tmp, data = pipeline["tmp"], pipeline["data"]
    # 80 steps: over 40 the ratio below ranged 0.67-0.81 with what else ran before in the
    # process (the same code and seeds; the rounding moved), and 0.8 failed once; over 80 it
    # was 0.54-0.65 in the same runs
    cfg = dataclasses.replace(pipeline["sft_cfg"], loss="kl", samples=128, steps=80, source=source)
    out = tmp_path / "kl.safetensors"
    train_sft(tmp / "e0", tmp / "teacher", data, out, cfg, progress=False)
    run = tmp_path / "kl.safetensors.run"
    losses = [e["loss"] for e in json.loads((run / "log.json").read_text())["entries"]]
    assert len(losses) == 80
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    meta = lora.read(out).metadata
    assert (meta["loss"], meta["source"]) == ("kl", source)
    # corpus windows are drawn afresh each step: no teacher samples are drawn or cached
    assert (run / "dataset.pt").exists() == (source == "teacher")


def test_phase2_on_corpus_windows_trains_on_corpus_text(pipeline, tmp_path, monkeypatch):
    """`source="corpus"`: each step's batch is prompt_len + gen_len consecutive tokens of the
    training text, and the prompt positions are gate-routed as a served prompt is."""
    from edge0.train import sft
    from edge0.train.student import Student

    tmp, data = pipeline["tmp"], pipeline["data"]
    cfg = dataclasses.replace(pipeline["sft_cfg"], loss="kl", steps=3, source="corpus")
    seen: list[tuple[torch.Tensor, int]] = []
    real = Student.forward

    def forward(self, tokens, first_predicted):
        seen.append((tokens.clone(), first_predicted))
        return real(self, tokens, first_predicted)

    monkeypatch.setattr(Student, "forward", forward)
    sft.train_sft(tmp / "e0", tmp / "teacher", data, tmp_path / "c.safetensors", cfg, False)
    tok = load_tokenizer(tmp / "e0")
    docs, _ = load_texts(data, "train")
    stream = common.tokenize(docs, tok, tok.eos_token_id).tolist()
    text = "," + ",".join(map(str, stream)) + ","
    assert len(seen) == 3
    for tokens, first in seen:
        assert tokens.shape == (cfg.batch, cfg.prompt_len + cfg.gen_len)
        assert first == cfg.prompt_len
        for row in tokens.tolist():
            assert "," + ",".join(map(str, row)) + "," in text


def test_lora_retention_is_reported(pipeline):
    tmp = pipeline["tmp"]
    r = evaluate.lora_retention(
        tmp / "e0", tmp / "e0" / "lora.safetensors", list(range(20)), top_k=2
    )
    for scheme in ("bf16", "int4"):
        assert set(r[scheme]) >= {"weight_retention_mean", "logits_retention"}
    # bf16 keeps nearly the whole delta; int4 re-quantization keeps much less of it
    assert r["bf16"]["weight_retention_mean"] > r["int4"]["weight_retention_mean"]


def test_eval_prices_an_int4_floor_for_a_model_that_keeps_it_in_bf16(pipeline, tmp_path):
    convert(pipeline["tmp"] / "teacher", tmp_path / "bf16", resident="bf16", progress=False)
    cfg = evaluate.EvalConfig(
        teacher=pipeline["tmp"] / "teacher", data=tuple(pipeline["data"]), windows=4, seq_len=64
    )
    arms = evaluate.evaluate(tmp_path / "bf16", cfg, progress=False)["arms"]
    labels = [r["arm"] for r in arms]
    assert labels[1].startswith("int4, native routing, native") and "floor" not in labels[1]
    assert labels[2].startswith("+ int4 floor")
    # quantizing attention, embeddings and the LM head as well costs more than experts alone
    assert arms[2]["kl_teacher_arm"] > arms[1]["kl_teacher_arm"] > 0
    # the int4 model the pipeline converted is the same conversion: the same numbers
    int4 = evaluate.evaluate(
        pipeline["tmp"] / "e0", dataclasses.replace(cfg, int4_floor=False), progress=False
    )
    assert int4["arms"][1]["perplexity"] == pytest.approx(arms[2]["perplexity"], rel=1e-6)
    # int8 activations cost a little, next to what int4 costs: on the experts alone (a bf16
    # floor) and on the experts and attention (an int4 floor)
    for result in (arms, int4["arms"]):
        int8 = next(r for r in result if r["arm"].endswith("int8 activations"))
        base = result[1]["kl_teacher_arm"]
        assert int8["kl_teacher_arm"] != base
        assert abs(int8["kl_teacher_arm"] - base) < 0.5 * base
        assert abs(int8["top1_agreement"] - result[1]["top1_agreement"]) < 0.03
    # the CLI can leave the arms out (the floor's converts the whole teacher)
    args = ["eval", str(tmp_path / "bf16"), "--teacher", str(pipeline["tmp"] / "teacher")]
    args += ["--data", *map(str, pipeline["data"]), "--windows", "2", "--seq-len", "64"]
    args += ["--no-int4-floor", "--no-int8-activations"]
    assert cli.main([*args, "--json", str(tmp_path / "e.json"), "--quiet"]) == 0
    labels = [r["arm"] for r in json.loads((tmp_path / "e.json").read_text())["arms"]]
    assert labels[1].startswith("int4, native routing")
    assert not any("floor" in a or "int8 activations" in a for a in labels)


def test_the_held_out_split_of_data_files_does_not_depend_on_where_they_live(tmp_path):
    from edge0.train.data import load_texts

    texts = {f"pkg/mod{i}.py": f"def f{i}():\n    return {i}\n" for i in range(40)}
    for root in ("a", "b/deeper"):
        for name, text in texts.items():
            (tmp_path / root / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / root / name).write_text(text)
    for split in ("train", "heldout"):
        here = load_texts([str(tmp_path / "a")], split)
        there = load_texts([str(tmp_path / "b/deeper")], split)
        assert here == there  # the same documents and the same data hash
    assert 0 < len(load_texts([str(tmp_path / "a")], "heldout")[0]) < len(texts)


class Crash(Exception):
    pass


def crash_once_at(monkeypatch, key: str, value: int) -> None:
    """RunLog.add raises once, at the entry whose `key` is `value`: that step's update ran
    but no checkpoint after it was written, as if the process died there."""
    real = common.RunLog.add
    fired: list[bool] = []

    def add(self, **entry):
        if entry.get(key) == value and not fired:
            fired.append(True)
            raise Crash
        real(self, **entry)

    monkeypatch.setattr(common.RunLog, "add", add)


def run_phase(phase: str, pipeline: dict, out: Path) -> None:
    tmp, data = pipeline["tmp"], pipeline["data"]
    if phase == "heads":
        cfg = HeadsConfig(
            top_k=2, width=32, train_tokens=2000, heldout_tokens=1000, seq_len=64, epochs=3
        )
        train_heads(tmp / "e0", data, out, cfg, progress=False)
    elif phase.startswith("sft"):
        cfg = SFTConfig(
            top_k=2, rank=4, alpha=8, samples=16, prompt_len=16, gen_len=8, gen_batch=16,
            steps=6, batch=4, save_every=2, loss="kl",
            source="corpus" if phase == "sft-corpus" else "teacher",
        )  # fmt: skip
        train_sft(tmp / "e0", tmp / "teacher", data, out, cfg, progress=False)
    else:
        cfg = OPDConfig(
            top_k=2, prompt_len=16, gen_len=8, batch=4, steps=6, save_every=2, teacher_topk=8
        )
        init = tmp / "e0" / "lora-phase2.safetensors"
        train_opd(tmp / "e0", tmp / "teacher", data, init, out, cfg, progress=False)


@pytest.mark.parametrize("phase", ["heads", "sft", "sft-corpus", "opd"])
def test_each_phase_resumes_bit_exactly_after_a_crash(pipeline, tmp_path, monkeypatch, phase):
    """A run that dies after an unsaved step and is started again ends with the same weights
    and the same logged losses as a run that never stopped."""
    torch.set_num_threads(1)  # conftest restores the count; summation order must not change
    straight, crashed = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run_phase(phase, pipeline, straight)
    key, value = ("epoch", 2) if phase == "heads" else ("step", 5)  # checkpoints: 1 / 2, 4
    crash_once_at(monkeypatch, key, value)
    with pytest.raises(Crash):
        run_phase(phase, pipeline, crashed)
    assert not crashed.exists()
    run_phase(phase, pipeline, crashed)  # resumes from its checkpoint

    a, b = load_file(str(straight)), load_file(str(crashed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def losses(out: Path) -> list[dict]:
        log = json.loads((out.with_name(out.name + ".run") / "log.json").read_text())
        return [{k: v for k, v in e.items() if k != "elapsed_s"} for e in log["entries"]]

    assert losses(straight) == losses(crashed)
    assert len(losses(straight)) == (3 if phase == "heads" else 6)


def test_eval_prices_the_kv_storage_against_exact_keys(pipeline):
    """The KV arms: bf16 keys and values cost something but little next to int4 experts, its
    KL is taken against the same model with exact keys, and int8's against bf16's."""
    cfg = evaluate.EvalConfig(
        teacher=pipeline["tmp"] / "teacher",
        data=tuple(pipeline["data"]),
        windows=4,
        seq_len=64,
        int4_floor=False,
        int8_activations=False,
    )
    arms = {r["arm"]: r for r in evaluate.evaluate(pipeline["tmp"] / "e0", cfg)["arms"]}
    exact = next(label for label in arms if label.startswith("int4, native routing"))
    bf16, int8 = arms[f"{exact}, KV bfloat16"], arms[f"{exact}, KV int8"]
    assert bf16["vs"] == exact and int8["vs"] == f"{exact}, KV bfloat16"
    assert 0 < bf16["kl_vs_arm"] < arms[exact]["kl_teacher_arm"]
    assert 0 < int8["kl_vs_arm"] < arms[exact]["kl_teacher_arm"]
    assert "kl_vs_arm" not in arms[exact]
