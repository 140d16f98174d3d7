"""Model references: what every command that takes a model accepts, resolved to a directory.

A reference is an edge0 directory; a Hugging Face or MLX directory or a GGUF file (converted
once); a Hugging Face repo id, `org/name` or `org/name@revision`, with `:QUANT` naming one GGUF
file of a repository of them (`org/name-GGUF:Q4_K_M`: only that file is fetched); or a path
inside the hub cache
(`.../models--org--name/snapshots/<commit>`). Repo ids are resolved by huggingface_hub itself,
cache first: it honours HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and the saved token, and it
downloads only what the cache lacks.

A converted model lives in edge0's cache (`$XDG_CACHE_HOME/edge0/models`), keyed by its source
(the repo id, or the directory), the revision (the snapshot's commit) and a hash of the source
files, so `edge0 serve Qwen/Qwen3-30B-A3B` converts once and then starts at once, and a new
revision or changed files convert again. `edge0 list` and `edge0 rm` manage that cache.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from edge0.util.paths import default_cache_dir

SOURCE_FILE = "source.json"  # in each cached model: where it came from
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?(:[\w.-]+)?$")
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[^/]+)/?$")


@dataclass
class Source:
    path: Path  # the directory holding the weights, or the GGUF file
    kind: str  # "edge0", "hf", "mlx" or "gguf"
    repo_id: str | None = None
    revision: str | None = None  # the snapshot's commit

    @property
    def label(self) -> str:
        return self.repo_id or str(self.path)


def models_root() -> Path:
    return default_cache_dir() / "models"


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and not Path(text).exists()


def kind_of(path: Path) -> str:
    """edge0, mlx or hf, from the directory's files (as `edge0 inspect` tells them apart)."""
    from edge0.formats.checkpoint import read_json
    from edge0.formats.mlx import detect_format

    return detect_format(path, read_json(path / "config.json", "model configuration"))


def converter(kind: str):
    """The function that converts a source of this kind into an edge0 directory."""
    if kind == "mlx":
        from edge0.convert.mlx import import_mlx

        return import_mlx
    if kind == "gguf":
        from edge0.convert.gguf import import_gguf

        return import_gguf
    from edge0.convert import convert

    return convert


def source(ref: str | Path, download: bool = True) -> Source:
    """The directory a reference names, downloaded into the hub cache if it is a repo id the
    cache lacks (and downloading is allowed: not with HF_HUB_OFFLINE)."""
    from edge0.formats.gguf import is_gguf

    text = str(ref)
    path = Path(text).expanduser()
    # a file named .gguf goes to the GGUF reader, which names what is wrong with it
    if path.is_file() and (path.suffix == ".gguf" or is_gguf(path)):
        return Source(path, "gguf", *_in_snapshot(path.parent))
    if path.is_dir():
        return Source(path, kind_of(path), *_in_snapshot(path))
    if not is_repo_id(text):
        raise FileNotFoundError(
            f"{text}: does not exist, and is not a Hugging Face repo id "
            "(org/name[@revision][:QUANT])"
        )
    text, _, quant = text.partition(":")
    repo, _, revision = text.partition("@")
    # the hub matches patterns case-sensitively; file names spell tags either way
    spellings = sorted({quant, quant.lower(), quant.upper()})
    patterns = [f"*{q}*.gguf" for q in spellings] if quant else None
    snapshot = Path(_snapshot(repo, revision or None, download, patterns))
    if quant:
        return Source(gguf_file(snapshot, quant), "gguf", repo, snapshot.name)
    if not (snapshot / "config.json").is_file() and list(snapshot.glob("*.gguf")):
        names = ", ".join(sorted(p.name for p in snapshot.glob("*.gguf")))
        raise ValueError(f"{repo} holds GGUF files ({names}); name one: {repo}:Q4_K_M, say")
    return Source(snapshot, kind_of(snapshot), repo, snapshot.name)


def _in_snapshot(folder: Path) -> tuple[str | None, str | None]:
    """(repo id, commit) where `folder` is a hub-cache snapshot, else (None, None)."""
    m = _SNAPSHOT.search(folder.resolve().as_posix())
    return (f"{m['org']}/{m['name']}", m["rev"]) if m else (None, None)


