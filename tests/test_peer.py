"""`edge0 bench --peer llama.cpp`: everything but llama.cpp is tested fast; the real thing is
a slow test that runs only where the peer extra (llama-cpp-python, gguf, matplotlib) and
llama.cpp's converter (the llama-cpp-python sdist) are installed."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from edge0.bench import peer, peer_arm, peer_gguf, peer_plot
from edge0.cli import main as cli
from edge0.convert.synth import Shape
from edge0.util import cgroup

GIB = 2**30
MODELS = {"expert_int4_bytes": 3 * GIB, "gguf_bytes": 3 * GIB}


def test_shape_defaults_to_the_issue_bench_shape_and_takes_overrides():
    assert peer.parse_shape("") == peer.BENCH_SHAPE
    assert peer.BENCH_SHAPE == Shape(
        layers=24, hidden=1024, heads=16, kv_heads=4, head_dim=64, experts=128, top_k=8,
        expert_width=512, vocab=512,
    )  # fmt: skip
    s = peer.parse_shape("layers=8, expert-width=256,top_k=4")
    assert (s.layers, s.expert_width, s.top_k, s.hidden) == (8, 256, 4, 1024)
    for bad in ("layers", "layers=eight", "depth=8"):
        with pytest.raises(ValueError, match="NAME=INT"):
            peer.parse_shape(bad)


def test_caps_are_fractions_of_the_int4_experts_or_sizes():
    experts = 3 * GIB
    caps = peer.resolve_caps(("none", "2/3", "1/3", "1.5G"), experts)
    assert caps == [("none", None), ("2/3", 2 * GIB), ("1/3", GIB), ("1.5g", 3 * GIB // 2)]
    for bad in ("1/0", "0/3", "9/1", "lots"):
        with pytest.raises(ValueError):
            peer.resolve_caps((bad,), experts)
    with pytest.raises(ValueError, match="no caps"):
        peer.resolve_caps((), experts)


def test_prerouter_run_only_when_there_are_heads(tmp_path):
    engines = ["llama.cpp", "llama.cpp-mmap", "edge0-ondemand", "edge0-bf16"]
    assert peer.engines_for(tmp_path, None) == engines
    (tmp_path / "prerouter.safetensors").write_bytes(b"")
    assert peer.engines_for(tmp_path, None)[-1] == "edge0-prerouter"
    assert peer.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def fake_run(engine, cap, r, tok_s, anon, file_, read, usage=None):
    return {
        "engine": engine,
        "cap_label": cap,
        "round": r,
        "decode_tok_s": tok_s,
        "peak_anon_bytes": anon,
        "peak_file_bytes": file_,
        "read_bytes_per_token": read,
        "cgroup_max_usage_bytes": usage,
        "load_s": 1.0,
        "cpu_busy": 1.9,
        "loadavg_1min_before": 0.5,
    }


def summary_of_fakes() -> dict:
    caps = [("none", None), ("1/3", GIB)]
    runs = [
        fake_run("llama.cpp", "none", 0, 40.0, 0.1 * GIB, 2.8 * GIB, 0),
        fake_run("llama.cpp", "none", 1, 30.0, 0.2 * GIB, 2.7 * GIB, 0),
        fake_run("llama.cpp", "none", 2, 35.0, 0.1 * GIB, 2.9 * GIB, 0),
        fake_run("llama.cpp", "1/3", 0, 0.5, 0.1 * GIB, 0.8 * GIB, 2 * GIB, 0.99 * GIB),
        fake_run("edge0-ondemand", "1/3", 0, 5.0, 0.9 * GIB, 0.1 * GIB, 50 << 20, 0.9 * GIB),
        {"engine": "llama.cpp-mmap", "killed": "...", "cap_label": "1/3", "round": 0},
        {
            "engine": "llama.cpp-mmap",
            "crashed": "crashed: SIGSEGV",
            "cap_label": "none",
            "round": 0,
        },
    ]
    return peer.summarize(runs, caps, ["llama.cpp", "llama.cpp-mmap", "edge0-ondemand"])


def test_summary_takes_medians_of_speed_and_peaks_of_memory():
    s = summary_of_fakes()
    rows = {(r["cap"], r["engine"]): r for r in s["rows"]}
    assert len(rows) == 5  # edge0 has no uncapped run here: no row, no error
    none = rows["none", "llama.cpp"]
    assert none["decode_tok_s"] == 35.0
    assert none["decode_tok_s_rounds"] == [40.0, 30.0, 35.0]
    assert none["peak_anon_bytes"] == 0.2 * GIB and none["peak_file_bytes"] == 2.9 * GIB
    assert none["cgroup_max_usage_bytes"] is None
    assert rows["1/3", "llama.cpp"]["read_bytes_per_token"] == 2 * GIB
    killed = rows["1/3", "llama.cpp-mmap"]
    assert killed["killed_rounds"] == 1 and killed["decode_tok_s"] is None
    crashed = rows["none", "llama.cpp-mmap"]  # a peer's crash is reported, not raised
    assert crashed["decode_tok_s"] is None and crashed["killed_rounds"] == 0
    assert crashed["crashed"] == ["crashed: SIGSEGV"]
    text = peer.report({**s, "models": MODELS})
    assert "| llama.cpp-mmap | OOM-killed under the cap |" in text
    assert "| none | llama.cpp-mmap | crashed: SIGSEGV |" in text


def test_plot_series_puts_the_tightest_cap_first_and_none_last():
    s = summary_of_fakes()
    assert peer_plot.cap_labels(s) == ["1/3", "none"]
    data = peer_plot.series(s)
    assert data["llama.cpp"]["tok_s"] == [0.5, 35.0]
    assert data["edge0-ondemand"]["tok_s"] == [5.0, None]
    assert data["llama.cpp"]["read_mib"] == [2048.0, 0.0]
    assert data["llama.cpp"]["file_gib"] == [0.8, 2.9]
    assert data["llama.cpp-mmap"]["tok_s"] == [None, None]
    assert data["llama.cpp-mmap"]["killed"] == ["OOM-killed", "crashed: SIGSEGV"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    s = summary_of_fakes()
    png = peer_plot.plot(s, tmp_path / "peer.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arm_instruments_read_proc_status_and_io():
    s = peer_arm.status_bytes()
    assert s["RssAnon"] > 0 and s["RssFile"] > 0 and s["VmHWM"] >= s["RssAnon"]
    assert peer_arm.read_bytes() >= 0
    with peer_arm.StatusSampler(0.001) as peaks:
        ballast = bytearray(64 << 20)  # touched: 64 MiB more anonymous memory
    assert peaks.peak_anon >= len(ballast) and peaks.samples >= 2


def test_drop_page_cache_takes_files_and_directories(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"x" * 8192)
    (tmp_path / "b.bin").write_bytes(b"y" * 8192)
    peer.drop_page_cache([tmp_path / "d", tmp_path / "b.bin"])


def test_converter_is_found_in_a_tree_or_named_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_gguf, "sdist_version", lambda: "0.0.0")
    tree = tmp_path / "sdist" / "vendor" / "llama.cpp"
    (tree / "conversion").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="gguf-py"):
        peer_gguf.converter_dir(tmp_path / "sdist", tmp_path)
    (tree / "gguf-py").mkdir()
    (tree / peer_gguf.CONVERTER).write_text("")
    assert peer_gguf.converter_dir(tmp_path / "sdist", tmp_path) == tree
    with pytest.raises(FileNotFoundError, match="pip download"):
        peer_gguf.converter_dir(tmp_path / "missing.tar.gz", tmp_path)


def test_cli_rejects_a_bad_cap_before_any_work(tmp_path, capsys):
    if importlib.util.find_spec("llama_cpp") is None:
        code = cli.main(["bench", "--peer", "llama.cpp", "--work", str(tmp_path)])
        assert code == 2
        assert "llama-cpp-python is not installed" in capsys.readouterr().err
    code = cli.main(
        ["bench", "--peer", "llama.cpp", "--shape", "layers=x", "--work", str(tmp_path)]
    )
    assert code == 2
    assert "NAME=INT" in capsys.readouterr().err


def peer_extra_missing() -> str | None:
    for mod in ("llama_cpp", "gguf", "matplotlib"):
        if importlib.util.find_spec(mod) is None:
            return f"the peer extra is not installed ({mod} missing)"
    if not peer_gguf.default_sdist(peer_gguf.installed_version()).is_file():
        return "llama.cpp's converter (the llama-cpp-python sdist) is not in ~/.cache/edge0"
    return None


@pytest.mark.slow
@pytest.mark.skipif(peer_extra_missing() is not None, reason=str(peer_extra_missing()))
def test_peer_bench_end_to_end_on_a_tiny_model(tmp_path, capsys):
    caps = "none,1G" if cgroup.available() else "none"  # the tiny model's experts are < 1 MiB
    shape = "layers=2,hidden=256,heads=4,kv_heads=2,experts=16,expert_width=128,top_k=4"
    args = ["bench", "--peer", "llama.cpp", "--work", str(tmp_path), "--shape", shape]
    args += ["--caps", caps, "--tokens", "4", "--warmup", "1", "--rounds", "1"]
    env = os.environ.get("ATEN_CPU_CAPABILITY")
    code = cli.main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads((tmp_path / "peer.json").read_text())
    engines = {(r["engine"], r["cap"]) for r in summary["rows"]}
    assert {("llama.cpp", "none"), ("edge0-ondemand", "none")} <= engines
    # every run is a number, but for a peer that crashed (llama-cpp-python 0.3.36's stock,
    # repacking path segfaults on an AMX Xeon): that is reported with its signal
    for r in summary["rows"]:
        if r["engine"].startswith("llama.cpp") and r["crashed"]:
            assert r["decode_tok_s"] is None and r["crashed"] == ["crashed: SIGSEGV"]
        else:
            assert r["decode_tok_s"] > 0, r
    assert any(r["decode_tok_s"] for r in summary["rows"] if r["engine"].startswith("llama"))
    assert summary["machine"]["ATEN_CPU_CAPABILITY"] == env
    assert (tmp_path / "peer.png").read_bytes()[:4] == b"\x89PNG"
    assert "| none | llama.cpp |" in out
