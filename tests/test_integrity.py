"""Nothing silent: a damaged model file is a named error, from `edge0 verify`, at load and on
read, never an exit 0 with empty or garbage text.

Each case damages a fresh copy of a tiny converted model the way a careless disk would: a
byte of an expert's codes, the high byte of one of its bf16 scales, a page of zeros, a byte of
the resident weights, two layers' names swapped in a header, a byte of a relayout copy.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from edge0.convert import convert
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.engine.scheduler import NonFiniteLogits
from edge0.formats.int4_layout import LAYOUTS, host_layout
from edge0.formats.integrity import ModelDataError
from edge0.modeldir import Manifest
from edge0.modeldir.verify import verify
from edge0.store.expert_file import read_table, tensor_name
from helpers import make_hf_model

GREEDY = SamplingParams(temperature=0)
LAYER, EXPERT = 1, 5


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    make_hf_model(tmp / "hf", scale=4.0)
    convert(tmp / "hf", tmp / "e0", progress=False)
    return tmp / "e0"


@pytest.fixture
def model(pristine, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(pristine, out)
    return out


def generate(path, **opts) -> list[int]:
    engine = load_engine(path, EngineOptions(io_mode="buffered", **opts))
    try:
        ids = engine.tokenizer.encode("def add(a, b):")
        return engine.generate(ids, 8, GREEDY).drain().tokens
    finally:
        engine.close()


def extent_at(path, layer: int, expert: int) -> int:
    table, size, _ = read_table(path / "experts.safetensors")
    return table[layer].offset + expert * size


def poke(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def test_a_pristine_model_verifies_and_every_extent_has_a_checksum(model):
    report = verify(model, progress=False)
    assert report.ok, report.text()
    assert any("against their checksums" in c for c in report.checked)
    assert not report.notes  # nothing it could check only whole
    assert verify(model, quick=True, progress=False).ok


def damaged_extent(model, how: str) -> None:
    layout = Manifest.load(model).layout()
    start = extent_at(model, LAYER, EXPERT)
    if how == "code byte":
        flip(model / "experts.safetensors", start + layout.fields["w13"][2] + 7)
    elif how == "scale byte":  # the high byte of a bf16 scale: a huge or NaN weight
        poke(model / "experts.safetensors", start + layout.fields["p13"][2] + 1, b"\x7f")
    elif how == "zeroed page":
        poke(model / "experts.safetensors", start + 4096, bytes(4096))


@pytest.mark.parametrize("how", ["code byte", "scale byte", "zeroed page"])
def test_a_damaged_extent_is_named_by_verify_and_on_read(model, how):
    damaged_extent(model, how)
    report = verify(model, progress=False)
    assert not report.ok
    assert any(f"layer {LAYER} expert {EXPERT} does not match" in p for p in report.problems)
    assert len(report.problems) == 1, report.problems
    # every expert is read at load (the pool holds them all): the damage is found there
    with pytest.raises(ModelDataError, match=f"layer {LAYER} expert {EXPERT} does not match"):
        generate(model)
    # read as routed instead: found on the first read of that expert, whoever routes to it
    engine = load_engine(model, EngineOptions(io_mode="buffered", preload=False))
    try:
        with pytest.raises(ModelDataError, match=f"expert {EXPERT} does not match"):
            engine.pool.wait(engine.pool.request(LAYER, [EXPERT]))
        # not quietly read again: the next read fails the same way
        with pytest.raises(ModelDataError):
            engine.pool.wait(engine.pool.request(LAYER, [EXPERT]))
        assert engine.pool.available() == engine.pool.num_slots
    finally:
        engine.close()


def test_checked_reads_can_be_every_read_or_none(model):
    damaged_extent(model, "code byte")
    engine = load_engine(model, EngineOptions(io_mode="buffered", verify_reads="off"))
    engine.close()  # off: loads, nothing checked
    with pytest.raises(ValueError, match="verify_reads must be one of first, all, off"):
        load_engine(model, EngineOptions(verify_reads="sometimes"))


def test_a_damaged_resident_file_is_named_by_verify_and_at_load(model):
    table, _ = _resident_header(model)
    name = next(k for k in table if k.endswith("norm.weight"))
    flip(model / "model.safetensors", table[name] + 1)
    report = verify(model, progress=False)
    assert report.problems == [
        f"{model / 'model.safetensors'}: its SHA-256 differs from the one edge0.json records"
    ]
    with pytest.raises(ModelDataError, match="model.safetensors: does not match the checksum"):
        generate(model)


def _resident_header(model) -> tuple[dict[str, int], int]:
    """Each resident tensor's absolute data offset, and the header's length."""
    with open(model / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items()}, n


def swap_in_header(path, a: str, b: str) -> None:
    """Swap two tensor names in a safetensors header (same length, so nothing moves)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].decode()
    assert len(a) == len(b) and a in text and b in text
    text = text.replace(a, "\0").replace(b, a).replace("\0", b)
    path.write_bytes(raw[:8] + text.encode() + raw[8 + n :])


