"""GGUF in: files written by llama.cpp's own converter (from the llama-cpp-python sdist, fetched
from the package registry once into ~/.cache/edge0) import into edge0 directories.

The built-in model's teacher (a trained bf16 qwen3_moe with a real tokenizer and chat template)
is the main fixture: its BF16 GGUF must import to exactly the bytes `edge0 convert` writes from
the Hugging Face directory, its tokenizer must encode as the original does, and Q8_0 and Q4_0
files must import with every class's requantization error measured honestly."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edge0 import builtin
from edge0.bench import peer_gguf
from edge0.cli import main as cli
from edge0.convert import convert
from edge0.convert.gguf import import_gguf, kind_of
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.engine.sampling import SamplingParams
from edge0.formats.extents import ExtentLayout
from edge0.formats.gguf import GGUFFile
from edge0.formats.int4_layout import by_name
from edge0.modeldir import Manifest
from edge0.text.tokenizer import load_tokenizer
from helpers import TEXT, make_hf_model

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os\n\ndef list_files("]


@pytest.fixture(scope="session")
def converter(tmp_path_factory) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, unpacked from the pinned sdist (downloaded once)."""
    version = peer_gguf.sdist_version()
    sdist = peer_gguf.default_sdist(version)
    if not sdist.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["-d", str(sdist.parent), f"{peer_gguf.DIST}=={version}"]
        subprocess.run(cmd, check=True, capture_output=True)
    return peer_gguf.converter_dir(sdist, tmp_path_factory.mktemp("llama.cpp"))


@pytest.fixture(scope="module")
def teacher(converter, tmp_path_factory):
    """(HF conversion, {type: GGUF file}) of the built-in teacher."""
    root = tmp_path_factory.mktemp("gguf")
    hf = builtin.teacher_dir()
    files = {
        t: peer_gguf.convert_hf(converter, hf, root / f"teacher.{t}.gguf", t)
        for t in ("bf16", "q8_0")
    }
    files["q4_0"] = requantize(files["bf16"], root / "teacher.q4_0.gguf", "Q4_0")
    convert(hf, root / "from-hf", progress=False)
    return root, files


