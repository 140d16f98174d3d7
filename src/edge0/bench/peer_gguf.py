"""llama.cpp's copy of a Hugging Face checkpoint: a Q4_0 GGUF made by llama.cpp's own tools.

`convert_hf_to_gguf.py` ships only in the llama-cpp-python source distribution (under
`vendor/llama.cpp/`, with its `conversion/` package and the `gguf-py/` tree it imports);
the installed binding carries llama.cpp's quantizer (`llama_model_quantize`). So the GGUF is
made in two steps, each by llama.cpp's code: HF safetensors -> bf16 GGUF (the converter, run
as a script), then bf16 -> Q4_0 (the quantizer, in a child process). The converter must run
against its own `gguf-py`: the PyPI `gguf` of the same version number lacks architectures
the 0.3.36 converter names (`MODEL_ARCH.DFLASH`), so importing its Qwen module fails.
The pinned PyPI `gguf` reads the result (tensor types for the report).

The converter names a byte-level BPE tokenizer's pre-tokenizer by hashing how it splits a
fixed text, and refuses a tokenizer whose hash it does not know: every tokenizer edge0
trains. Adding the hash is how llama.cpp itself takes in a new tokenizer (its
convert_hf_to_gguf_update.py); here the converter runs in a child process with the model's
class registered again (through the converter's own `ModelBase.register`) as a subclass
that answers "gpt-2" for an unknown hash, which is what edge0's tokenizer is: byte-level
BPE split by the GPT-2 pattern. Everything else, tensors included, is the converter's.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import runpy
import subprocess
import sys
import tarfile
from pathlib import Path

log = logging.getLogger(__name__)

DIST = "llama-cpp-python"
CONVERTER = "convert_hf_to_gguf.py"
INSTALL_HINT = "install the peer extra as docs/peer.md shows (pip install -e '.[peer]' ...)"
PARTS = ("conversion", "gguf-py")  # directories next to the converter that it imports


PINNED = "0.3.36"  # pyproject.toml's peer extra


def sdist_version() -> str:
    """The llama-cpp-python version whose converter to use: the installed binding's, else the
    pinned one (the converter runs without the binding)."""
    try:
        return installed_version()
    except ImportError:
        return PINNED


def installed_version() -> str:
    """The installed llama-cpp-python version; raises ImportError with the install command."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError(f"{DIST} is not installed: {INSTALL_HINT}") from e


def default_sdist(version: str) -> Path:
    """Where docs/peer.md's install command leaves the source distribution."""
    return Path.home() / ".cache" / "edge0" / f"llama_cpp_python-{version}.tar.gz"


def sdist_hint(version: str) -> str:
    return (
        f"pip download --no-deps --no-binary :all: -d {default_sdist(version).parent} "
        f"{DIST}=={version}"
    )


def converter_dir(src: Path | None, work: Path) -> Path:
    """The directory holding convert_hf_to_gguf.py, its `conversion` package and `gguf-py`.

    `src` is the llama-cpp-python sdist (.tar.gz), its unpacked tree, or a llama.cpp checkout;
    None means the sdist of the installed (else the pinned) version in ~/.cache/edge0. A
    tarball is unpacked once into `work` (only the converter's files).
    """
    version = sdist_version()
    src = Path(src) if src is not None else default_sdist(version)
    if src.is_dir():
        for root in (src, src / "vendor" / "llama.cpp"):
            if (root / CONVERTER).is_file() and all((root / p).is_dir() for p in PARTS):
                return root
        raise FileNotFoundError(f"{src}: no {CONVERTER} with {' and '.join(PARTS)} inside")
    if not src.is_file():
        raise FileNotFoundError(
            f"{src}: llama.cpp's converter ships in the {DIST} source distribution; fetch it "
            f"with `{sdist_hint(version)}` or pass --llama-cpp-src"
        )
    out = work / f"llama.cpp-converter-{src.name.removesuffix('.tar.gz')}"
    if (out / CONVERTER).is_file():
        return out
    with tarfile.open(src) as tar:
        members = []
        for m in tar.getmembers():
            _, _, rest = m.name.partition("/vendor/llama.cpp/")
            if rest == CONVERTER or rest.startswith(tuple(f"{p}/" for p in PARTS)):
                m.name = rest
                members.append(m)
        if not members:
            raise FileNotFoundError(f"{src}: no vendor/llama.cpp/{CONVERTER} inside")
        partial = out.with_name(out.name + ".partial")
        tar.extractall(partial, members=members, filter="data")
    partial.rename(out)
    return out


