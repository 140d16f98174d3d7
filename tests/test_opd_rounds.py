"""Phase 3 in rounds (`train opd --round-steps R`): the student samples R steps' sequences,
the teacher is loaded only to score them, then the student trains on them. One-step rounds
are the per-step loop's arithmetic; a run stopped anywhere in a round resumes to the
uninterrupted adapter."""

from __future__ import annotations

import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file
from tests.test_training import stdlib_slice

from edge0 import builtin, modeldir
from edge0.train import opd
from edge0.train.opd import OPDConfig, train_opd

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rounds")
    model = tmp / "model"
    shutil.copytree(builtin.model_dir(), model)  # training records its adapter in edge0.json
    return {"tmp": tmp, "model": model, "data": [str(stdlib_slice(tmp / "data", count=12))]}


def run(setup, name: str, round_steps: int) -> dict[str, torch.Tensor]:
    out = setup["tmp"] / f"{name}.safetensors"
    if not out.exists():
        cfg = OPDConfig(
            prompt_len=16,
            gen_len=16,
            batch=2,
            steps=STEPS,
            teacher_topk=8,
            save_every=1,
            round_steps=round_steps,
        )
        init = setup["model"] / modeldir.LORA_SFT_FILE
        teacher = builtin.teacher_dir()
        train_opd(setup["model"], teacher, setup["data"], init, out, cfg, progress=False)
    return load_file(out)


def test_one_step_rounds_train_the_per_step_adapter(setup):
    every_step = run(setup, "per-step", 0)
    rounds = run(setup, "rounds-1", 1)
    assert every_step.keys() == rounds.keys() and every_step
    for k in every_step:
        assert torch.equal(rounds[k], every_step[k]), k


def test_the_teacher_is_loaded_per_round_and_never_while_the_student_trains(setup, monkeypatch):
    """Each teacher load_teacher returns is gone (no reference left: its memory freed)
    before the student samples or trains again."""
    loaded = []
    load = opd.load_teacher

    def counted(*args, **kwargs):
        teacher = load(*args, **kwargs)
        loaded.append(weakref.ref(teacher))
        return teacher

    def alive() -> bool:
        return any(ref() is not None for ref in loaded)

    def scored_loss(*args):
        assert not alive(), "the teacher is loaded while the student trains"
        return reverse_kl(*args)

    def sampled(*args):
        assert not alive(), "the teacher is loaded while the student samples"
        return sample(*args)

    reverse_kl, sample = opd.reverse_kl_scored, opd.sample
    monkeypatch.setattr(opd, "load_teacher", counted)
    monkeypatch.setattr(opd, "reverse_kl_scored", scored_loss)
    monkeypatch.setattr(opd, "sample", sampled)
    adapter = run(setup, "rounds-2", 2)
    assert len(loaded) == STEPS // 2 and not alive()
    folder = setup["tmp"] / "rounds-2.safetensors.run"
    assert sorted(f.name for f in folder.glob("round-*")) == [
        "round-00000.safetensors",
        "round-00001.safetensors",
    ]
    # and it trained: the adapter moved from phase 2's
    init = load_file(setup["model"] / modeldir.LORA_SFT_FILE)
    assert any(not torch.equal(adapter[k], init[k]) for k in adapter)


class Stop(Exception):
    pass


@pytest.mark.parametrize(
    "where",
    [
        "sampling round 1",  # the checkpoint is round 1's start; its file was not written
        "step 2's loss",  # the checkpoint is round 1's start; its file was written
        "step 3's loss",  # the checkpoint is mid-round 1
    ],
)
def test_a_run_stopped_in_a_round_resumes_to_the_uninterrupted_adapter(setup, monkeypatch, where):
    whole = run(setup, "rounds-2-whole", 2)
    name = "stopped-" + where.replace(" ", "-").replace("'", "")
    function, at = {
        "sampling round 1": ("sample", 3),
        "step 2's loss": ("reverse_kl_scored", 3),
        "step 3's loss": ("reverse_kl_scored", 4),
    }[where]
    original, calls = getattr(opd, function), []

    def failing(*args):
        calls.append(1)
        if len(calls) == at:
            raise Stop
        return original(*args)

    with monkeypatch.context() as m:
        m.setattr(opd, function, failing)
        with pytest.raises(Stop):
            run(setup, name, 2)
    state = torch.load(setup["tmp"] / f"{name}.safetensors.run" / "state.pt", weights_only=False)
    assert state["step"] == at - 1 if function == "reverse_kl_scored" else state["step"] == 2
    resumed = run(setup, name, 2)
    for k in whole:
        assert torch.equal(resumed[k], whole[k]), k