def requantize(src: Path, dst: Path, qtype: str) -> Path:
    """A copy of a GGUF with every matrix in `qtype`, by gguf-py's own quantizer (ggml's
    reference algorithm; 1-D tensors stay F32, as llama-quantize leaves them)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    target = gguf.GGMLQuantizationType[qtype]
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if values.ndim < 2:
            writer.add_tensor(t.name, values.astype(np.float32))
            continue
        writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def imported(teacher, qtype: str) -> Path:
    root, files = teacher
    out = root / f"from-{qtype}"
    if not out.is_dir():
        import_gguf(files[qtype], out, progress=False)
    return out


def test_a_bf16_gguf_imports_to_the_bytes_convert_writes_from_hugging_face(teacher):
    root, _ = teacher
    out = imported(teacher, "bf16")
    for name in ("experts.safetensors", "model.safetensors"):
        assert (out / name).read_bytes() == (root / "from-hf" / name).read_bytes(), name
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, root / "from-hf"))
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "head_dim", "rope_theta", "rms_norm_eps",
                "tie_word_embeddings", "norm_topk_prob", "vocab_size"):  # fmt: skip
        assert ours[key] == theirs[key], key
    source = Manifest.load(out).source
    assert source["format"] == "gguf" and source["exact"] is True


def test_the_embedded_tokenizer_encodes_as_the_original(teacher):
    out = imported(teacher, "bf16")
    ours, original = load_tokenizer(out), load_tokenizer(builtin.teacher_dir())
    texts = [TEXT, "def f(x):\n\treturn x**2  # ünï\n", "  two  spaces\n\n\n", "日本語 ✓ 🙂"]
    texts.append("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")
    for text in texts:
        ids = original.encode(text)
        assert ours.encode(text) == ids and ours.decode(ids) == original.decode(ids)
    chat = [{"role": "user", "content": "write add"}]
    assert ours.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # llama.cpp stops on end of turn and end of text; so does the imported model
    stops = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(stops) == sorted(original.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_q8_0_is_read_exactly(teacher):
    """Independently of gguf-py: a Q8_0 block is an fp16 scale and 32 int8 values."""
    _, files = teacher
    g = GGUFFile(files["q8_0"])
    name = "blk.2.ffn_down_exps.weight"
    assert g.type_name(name) == "Q8_0"
    raw = np.asarray(g.tensors[name].data)[5].reshape(-1, 34)
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32)
    want = (scale * raw[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(g.shape(name)[1:])
    assert torch.equal(g.get(name, 5), torch.from_numpy(want))
    bf16 = GGUFFile(files["bf16"]).get(name, 5)
    assert (g.get(name, 5) - bf16).abs().max() <= bf16.abs().max() / 127  # it is that model


def layer_errors(out: Path, g: GGUFFile, layer: int) -> dict[str, tuple[float, float]]:
    """(squared error, squared norm) per expert kind of one layer, from the written extents."""
    cfg = json.loads((out / "config.json").read_text())
    manifest = Manifest.load(out)
    d, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    layout = ExtentLayout(d, i, by_name(manifest.quantization["experts"]["layout"]))
    table = manifest.experts["layers"][str(layer)]
    data = np.memmap(out / "experts.safetensors", dtype=np.uint8, mode="r")
    sums: dict[str, list[float]] = {}
    for x in range(e):
        start = table["offset"] + x * layout.nbytes
        buf = torch.from_numpy(np.array(data[start : start + layout.nbytes]))
        w13, w2 = layout.dequantize_stored(buf)
        for kind, got in (
            ("ffn_gate_exps", w13[:i]),
            ("ffn_up_exps", w13[i:]),
            ("ffn_down_exps", w2),
        ):
            ref = g.get(f"blk.{layer}.{kind}.weight", x)
            s = sums.setdefault(kind, [0.0, 0.0])
            s[0] += float((got - ref).double().square().sum())
            s[1] += float(ref.double().square().sum())
    return {k: (a, b) for k, (a, b) in sums.items()}


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_requantized_files_report_their_error_honestly(teacher, qtype):
    """The reported error of each expert class equals one recomputed from the written extents
    against the file's dequantized values (here over every layer)."""
    _, files = teacher
    out = imported(teacher, qtype)
    g = GGUFFile(files[qtype])
    rows = {(r["tensor"], r["stored"]): r for r in Manifest.load(out).source["quant_errors"]}
    kinds = {kind_of(n) for n in g.tensors}
    assert {k for k, _ in rows} == kinds  # every class of tensor is accounted for
    n_layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    totals: dict[str, list[float]] = {}
    for layer in range(n_layers):
        for kind, (err, ref) in layer_errors(out, g, layer).items():
            t = totals.setdefault(kind, [0.0, 0.0])
            t[0], t[1] = t[0] + err, t[1] + ref
    for kind, (err, ref) in totals.items():
        row = rows[(kind, "int4")]
        assert row["gguf"] == qtype.upper()
        assert row["rel_l2"] == pytest.approx(math.sqrt(err / ref), rel=1e-6)
        assert 0.01 < row["rel_l2"] < 0.2  # int4 group 64: neither exact nor broken
    assert Manifest.load(out).source["exact"] is (qtype == "q8_0")


def greedy_text(model_dir: Path, prompt: str, n: int = 24) -> list[int]:
    engine = load_engine(model_dir, EngineOptions())
    try:
        ids = engine.tokenizer.encode(prompt)
        return [t for t, _ in engine.generate(ids, n, SamplingParams(temperature=0))]
    finally:
        engine.close()