def gguf_file(snapshot: Path, quant: str) -> Path:
    """The one GGUF file of a snapshot that `quant` names (a file name, or a type tag such
    as Q4_K_M, matched case-insensitively in the file names); projector files are not
    models."""
    files = [p for p in sorted(snapshot.glob("*.gguf")) if not p.name.startswith("mmproj")]
    exact = [p for p in files if p.name == quant]
    found = exact or [p for p in files if quant.lower() in p.name.lower()]
    if len(found) != 1:
        have = ", ".join(p.name for p in files) or "none"
        what = "several" if found else "no"
        raise FileNotFoundError(f"{snapshot}: {what} GGUF files match {quant!r} (files: {have})")
    return found[0]


def _snapshot(repo: str, revision: str | None, download: bool, patterns=None) -> str:
    """The snapshot directory; with `patterns`, only the files they match are fetched."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            repo, revision=revision, local_files_only=True, allow_patterns=patterns
        )
    except LocalEntryNotFoundError:
        if not download or constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{repo}{'@' + revision if revision else ''} is not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE})"
                + (" and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "")
                + f"; run `edge0 pull {repo}` where the hub is reachable"
            ) from None
    # with the hub's own progress bars
    return snapshot_download(repo, revision=revision, allow_patterns=patterns)


def source_hash(path: Path) -> str:
    """A hash of a model directory's files (or of one GGUF file): each name with its content's
    identity (a hub snapshot's symlink target, which names the blob by its hash; else size and
    mtime)."""
    h = hashlib.sha256()
    root = path if path.is_dir() else path.parent
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        ident = f.resolve().name if f.is_symlink() else f"{f.stat().st_size}:{f.stat().st_mtime_ns}"
        h.update(f"{f.relative_to(root).as_posix()}\0{ident}\n".encode())
    return h.hexdigest()[:16]


def cache_dir_for(src: Source) -> Path:
    name = src.path.resolve().name
    if src.repo_id and src.kind == "gguf":  # a repo of GGUF files: one cache entry per file
        slug = f"{src.repo_id}--{src.path.name}".replace("/", "--")
    else:
        slug = (src.repo_id or f"local/{name}").replace("/", "--")
    where = src.revision or hashlib.sha256(str(src.path.resolve()).encode()).hexdigest()[:12]
    return models_root() / slug / f"{where}-{source_hash(src.path)}"


def resolve(ref: str | Path, progress: bool = True, download: bool = True) -> Path:
    """An edge0 directory for `ref`: itself, or its conversion in edge0's cache (converted
    now if it is not there yet)."""
    src = source(ref, download)
    if src.kind == "edge0":
        return src.path
    out = cache_dir_for(src)
    if (out / "edge0.json").is_file():
        return out
    if progress:
        print(f"edge0: converting {src.label} into {out} (once)", flush=True)
    converter(src.kind)(src.path, out, force=True, progress=progress)
    record = {"repo_id": src.repo_id, "revision": src.revision, "path": str(src.path)}
    (out / SOURCE_FILE).write_text(json.dumps({**record, "kind": src.kind}, indent=2) + "\n")
    return out


def pull(ref: str, progress: bool = True) -> Path:
    """Download (if the cache lacks it) and convert a repo id: `edge0 pull`."""
    if not is_repo_id(ref):
        raise ValueError(f"{ref}: not a Hugging Face repo id (org/name[@revision][:QUANT])")
    return resolve(ref, progress=progress, download=True)


@dataclass
class Cached:
    path: Path
    repo_id: str | None
    revision: str | None
    source: str
    nbytes: int


def cached() -> list[Cached]:
    """The converted models in edge0's cache."""
    out = []
    for d in sorted(models_root().glob("*/*")):
        if not (d / "edge0.json").is_file():
            continue
        rec = json.loads((d / SOURCE_FILE).read_text()) if (d / SOURCE_FILE).is_file() else {}
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        out.append(Cached(d, rec.get("repo_id"), rec.get("revision"), rec.get("path", ""), size))
    return out


def remove(ref: str) -> list[Path]:
    """Remove the cached conversions of a repo id (`org/name`: every revision;
    `org/name@revision`: that one) or of a cache path; returns what was removed."""
    repo, _, revision = ref.partition(":")[0].partition("@")  # every GGUF file of the repo
    gone = []
    for c in cached():
        by_id = c.repo_id == repo and (not revision or c.revision == revision)
        by_path = Path(ref).expanduser().resolve() == c.path.resolve()
        if by_id or by_path:
            shutil.rmtree(c.path)
            gone.append(c.path)
            if not any(c.path.parent.iterdir()):
                c.path.parent.rmdir()
    return gone