def bpe_pre(hf_dir: Path) -> str | None:
    """llama.cpp's pre-tokenizer name for a tokenizer.json that splits like GPT-2 (edge0's
    trained tokenizers do), else None (the converter then decides or refuses)."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    return "gpt-2" if gpt2 and tok.get("model", {}).get("type") == "BPE" else None


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def convert_hf(converter: Path, hf_dir: Path, out: Path, outtype: str) -> Path:
    """hf_dir -> out with llama.cpp's converter in a child process (`outtype`: f32, f16, bf16
    or q8_0, the types the converter writes itself); returns out."""
    pre = bpe_pre(hf_dir) or "-"
    cmd = [sys.executable, "-m", __name__, "convert", str(converter), pre]
    _run([*cmd, str(hf_dir), "--outfile", str(out), "--outtype", outtype], CONVERTER)
    return out


def make_gguf(hf_dir: Path, out: Path, work: Path, src: Path | None, threads: int) -> Path:
    """hf_dir -> out (Q4_0 GGUF) with llama.cpp's converter and quantizer; returns out."""
    converter = converter_dir(src, work)
    bf16 = out.with_name(out.stem + ".bf16.gguf")
    log.info("converting %s to %s with %s", hf_dir, bf16, converter / CONVERTER)
    convert_hf(converter, hf_dir, bf16, "bf16")
    partial = out.with_name(out.name + ".partial")
    log.info("quantizing %s to Q4_0", bf16)
    cmd = [sys.executable, "-m", __name__, "quantize", str(bf16), str(partial), str(threads)]
    _run(cmd, "llama.cpp's quantizer (llama_model_quantize, Q4_0)")
    partial.rename(out)
    bf16.unlink()
    return out


def run_converter(converter: Path, pre: str | None, args: list[str]) -> None:
    """In a child process: llama.cpp's converter as __main__ with `args`; with `pre`, the
    model class answers `pre` for a BPE tokenizer hash the converter does not know."""
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    if pre is not None:
        from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

        arch = get_model_architecture(ModelBase.load_hparams(Path(args[0]), False), ModelType.TEXT)
        base = get_model_class(arch)

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return base.get_vocab_base_pre(self, tokenizer)
            except NotImplementedError:
                log.warning("unknown BPE pre-tokenizer hash: using %r", pre)
                return pre

        ModelBase.register(arch)(
            type(
                base.__name__,
                (base,),  # the converter wants model_arch in every class's own namespace
                {"model_arch": base.model_arch, "get_vocab_base_pre": get_vocab_base_pre},
            )
        )
    sys.argv = [str(converter / CONVERTER), *args]
    runpy.run_path(str(converter / CONVERTER), run_name="__main__")


def tensor_types(path: Path) -> dict[str, str]:
    """{'ffn_down_exps': 'Q4_0', 'output.weight': 'Q6_K', ...}: what each tensor kind became."""
    import gguf

    kinds = {}
    for t in gguf.GGUFReader(path).tensors:
        # blk.{i}.ffn_down_exps.weight -> ffn_down_exps; output.weight stays as it is
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else t.name
        kinds.setdefault(kind, set()).add(t.tensor_type.name)
    return {k: "/".join(sorted(v)) for k, v in sorted(kinds.items())}


def quantize_q4_0(src: Path, dst: Path, threads: int) -> None:
    """llama.cpp's quantizer with its stock Q4_0 recipe (what `llama-quantize ... Q4_0` does)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, Q4_0) returned {rc}")


def main(argv: list[str]) -> None:
    """`convert CONVERTER_DIR PRE|- ARGS...` or `quantize SRC DST THREADS` (child processes)."""
    if len(argv) >= 3 and argv[0] == "convert":
        run_converter(Path(argv[1]), None if argv[2] == "-" else argv[2], argv[3:])
    elif len(argv) == 4 and argv[0] == "quantize":
        quantize_q4_0(Path(argv[1]), Path(argv[2]), int(argv[3]))
    else:
        sys.exit(f"usage: python -m {__name__} convert DIR PRE ARGS... | quantize SRC DST N")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main(sys.argv[1:])