def test_qwen2_moe_shared_expert_and_biases(converter, tmp_path):
    """qwen2moe: shared expert, its [1, D] gate (stored [D] by llama.cpp? either way), q/k/v
    biases; the router does not renormalise in llama.cpp, so neither does the source here."""
    hf = make_hf_model(tmp_path / "hf", "qwen2_moe", dtype=torch.bfloat16, norm_topk_prob=False)
    gguf_file = peer_gguf.convert_hf(converter, hf, tmp_path / "q2.bf16.gguf", "bf16")
    import_gguf(gguf_file, tmp_path / "ours", progress=False)
    convert(hf, tmp_path / "ref", progress=False)
    for name in ("experts.safetensors", "model.safetensors"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["norm_topk_prob"] is False


def test_cli_converts_a_gguf_and_serves_it_by_path(teacher, tmp_path, capsys, monkeypatch):
    _, files = teacher
    assert cli.main(["convert", str(files["q4_0"]), str(tmp_path / "out"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "relative L2 error" in printed and "ffn_down_exps" in printed and "Q4_0" in printed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["generate", str(files["q8_0"]), "--prompt", "def add(a, b):", "--max-tokens", "8"]
    args += ["--temperature", "0"]
    assert cli.main(args) == 0
    first = capsys.readouterr()
    assert "converting" in first.out and "def add(a, b):" in first.out
    assert cli.main(args) == 0
    again = capsys.readouterr()
    assert "converting" not in again.out  # converted once, into edge0's cache
    assert again.out.splitlines()[-1] == first.out.splitlines()[-1]


def test_what_is_not_imported_is_named(teacher, tmp_path):
    import gguf

    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        import_gguf(not_gguf, tmp_path / "o1")
    dense = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(dense, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not one edge0 imports.*qwen3moe"):
        import_gguf(dense, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


def llama_cpp_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama.cpp's binding (the peer extra) is not installed"
    return None


def llama_cpp_greedy(path: Path, ids: list[int], n: int = 24) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False)
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == n:
            return out
    return out


@pytest.mark.skipif(llama_cpp_missing() is not None, reason=str(llama_cpp_missing()))
def test_llama_cpp_reads_the_bf16_file_as_transformers_reads_its_source(teacher):
    """The other half of the chain: llama.cpp on the GGUF decodes what transformers decodes
    from the Hugging Face directory, and edge0's import of that GGUF is byte for byte its
    conversion of the directory (above). edge0 stores int4, so its own text is transformers'
    only as far as int4's error allows (tests/test_parity.py)."""
    import transformers

    _, files = teacher
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(builtin.teacher_dir()), dtype=torch.float32
    ).eval()
    tok = load_tokenizer(builtin.teacher_dir())
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
        assert llama_cpp_greedy(files["bf16"], ids) == want.tolist(), prompt


def test_a_repository_of_gguf_files_is_named_by_its_quant(converter, tmp_path, monkeypatch):
    """`org/name:QUANT` picks one file of a GGUF repository from a hub cache written in the
    real layout, offline; the repository alone is a clear error listing its files."""
    from huggingface_hub import constants

    from edge0 import hub
    from test_hub import write_hub_repo

    hf = make_hf_model(tmp_path / "hf", dtype=torch.bfloat16)
    files = tmp_path / "files"
    files.mkdir()
    for t in ("bf16", "q8_0"):
        peer_gguf.convert_hf(converter, hf, files / f"Tiny-{t.upper()}.gguf", t)
    (files / "README.md").write_text("tiny\n")
    cache = tmp_path / "hub"
    write_hub_repo(cache, "org/Tiny-GGUF", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ValueError, match=r"holds GGUF files \(Tiny-BF16.gguf, Tiny-Q8_0.gguf\)"):
        hub.resolve("org/Tiny-GGUF", progress=False)
    with pytest.raises(FileNotFoundError, match="no GGUF files match 'Q4_K_M'"):
        hub.resolve("org/Tiny-GGUF:Q4_K_M", progress=False)
    q8 = hub.resolve("org/Tiny-GGUF:q8_0", progress=False)
    assert Manifest.load(q8).source["gguf_types"] == ["F32", "Q8_0"]
    assert hub.resolve("org/Tiny-GGUF:Q8_0", progress=False) == q8  # converted once
    bf16 = hub.resolve("org/Tiny-GGUF:BF16", progress=False)
    assert bf16 != q8 and Manifest.load(bf16).source["exact"] is True
    assert cli.main(["generate", "org/Tiny-GGUF:Q8_0", "--prompt", "x", "--max-tokens", "3"]) == 0
    assert {c.path for c in hub.cached()} == {q8, bf16}
    assert sorted(hub.remove("org/Tiny-GGUF")) == sorted([q8, bf16])
