"""Model references offline: a Hugging Face repo id resolved from a hub cache the test writes
in the real layout (blobs, snapshots of symlinks, refs/main) with HF_HUB_OFFLINE=1, converted
once into edge0's cache; a hub-cache path; `edge0 pull`, `list`, `rm`; MLX detected from the
files. The download path itself is huggingface_hub's, untested here (no hub)."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from edge0 import hub
from edge0.cli import main as cli
from test_families import make_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_repo(cache, repo: str, files_from, commit: str = COMMIT):
    """`files_from`'s files as the hub stores a snapshot: content-addressed blobs, the
    snapshot's files as relative symlinks to them, refs/main naming the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in sorted(files_from.iterdir()):
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, root / "blobs" / digest)
            (snap / f.name).symlink_to(f"../../blobs/{digest}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A hub cache holding org/tiny, with the hub offline and edge0's cache in tmp."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    snap = write_hub_repo(cache, "org/tiny", make_checkpoint(tmp_path / "src", "olmoe"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return snap


def test_a_repo_id_converts_once_then_starts_at_once(offline, monkeypatch, capsys):
    first = hub.resolve("org/tiny", progress=False)
    assert (first / "edge0.json").is_file()
    assert first.parent.parent == hub.models_root() and first.name.startswith(COMMIT)
    import edge0.convert

    def no_second_convert(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(edge0.convert, "convert", no_second_convert)
    assert hub.resolve("org/tiny", progress=False) == first
    assert hub.resolve(f"org/tiny@{COMMIT}", progress=False) == first
    assert hub.resolve(offline, progress=False) == first  # the hub-cache path, same key
    assert cli.main(["generate", "org/tiny", "--prompt", "x", "--max-tokens", "3"]) == 0


def test_list_and_rm_manage_the_cache(offline, capsys):
    assert cli.main(["pull", "org/tiny", "--quiet"]) == 0
    path = capsys.readouterr().out.strip()
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "org/tiny@0123456789ab" in listed and path in listed and "1 models" in listed
    assert cli.main(["rm", "org/tiny"]) == 0
    assert not hub.cached()
    assert cli.main(["rm", "org/tiny"]) != 0  # nothing of that id left: said, and an error
    assert "no converted model of that id" in capsys.readouterr().err


def test_an_uncached_id_offline_is_a_clear_error(offline, capsys):
    assert cli.main(["generate", "org/missing", "--prompt", "x"]) != 0
    err = capsys.readouterr().err
    assert "org/missing is not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err
    assert cli.main(["generate", "no-such-dir", "--prompt", "x"]) != 0
    assert "not a Hugging Face repo id" in capsys.readouterr().err


def test_a_changed_source_converts_again(tmp_path, monkeypatch):
    """A local HF directory is converted into the cache too, keyed by its files: a change of
    its weights gives a new key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    src = make_checkpoint(tmp_path / "hf", "olmoe")
    first = hub.resolve(src, progress=False)
    assert hub.resolve(src, progress=False) == first
    make_checkpoint(src, "olmoe", seed=1)  # new weights in place
    assert hub.resolve(src, progress=False) != first


def test_a_quant_tag_fetches_the_file_however_either_spells_it(tmp_path, monkeypatch):
    """The hub matches allow_patterns case-sensitively: `:q4_k_m` must still fetch
    `Model-Q4_K_M.gguf` (found when a download fetched nothing)."""
    import fnmatch

    asked = {}
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "Model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(16))

    def fake_snapshot(repo, revision, download, patterns=None):
        asked["patterns"] = patterns
        return str(snap)

    monkeypatch.setattr(hub, "_snapshot", fake_snapshot)
    for tag in ("q4_k_m", "Q4_K_M"):
        src = hub.source(f"org/Model-GGUF:{tag}")
        assert src.kind == "gguf" and src.path.name == "Model-Q4_K_M.gguf"
        assert any(fnmatch.fnmatchcase("Model-Q4_K_M.gguf", p) for p in asked["patterns"])


def test_a_damaged_gguf_file_reaches_the_gguf_reader(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    src = hub.source(bad)
    assert src.kind == "gguf"
    with pytest.raises(ValueError, match="not a GGUF file"):
        hub.converter(src.kind)(src.path, tmp_path / "out", progress=False)