def test_two_layers_swapped_in_the_experts_header_are_named(model):
    swap_in_header(model / "experts.safetensors", tensor_name(0), tensor_name(2))
    quick = verify(model, quick=True, progress=False)
    assert any("layer 0's extents at offset" in p for p in quick.problems), quick.problems
    with pytest.raises(ModelDataError, match="the header is damaged"):
        generate(model)


def test_two_layers_swapped_in_the_resident_header_are_named(model):
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.2.input_layernorm.weight"
    swap_in_header(model / "model.safetensors", a, b)
    assert not verify(model, progress=False).ok
    with pytest.raises(ModelDataError, match="model.safetensors: does not match"):
        generate(model)


def test_a_damaged_relayout_copy_is_named_removed_and_rebuilt(pristine, tmp_path):
    other = next(name for name in LAYOUTS if name != host_layout().name)
    model = tmp_path / "other"
    convert(pristine.parent / "hf", model, progress=False, int4=other)
    cache = tmp_path / "cache"
    want = generate(model, cache_dir=cache)
    (copy,) = (cache / "relayout").iterdir()
    assert verify(model, cache_dir=cache, progress=False).ok
    table, size, _ = read_table(copy)
    flip(copy, table[LAYER].offset + EXPERT * size + 100)
    report = verify(model, cache_dir=cache, progress=False)
    assert report.problems == [f"{copy}: layer {LAYER} expert {EXPERT} does not match its checksum"]
    with pytest.raises(ModelDataError, match="relayout copy does not match .* removed"):
        generate(model, cache_dir=cache)
    assert not copy.exists()
    assert generate(model, cache_dir=cache) == want  # written again, and right
    assert verify(model, cache_dir=cache, progress=False).ok


def test_non_finite_logits_are_a_named_error_never_an_end_of_text(model):
    """Weights that hold a NaN where no checksum looks (here the final norm, changed in
    memory after load): the logits are NaN, and the request fails naming the likely cause
    instead of sampling token 0, the end of text."""
    engine = load_engine(model, EngineOptions(io_mode="buffered"))
    try:
        with torch.no_grad():
            engine.model.backbone.norm.weight[3] = float("nan")
        gen = engine.generate(engine.tokenizer.encode("def add(a, b):"), 8, GREEDY)
        with pytest.raises(NonFiniteLogits, match="non-finite logits .*`edge0 verify`"):
            gen.drain()
        assert gen.tokens == []
        assert engine.pool.available() == engine.pool.num_slots
    finally:
        engine.close()


def test_the_cli_says_what_is_damaged_and_exits_non_zero(model):
    damaged_extent(model, "scale byte")
    cmd = [sys.executable, "-m", "edge0"]
    out = subprocess.run(cmd + ["verify", str(model)], capture_output=True, text=True)
    assert out.returncode == 1 and f"layer {LAYER} expert {EXPERT}" in out.stdout, out.stdout
    gen = cmd + ["generate", str(model), "--prompt", "def", "--max-tokens", "4"]
    out = subprocess.run(gen, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert f"edge0: error: {model}" in out.stderr and "edge0 verify" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_server_answers_a_damaged_expert_with_a_500_and_stays_up(model):
    import httpx

    from edge0.server.app import ServerOptions, create_app
    from test_server import live_server

    table, size, _ = read_table(model / "experts.safetensors")
    poke(model / "experts.safetensors", table[LAYER].offset, bytes(size * table[LAYER].count))
    engine = load_engine(model, EngineOptions(io_mode="buffered", preload=False))
    try:
        with live_server(create_app(engine, ServerOptions(model_name="tiny"))) as url:
            body = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
            for _ in range(2):  # each time: the expert is read again and found damaged again
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 500, r.text
                err = r.json()["error"]
                assert err["type"] == "server_error" and f"layer {LAYER} expert" in err["message"]
                assert "edge0 verify" in err["message"]
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        engine.close()


# -- bad input: a named error, never a traceback, a hang or an allocation first -----------------


def edge0_cli(*args, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge0", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def set_config(model, **values) -> None:
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | values))


