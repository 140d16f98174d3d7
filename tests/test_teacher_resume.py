"""Teacher pre-training resumes bit-exactly, over passes and early stopping, on a tiny config."""

from __future__ import annotations

import itertools
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from edge0.text import corpus
from edge0.train import teacher
from edge0.train.passes import PassOrder
from edge0.train.teacher import TeacherConfig, train_teacher


def tiny_corpus(dst: Path, train: int = 8, heldout: int = 2) -> Path:
    """Distinct stdlib modules under names chosen so that each split gets its share (the split
    is a hash of the path, and tmp paths differ per run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = iter(sorted(p for p in root.glob("*.py") if 2_000 < p.stat().st_size < 4_000))
    dst.mkdir()
    want = {"train": train, "heldout": heldout}
    for i in itertools.count():
        path = dst / f"m{i}.py"
        split = corpus.split_of(str(path))
        if want[split]:
            path.write_text(next(sources).read_text(encoding="utf-8")[:1500])
            want[split] -= 1
        if not any(want.values()):
            return dst
    raise AssertionError("unreachable")


def config(data: Path) -> TeacherConfig:
    return TeacherConfig(
        layers=2,
        hidden=64,
        heads=2,
        kv_heads=1,
        head_dim=32,
        experts=4,
        top_k=2,
        expert_width=64,
        vocab=384,
        seq_len=32,
        batch=8,
        passes=3,
        lr=1e-2,
        warmup=2,
        patience=3,
        eval_windows=4,
        eval_seq_len=32,
        save_every=3,
        data=(str(data),),
    )


class Interrupted(Exception):
    pass


def run_log(out: Path) -> list[dict]:
    return json.loads((out / "run" / "log.json").read_text())["entries"]


def test_interrupted_run_resumes_bit_exactly(tmp_path, monkeypatch):
    torch.set_num_threads(1)  # conftest restores the count; summation order must not change
    data = tiny_corpus(tmp_path / "data")
    cfg = config(data)
    straight = train_teacher(tmp_path / "a", cfg, progress=False)
    steps_per_pass = straight["steps_per_pass"]
    assert straight["finished"] and straight["steps"] == 3 * steps_per_pass >= 9
    assert len(straight["passes"]) == 3

    # first interruption: a clean stop mid-pass 2 (checkpointed there)
    b = tmp_path / "b"
    stop = steps_per_pass + 1
    stopped = train_teacher(b, cfg, progress=False, stop_at=stop)
    assert not stopped["finished"] and stopped["steps"] == stop
    # second: a crash two steps after a checkpoint, so those steps are lost and recomputed
    saved = {s for s in range(1, straight["steps"] + 1) if s % 3 == 0 or s % steps_per_pass == 0}
    crash = next(c for c in range(stop + 3, straight["steps"]) if not {c - 1, c - 2} & saved)
    done = {"steps": stop}
    real_step = teacher.TrainStep.__call__

    def crashing_step(self, batch, lr):
        if done["steps"] + 1 == crash:
            raise Interrupted
        done["steps"] += 1
        return real_step(self, batch, lr)

    monkeypatch.setattr(teacher.TrainStep, "__call__", crashing_step)
    with pytest.raises(Interrupted):
        train_teacher(b, cfg, progress=False)
    monkeypatch.setattr(teacher.TrainStep, "__call__", real_step)
    assert run_log(b)[-1]["step"] == crash - 3  # the two lost steps are not in the log
    resumed = train_teacher(b, cfg, progress=False)

    assert resumed["passes"] == straight["passes"]
    strip = [{k: v for k, v in e.items() if k != "elapsed_s"} for e in run_log(tmp_path / "a")]
    assert [{k: v for k, v in e.items() if k != "elapsed_s"} for e in run_log(b)] == strip
    final_a = torch.load(tmp_path / "a" / "run" / "state.pt", weights_only=False)
    final_b = torch.load(b / "run" / "state.pt", weights_only=False)
    for name, w in final_a["model"].items():
        assert torch.equal(w, final_b["model"][name]), name
    opt_a, opt_b = final_a["optimizer"]["state"], final_b["optimizer"]["state"]
    for i, s in opt_a.items():
        assert all(torch.equal(s[k], opt_b[i][k]) for k in s), i
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        b / "model.safetensors"
    ).read_bytes()


def test_early_stopping_keeps_the_best_pass(tmp_path, monkeypatch):
    torch.set_num_threads(1)  # two threads on a busy 2-core machine spin instead of working
    data = tiny_corpus(tmp_path / "data")
    cfg = config(data)
    cfg.passes, cfg.patience = 6, 2
    # clean held-out perplexity that improves for two passes, then gets worse
    scores = iter([50.0, 40.0, 45.0, 46.0, 47.0, 48.0])
    built, real_fixed, real_ppl = [], teacher.common.fixed_windows, teacher.perplexity

    def tracked_fixed(stream, count, length):
        built.append(real_fixed(stream, count, length))  # held-out, clean held-out, train
        return built[-1]

    def scripted(model, windows, batch=8):
        value = real_ppl(model, windows, batch)
        return next(scores) if windows is built[1] else value

    monkeypatch.setattr(teacher.common, "fixed_windows", tracked_fixed)
    monkeypatch.setattr(teacher, "perplexity", scripted)
    summary = train_teacher(tmp_path / "out", cfg, progress=False)
    per_pass = summary["steps_per_pass"]
    assert summary["stopped_early"] and len(summary["passes"]) == 4
    assert summary["steps"] == 4 * per_pass < 6 * per_pass
    assert summary["best_step"] == 2 * per_pass and summary["heldout_clean_ppl"] == 40.0
    assert [p["heldout_clean_ppl"] for p in summary["passes"]] == [50.0, 40.0, 45.0, 46.0]
    # the written weights are those of pass 2, not of the last pass
    best = torch.load(tmp_path / "out" / "run" / "best.pt")
    last = torch.load(tmp_path / "out" / "run" / "state.pt", weights_only=False)["model"]
    assert not all(torch.equal(best[k], last[k]) for k in best)


def test_pass_order_covers_the_stream_once_per_pass():
    order = PassOrder(tokens=1000, seq_len=16, batch=4, seed=3)
    for p in range(3):
        starts = torch.cat([order.starts(p * order.steps_per_pass + i) for i in range(15)])
        offset = int(starts.min()) % 16
        assert len(set(starts.tolist())) == 60  # no window twice within a pass
        assert all((s - offset) % 16 == 0 for s in starts.tolist())  # non-overlapping
    first, second = order.starts(0), order.starts(order.steps_per_pass)
    assert not torch.equal(first, second)  # each pass has its own order
    stream = torch.arange(1000, dtype=torch.int32)
    batch = order.batch_at(stream, 5)
    assert batch.shape == (4, 17) and torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 16))


@pytest.mark.slow
def test_compiled_run_resumes_bit_exactly(tmp_path):
    """torch.compile generates the same kernels in a resumed run: still bit-exact."""
    torch.set_num_threads(1)
    data = tiny_corpus(tmp_path / "data")
    cfg = config(data)
    cfg.compile, cfg.passes = True, 1
    straight = train_teacher(tmp_path / "a", cfg, progress=False)
    train_teacher(tmp_path / "b", cfg, progress=False, stop_at=straight["steps"] // 2)
    resumed = train_teacher(tmp_path / "b", cfg, progress=False)
    assert resumed["passes"] == straight["passes"]
    assert [e["loss"] for e in run_log(tmp_path / "a")] == [
        e["loss"] for e in run_log(tmp_path / "b")
    ]
    a = torch.load(tmp_path / "a" / "run" / "state.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "run" / "state.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
