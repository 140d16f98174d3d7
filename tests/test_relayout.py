"""A model packed for another CPU's kernel: the cached copy, repack on read, and the fallbacks."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from edge0 import modeldir, native
from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.formats.int4_layout import LAYOUTS, host_layout
from edge0.store.expert_file import ExpertFile, read_table
from edge0.store.pool import ExpertPool
from edge0.store.relayout import experts_for_host
from helpers import make_hf_model

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

PROMPT = list(range(5, 29))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same checkpoint converted once per known arrangement."""
    tmp = tmp_path_factory.mktemp("relayout")
    make_hf_model(tmp / "hf", scale=4.0)
    for name in LAYOUTS:
        convert(tmp / "hf", tmp / name, progress=False, int4=name)
    return tmp


def others() -> list[str]:
    return [name for name in LAYOUTS if LAYOUTS[name] != host_layout()]


def greedy(path, **kw) -> list[int]:
    engine = load_engine(path, EngineOptions(**kw))
    try:
        return engine.generate(PROMPT, 12, SamplingParams(temperature=0)).drain().tokens
    finally:
        engine.close()


def extents(path) -> dict[int, bytes]:
    """Each layer's extent bytes (the data, not the header)."""
    table, extent_bytes, _ = read_table(path)
    with open(path, "rb") as f:
        out = {}
        for layer, ext in table.items():
            f.seek(ext.offset)
            out[layer] = f.read(ext.count * extent_bytes)
    return out


def test_convert_records_the_arrangement(models):
    for name in LAYOUTS:
        assert modeldir.Manifest.load(models / name).layout().int4.name == name
        assert ExpertFile(models / name / "experts.safetensors").int4.name == name


@pytest.mark.parametrize("name", others())
def test_cached_copy_serves_the_same_tokens_and_is_made_once(models, tmp_path, name):
    want = greedy(models / host_layout().name, cache_dir=tmp_path / "unused")
    # the host's own arrangement needs no copy (the folder may hold the native build: the
    # first engine of a process builds it into its cache_dir)
    assert not (tmp_path / "unused" / "relayout").exists()

    before = sorted(p.name for p in (models / name).iterdir())
    assert greedy(models / name, cache_dir=tmp_path / "c") == want
    copies = list((tmp_path / "c" / "relayout").iterdir())
    assert len(copies) == 1 and copies[0].name.endswith(f"-{host_layout().name}.safetensors")
    # the copy holds exactly the bytes a convert for this CPU writes
    assert extents(copies[0]) == extents(models / host_layout().name / "experts.safetensors")
    assert sorted(p.name for p in (models / name).iterdir()) == before  # model dir untouched

    stamp = copies[0].stat().st_mtime_ns
    assert greedy(models / name, cache_dir=tmp_path / "c") == want
    assert copies[0].stat().st_mtime_ns == stamp  # reused, not rewritten


@pytest.mark.parametrize("name", others())
def test_repack_on_read_serves_the_same_tokens(models, tmp_path, name):
    want = greedy(models / host_layout().name)
    assert greedy(models / name, relayout="on-read", cache_dir=tmp_path / "c") == want
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name", others())
def test_repack_on_read_into_the_int8_order_serves_the_same_tokens(
    models, tmp_path, name, monkeypatch
):
    """int8 activations with the experts put in the int8 order as they are read (forced where
    the int8 path is not AVX2): a file in another arrangement is repacked into the host's,
    then ordered, and serves what the host's own file serves."""
    monkeypatch.setattr(native, "int8_order_pays", lambda: True)
    want = greedy(models / host_layout().name, int4_activations="int8")
    opts = EngineOptions(int4_activations="int8", relayout="on-read", cache_dir=tmp_path / "c")
    engine = load_engine(models / name, opts)
    try:
        assert engine.pool.file.int4.name == name  # read as stored, repacked on read
        assert engine.pool.layout.int4 == host_layout().in_int8_order()
        got = engine.generate(PROMPT, 12, SamplingParams(temperature=0)).drain().tokens
    finally:
        engine.close()
    assert got == want


def test_unwritable_cache_falls_back_to_repack_on_read(models, tmp_path, caplog):
    name = others()[0]
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        got = greedy(models / name, cache_dir=blocker / "cache")
    assert got == greedy(models / host_layout().name)
    assert any("repacking each expert as it is read" in r.message for r in caplog.records)


def test_a_damaged_copy_is_written_again(models, tmp_path):
    name = others()[0]
    layout = modeldir.Manifest.load(models / name).layout()
    path = experts_for_host(models / name, layout, None, host_layout(), cache_dir=tmp_path)
    good = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    again = experts_for_host(models / name, layout, None, host_layout(), cache_dir=tmp_path)
    assert again == path and path.read_bytes() == good


def test_header_and_manifest_must_agree(models, tmp_path):
    name = others()[0]
    wrong = modeldir.Manifest.load(models / name).layout().with_int4(host_layout())
    with pytest.raises(ValueError, match="re-run edge0 convert"):
        experts_for_host(models / name, wrong, None, host_layout(), cache_dir=tmp_path)


@pytest.mark.parametrize("name", others())
def test_pool_repacks_reads_into_the_host_arrangement(models, name):
    stored = modeldir.Manifest.load(models / name).layout()
    served = stored.with_int4(host_layout())
    pool = ExpertPool(ExpertFile(models / name / "experts.safetensors"), served, 4 * stored.nbytes)
    ref = ExpertPool(
        ExpertFile(models / host_layout().name / "experts.safetensors"), served, 4 * stored.nbytes
    )
    try:
        for p in (pool, ref):
            p.wait(p.request(1, [0, 3, 5]))
        for e in (0, 3, 5):
            got = pool.request(1, [e])[0].tensors
            want = ref.request(1, [e])[0].tensors
            for field in ("w13", "w2", "p13", "p2"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (e, field)
    finally:
        pool.close()
        ref.close()