@pytest.mark.parametrize(
    "values, message",
    [
        ({"num_hidden_layers": 1_000_000}, "num_hidden_layers is 1000000, but model.safetensors"),
        ({"num_hidden_layers": 300}, "num_hidden_layers is 300, but model.safetensors holds"),
        ({"hidden_size": "64"}, "hidden_size must be int, got '64'"),
        ({"rms_norm_eps": 1e30}, "rms_norm_eps must be between 0 and 1"),
        ({"moe_intermediate_size": 32}, "moe_intermediate_size is 32, but edge0.json"),
    ],
    ids=["a million layers", "layers the files lack", "a string size", "eps", "expert width"],
)
def test_a_bad_config_is_named_before_anything_is_built(model, values, message):
    set_config(model, **values)
    with pytest.raises(ValueError, match=message):
        load_engine(model, EngineOptions(io_mode="buffered"))
    out = edge0_cli("generate", model, "--prompt", "def", "--max-tokens", "2")
    assert out.returncode == 2 and message.split(" is ")[0] in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_special_file_where_a_file_belongs_is_named_not_waited_on(model):
    (model / "experts.safetensors").unlink()
    os.mkfifo(model / "experts.safetensors")  # reading it would block until a writer came
    out = edge0_cli("generate", model, "--prompt", "def", "--max-tokens", "2", timeout=60)
    assert out.returncode == 2 and "is a FIFO, not a regular file" in out.stderr, out.stderr
    (model / "experts.safetensors").unlink()
    (model / "experts.safetensors").mkdir()
    out = edge0_cli("verify", model)
    assert out.returncode == 1 and "not a regular file" in out.stdout, out.stdout


def test_a_file_that_cannot_be_read_is_one_line_with_its_path(model):
    """EACCES (root without the capabilities that bypass file modes), a damaged tokenizer."""
    (model / "model.safetensors").chmod(0o000)
    no_override = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    no_override += ["--inh-caps=-dac_override,-dac_read_search", sys.executable, "-m", "edge0"]
    out = subprocess.run(
        [*no_override, "generate", str(model), "--prompt", "def", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert f"edge0: error: {model / 'model.safetensors'}: Permission denied" in out.stderr
    (model / "model.safetensors").chmod(0o644)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    out = edge0_cli("generate", model, "--prompt", "def", "--max-tokens", "2")
    assert out.returncode == 2 and "the tokenizer (tokenizer.json" in out.stderr, out.stderr
    assert "cannot be loaded" in out.stderr and "Traceback" not in out.stderr


def test_convert_refuses_a_disk_without_room_before_writing(pristine, tmp_path):
    """A 64 KiB file system (tmpfs, mounted here) cannot hold the converted model: convert
    says how much it needs and how much is free, and leaves nothing behind."""
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)])
    if mount.returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = edge0_cli("convert", pristine.parent / "hf", small / "e0")
        assert out.returncode == 2, out.stderr
        assert f"edge0: error: {small}: the converted model needs" in out.stderr
        assert "are free there" in out.stderr and "Traceback" not in out.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


# -- adapters bound to their base ----------------------------------------------------------------


def rewrite_meta(path, **changes) -> None:
    """An adapter file with its metadata changed (None removes a key), tensors kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    save_file(tensors, str(path), metadata=meta)


def builtin_copy(tmp_path):
    from edge0 import builtin

    out = tmp_path / "builtin"
    shutil.copytree(builtin.model_dir(), out)
    return out


def test_heads_for_another_base_or_k_are_refused_unless_asked(tmp_path, caplog):
    import logging

    model = builtin_copy(tmp_path)
    opts = dict(io_mode="buffered", prerouter_always=True)
    with pytest.raises(ValueError, match="trained to predict K=6 experts, and K=4 is served"):
        load_engine(model, EngineOptions(top_k=4, **opts))
    load_engine(model, EngineOptions(top_k=4, prerouter_any_base=True, **opts)).close()
    heads = model / "prerouter.safetensors"
    rewrite_meta(heads, base_hash="0" * 64)
    m = Manifest.load(model)
    m.hash_files(model, ["prerouter.safetensors"])  # (the directory's record follows the file)
    m.save(model)
    with pytest.raises(ValueError, match="trained for another base .* prerouter_any_base"):
        load_engine(model, EngineOptions(**opts))
    load_engine(model, EngineOptions(prerouter_any_base=True, **opts)).close()
    rewrite_meta(heads, base_hash=None)
    m.hash_files(model, ["prerouter.safetensors"])
    m.save(model)
    with caplog.at_level(logging.WARNING, logger="edge0.modeldir"):
        for _ in range(2):
            load_engine(model, EngineOptions(**opts)).close()
    said = [r for r in caplog.records if "records no base_hash" in r.getMessage()]
    assert len(said) == 1 and "prerouter.safetensors" in said[0].getMessage()  # once


def test_a_lora_without_a_base_hash_loads_with_a_warning_once(tmp_path, caplog):
    import logging

    model = builtin_copy(tmp_path)
    rewrite_meta(model / "lora.safetensors", base_hash=None)
    m = Manifest.load(model)
    m.hash_files(model, ["lora.safetensors"])
    m.save(model)
    with caplog.at_level(logging.WARNING, logger="edge0.modeldir"):
        for _ in range(2):
            engine = load_engine(model, EngineOptions(io_mode="buffered"))
            assert engine.lora_meta and "base_hash" not in engine.lora_meta
            engine.close()
    said = [r for r in caplog.records if "records no base_hash" in r.getMessage()]
    assert len(said) == 1 and "lora.safetensors" in said[0].getMessage()
    assert "serve worse text without an error" in said[0].getMessage()
