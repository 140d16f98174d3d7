"""The teacher cache (train/teacher_cache.py) and phase 2 from it with no teacher loaded."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tests.test_training import stdlib_slice

from edge0 import builtin
from edge0.train import teacher_cache
from edge0.train.sft import SFTConfig, forward_kl, train_sft
from edge0.train.teacher_cache import CacheConfig, TeacherCache, top_k_and_tail, top_k_tail_kl

pytestmark = pytest.mark.slow

CFG = CacheConfig(windows=10, prompt_len=16, gen_len=24, topk=8, shard_windows=4, batch=3)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    data = stdlib_slice(tmp / "data", count=12)
    out = tmp / "cache"
    teacher_cache.build(builtin.teacher_dir(), [str(data)], out, CFG, progress=False)
    return {"tmp": tmp, "data": data, "out": out}


def test_top_k_and_the_tail_hold_all_the_probability():
    logits = torch.randn(3, 5, 100, generator=torch.Generator().manual_seed(0)) * 4
    ids, top, tail = top_k_and_tail(logits, 7)
    assert ids.dtype == torch.int32 and ids.shape == top.shape == (3, 5, 7)
    total = top.exp().sum(-1) + tail.exp()
    torch.testing.assert_close(total, torch.ones_like(total))


def test_the_top_k_tail_kl_is_the_full_kl_at_full_k_and_zero_at_the_teacher():
    g = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    ids, top, tail = top_k_and_tail(teacher, 50)
    full = top_k_tail_kl(student, ids.long(), top, torch.full_like(tail, -1e4))
    torch.testing.assert_close(full, forward_kl(student, teacher))
    ids, top, tail = top_k_and_tail(teacher, 5)
    assert abs(top_k_tail_kl(teacher, ids.long(), top, tail).item()) < 1e-6
    assert top_k_tail_kl(student, ids.long(), top, tail).item() > 0.01


def test_the_cache_holds_the_teachers_scores_in_resumable_shards(cache, tmp_path):
    out = cache["out"]
    shards = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert shards == [teacher_cache.shard_name(i) for i in range(3)]
    summary = teacher_cache.summary(out)
    assert summary["windows"] == 10
    # k ids (int32) + k log-probabilities (fp16) + the tail (fp32), plus the window's tokens
    assert 8 * 4 + 8 * 2 + 4 < summary["bytes_per_position"] < 8 * 4 + 8 * 2 + 4 + 40
    rows = TeacherCache(out).rows(torch.tensor([0, 9, 5]))
    tokens, ids, logprobs, tail = rows
    assert tokens.shape == (3, 40) and ids.shape == logprobs.shape == (3, 24, 8)
    # what it holds is the teacher's distribution at those positions
    from edge0.train.student import load_teacher

    with torch.no_grad():
        want = load_teacher(builtin.teacher_dir())(tokens)[:, 15:-1]
    w_ids, w_top, w_tail = top_k_and_tail(want, 8)
    assert torch.equal(ids, w_ids.long())
    # stored as fp16; recomputed here over another batch of windows, whose matmuls add in
    # another order, so a value on a rounding boundary may land one fp16 step away
    torch.testing.assert_close(logprobs, w_top.half().float(), rtol=2**-10, atol=0)
    torch.testing.assert_close(tail, w_tail)
    # a shard lost is written again, the same bytes; the others are kept
    kept = (out / teacher_cache.shard_name(0)).stat().st_mtime_ns
    before = load_file(out / teacher_cache.shard_name(1))
    (out / teacher_cache.shard_name(1)).unlink()
    teacher_cache.build(builtin.teacher_dir(), [str(cache["data"])], out, CFG, progress=False)
    after = load_file(out / teacher_cache.shard_name(1))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (out / teacher_cache.shard_name(0)).stat().st_mtime_ns == kept
    # other settings are refused, not mixed in
    other = dataclasses.replace(CFG, topk=4)
    with pytest.raises(ValueError, match="topk"):
        teacher_cache.build(builtin.teacher_dir(), [str(cache["data"])], out, other, False)


def test_phase2_trains_from_the_cache_with_no_teacher_loaded(cache, tmp_path, monkeypatch):
    from edge0.modeldir import loader
    from edge0.train import sft, student

    def no_teacher(*a, **kw):
        raise AssertionError("a teacher was loaded")

    for module, name in (
        (sft, "load_teacher"),
        (student, "load_teacher"),
        (loader, "load_hf_model"),
    ):
        monkeypatch.setattr(module, name, no_teacher)
    model = tmp_path / "model"
    shutil.copytree(builtin.model_dir(), model)
    cfg = SFTConfig(teacher_cache=cache["out"], steps=4, batch=2, save_every=2, rank=4)
    out = tmp_path / "lora.safetensors"
    r = train_sft(model, None, [], out, cfg, progress=False)
    assert r["cache_windows"] == 10 and r["samples"] is None
    trained = load_file(out)
    assert any(k.endswith("lora_B") and v.abs().max() > 0 for k, v in trained.items())
