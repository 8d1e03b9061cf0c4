"""Finding the models already on disk: what the Hugging Face cache, LM Studio, GPT4All, Jan and Ollama have
downloaded, and GGUF files or Hugging Face folders in folders the user names. Each is used where it lies (its
path is what `--model` takes); nothing is copied.

Whether a model can run is decided by the engine's own resolve_model, so this list never promises what a load
would refuse. Cheap and bounded, since it runs when the user asks: GGUF headers and config.json only (no torch,
no transformers), a time limit, directories visited once (no symlink loops), unreadable ones skipped.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelError

log = logging.getLogger(__name__)

SOURCES = ("hf-cache", "lmstudio", "gpt4all", "jan", "ollama", "folder")
# Deep enough for publisher/model/quant/file layouts; a user folder such as ~ is cut off by the time limit anyway.
MAX_DEPTH = 6
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$", re.IGNORECASE)  # llama.cpp's gguf-split names, on the stem
_OLLAMA_MODEL = "application/vnd.ollama.image.model"
# A digest names a blob file: anything but hex could climb out of the blobs folder.
_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")
_OLLAMA_LIBRARY = ("registry.ollama.ai", "library")
_MANIFEST_LIMIT = 1 << 20  # a manifest is a few hundred bytes; a huge file there is not one
_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


@dataclass(frozen=True)
class FoundModel:
    """A model on disk: `path` is what `--model` takes (a .gguf file, an Ollama blob or a Hugging Face folder)."""

    path: Path
    source: str  # one of SOURCES
    name: str  # for people: the file's stem, "org/name" of a Hugging Face repo, "model:tag" in Ollama
    family: str = ""  # GGUF general.architecture or config.json model_type, as the file says
    size_bytes: int = 0
    weights: str = ""  # "Q4_K_M", "Q8_0", "F16", "bf16 safetensors"; "" if unknown
    params: str = ""  # "1.2B", "135M"; "" if unknown
    runnable: bool = False
    reason: str = ""  # why it cannot run, one sentence; "" if it can

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


class ScanResult(list[FoundModel]):
    """scan's models, with where it looked (`searched`) and whether it looked everywhere (`complete` is False
    when the time limit cut the search short)."""

    def __init__(self, models: Sequence[FoundModel] = (), searched: Sequence[Path] = (), complete: bool = True):
        super().__init__(models)
        self.searched = list(searched)
        self.complete = complete


def default_roots() -> list[tuple[str, Path]]:
    """(source, folder) for every place a known app keeps its models on this machine, whether or not it exists."""
    env = os.environ.get
    home = Path.home()
    roots: list[tuple[str, Path]] = []
    hub = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE")
    hf_home = env("HF_HOME") or Path(env("XDG_CACHE_HOME") or home / ".cache") / "huggingface"
    roots.append(("hf-cache", Path(hub) if hub else Path(hf_home) / "hub"))
    roots += [("lmstudio", home / ".lmstudio" / "models"), ("lmstudio", home / ".cache" / "lm-studio" / "models")]
    data = _data_dirs(home)
    roots += [("gpt4all", d / "nomic.ai" / "GPT4All") for d in data]
    roots += [("jan", home / "jan" / "models")] + [("jan", d / "Jan" / "data" / "models") for d in data]
    ollama = env("OLLAMA_MODELS")
    roots += [("ollama", Path(ollama))] if ollama else [
        ("ollama", home / ".ollama" / "models"), ("ollama", Path("/usr/share/ollama/.ollama/models"))]
    unique: dict[Path, str] = {}
    for source, path in roots:
        unique.setdefault(path.expanduser(), source)
    return [(source, path) for path, source in unique.items()]


def _data_dirs(home: Path) -> list[Path]:
    # Where GPT4All and Jan keep their data: each platform's application-data folder.
    if sys.platform == "darwin":
        return [home / "Library" / "Application Support"]
    if sys.platform == "win32":
        return [Path(p) for p in (os.environ.get("LOCALAPPDATA"), os.environ.get("APPDATA")) if p]
    return [Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")]


def scan(roots: Sequence[Path | tuple[str, Path]] | None = None, extra_folders: Sequence[Path] = (),
         time_limit_s: float = 5.0) -> ScanResult:
    """The models in `roots` (default: default_roots(); a bare path's source is guessed from its layout) and in
    `extra_folders` (searched recursively), runnable ones first, then by name. Stops after `time_limit_s` with
    what it found so far (the result's `complete` is then False). The same file reached twice is listed once,
    but an Ollama blob is listed under each of its tags."""
    walk = _Walk(time.monotonic() + max(0.0, time_limit_s))
    places = default_roots() if roots is None else []
    for root in roots or ():
        source, path = root if isinstance(root, tuple) else (None, root)
        places.append((source or _guess_source(_absolute(path)), _absolute(path)))
    places += [("folder", _absolute(f)) for f in extra_folders]
    found: list[FoundModel] = []
    seen: set[tuple[str, str]] = set()
    for source, root in places:
        for kind, path, name in _candidates(walk, source, root):
            if walk.out_of_time():
                break
            key = (os.path.realpath(path), name if source == "ollama" else "")
            if key in seen:
                continue
            seen.add(key)
            found.append(_hf_model(path, source, name) if kind == "hf" else _gguf_model(path, source, name))
        if walk.timed_out:
            log.info("model search stopped after %.1f s: the list may be incomplete", time_limit_s)
            break
    found.sort(key=lambda m: (not m.runnable, m.name.casefold(), str(m.path)))
    return ScanResult(found, [root for _, root in places], complete=not walk.timed_out)


def _absolute(path: Path | str) -> Path:
    # Absolute, so a listed path works as --model from any folder; not resolved, so a symlink keeps its own name.
    return Path(os.path.abspath(Path(path).expanduser()))


# ------------------------------------------------------------------------------------------------------------
# Walking


class _Walk:
    """Directory listing under a deadline, each directory once (by device and inode, so symlink loops and
    folders reached from two roots end there)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.timed_out = False
        self._dirs: set[tuple[int, int]] = set()

    def out_of_time(self) -> bool:
        if not self.timed_out and time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.timed_out

    def entries(self, folder: Path) -> list[os.DirEntry] | None:
        """The folder's entries by name; None when time is up or it is unreadable, missing or already seen."""
        if self.out_of_time():
            return None
        try:
            st = os.stat(folder)
            key = (st.st_dev, st.st_ino)
            if key in self._dirs:
                return None
            self._dirs.add(key)
            with os.scandir(folder) as it:
                return sorted(it, key=lambda e: e.name)
        except OSError:
            return None

    def tree(self, root: Path, depth: int = MAX_DEPTH) -> Iterator[tuple[Path, list[os.DirEntry]]]:
        """(folder, entries) depth first, hidden folders skipped (.git, caches), `depth` levels below root."""
        stack = [(root, 0)]
        while stack:
            folder, level = stack.pop()
            entries = self.entries(folder)
            if entries is None:
                continue
            yield folder, entries
            if level < depth:
                stack.extend((Path(e.path), level + 1) for e in reversed(entries)
                             if not e.name.startswith(".") and _is_dir(e))


def _is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir()
    except OSError:
        return False


def _is_file(e: os.DirEntry) -> bool:
    try:
        return e.is_file()  # follows symlinks: the Hugging Face cache's snapshot files all are
    except OSError:
        return False


def _guess_source(root: Path) -> str:
    try:
        if (root / "manifests").is_dir() and (root / "blobs").is_dir():
            return "ollama"
        if any(p.name.startswith("models--") for p in root.iterdir()):
            return "hf-cache"
    except OSError:
        pass
    return "folder"


def _candidates(walk: _Walk, source: str, root: Path) -> Iterator[tuple[str, Path, str]]:
    """("gguf" or "hf", path, name) for each model-looking thing under root, as its source lays them out."""
    if source == "hf-cache":
        yield from _hf_cache(walk, root)
    elif source == "ollama":
        yield from _ollama(walk, root)
    elif source == "gpt4all":
        yield from _files(walk, root, depth=0)
    else:  # lmstudio (publisher/model/file.gguf), jan and user folders: any depth
        yield from _files(walk, root, hf_folders=source == "folder")


def _files(walk: _Walk, root: Path, depth: int = MAX_DEPTH, hf_folders: bool = False
           ) -> Iterator[tuple[str, Path, str]]:
    for folder, entries in walk.tree(root, depth):
        if hf_folders and _looks_hf(entries):
            yield "hf", folder, folder.name
        yield from _ggufs(entries)


def _looks_hf(entries: list[os.DirEntry]) -> bool:
    names = [e.name for e in entries]
    return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def _ggufs(entries: list[os.DirEntry]) -> Iterator[tuple[str, Path, str]]:
    for e in entries:
        lower = e.name.lower()
        # A vision projector (LM Studio keeps one beside a vision model's GGUF) is not a model to chat with.
        if not lower.endswith(".gguf") or "mmproj" in lower or not _is_file(e):
            continue
        stem = e.name[: -len(".gguf")]
        split = _SPLIT.search(stem)
        if split and int(split.group(1)) != 1:
            continue  # a split model is listed once, by its first part
        yield "gguf", Path(e.path), stem


def _hf_cache(walk: _Walk, root: Path) -> Iterator[tuple[str, Path, str]]:
    """models--org--name/snapshots/<revision>/: GGUF files (any revision: blobs are shared, so a file in two
    revisions is one file) and one Hugging Face folder per repo (the revision refs/main names, else the newest)."""
    for repo in walk.entries(root) or []:
        if not repo.name.startswith("models--") or not _is_dir(repo):
            continue
        name = repo.name[len("models--"):].replace("--", "/")
        snapshots = [Path(e.path) for e in walk.entries(Path(repo.path) / "snapshots") or [] if _is_dir(e)]
        try:
            main = (Path(repo.path) / "refs" / "main").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            main = ""
        snapshots.sort(key=lambda p: (p.name != main, -_mtime(p)))
        folder_taken = False
        for snapshot in snapshots:
            for folder, entries in walk.tree(snapshot):
                if not folder_taken and folder == snapshot and _looks_hf(entries):
                    folder_taken = True
                    yield "hf", snapshot, name
                yield from _ggufs(entries)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _ollama(walk: _Walk, root: Path) -> Iterator[tuple[str, Path, str]]:
    """manifests/<registry>/<namespace>/<model>/<tag> are JSON; their model layer's digest names the GGUF in
    blobs/ (sha256-<hex>, no extension)."""
    manifests = root / "manifests"
    for folder, entries in walk.tree(manifests, depth=3):
        for e in entries:
            parts = Path(e.path).relative_to(manifests).parts
            if len(parts) != 4 or not _is_file(e):
                continue
            digest = _ollama_model_digest(Path(e.path))
            if digest is None:
                continue
            registry, namespace, model, tag = parts
            shown = f"{model}:{tag}"
            if (registry, namespace) != _OLLAMA_LIBRARY:  # as `ollama list` names them
                shown = f"{namespace}/{shown}" if registry == _OLLAMA_LIBRARY[0] else f"{registry}/{namespace}/{shown}"
            yield "gguf", root / "blobs" / f"sha256-{digest}", shown


def _ollama_model_digest(manifest: Path) -> str | None:
    try:
        if manifest.stat().st_size > _MANIFEST_LIMIT:
            return None
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    layers = data.get("layers") if isinstance(data, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == _OLLAMA_MODEL:
            m = _DIGEST.fullmatch(str(layer.get("digest", "")))
            return m.group(1).lower() if m else None
    return None


# ------------------------------------------------------------------------------------------------------------
# Describing and checking one model


def _gguf_model(path: Path, source: str, name: str) -> FoundModel:
    from engine.checkpoint.gguf import read_gguf

    real = Path(os.path.realpath(path))
    try:
        size = real.stat().st_size
    except OSError:
        # An unfinished download (an Ollama manifest whose blob is not there yet) or a dangling symlink.
        return FoundModel(path, source, name, reason="the file is missing or cannot be read.")
    family = weights = params = ""
    parts = 1
    try:
        info = read_gguf(real)  # resolve_model reads the same path next: the parse is memoised
        family = str(info.fields.get("general.architecture") or "")
        weights, params = _gguf_weights(info), _gguf_params(info)
        parts = int(info.fields.get("split.count") or 1)
    except (ModelError, TypeError, ValueError):
        pass  # resolve_model below says what is wrong with it
    split = _SPLIT.search(path.stem)
    parts = max(parts, int(split.group(2)) if split else 1)
    if parts > 1:
        # resolve_model would take the first part alone, which holds only some of the tensors.
        reason = (f"it is split into {parts} files (-00001-of-{parts:05d}), which Eddy cannot read: merge them "
                  f"into one with llama.cpp's `llama-gguf-split --merge`.")
    else:
        reason = _refusal(path, real)
    return FoundModel(path, source, name, family, size, weights, params, not reason, reason)


def _hf_model(path: Path, source: str, name: str) -> FoundModel:
    from engine.checkpoint.hf import hf_weight_files, safetensors_header

    reason = _refusal(path, Path(os.path.realpath(path)))
    family, weights = "", "safetensors"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        family = str(config.get("model_type") or "")
        dtype = config.get("torch_dtype") or config.get("dtype")
        quant = (config.get("quantization_config") or {}).get("quant_method")
        if quant or dtype:
            weights = f"{quant or _DTYPES.get(str(dtype), dtype)} safetensors"
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        pass
    try:
        files = hf_weight_files(path)
    except ModelError:
        files = sorted(path.glob("*.safetensors"))
    size = 0
    for f in files:
        try:
            size += f.stat().st_size
        except OSError:
            pass
    params = ""
    if not reason:  # the headers were just checked; counting from them is cheap
        try:
            params = _count(sum(math.prod(e["shape"]) for f in files for e in safetensors_header(f).values()))
        except ModelError:
            pass
    return FoundModel(path, source, name, family, size, weights, params, not reason, reason)


def _refusal(path: Path, real: Path) -> str:
    """Why resolve_model refuses the model, without the file name it starts with (the list shows that); "" if
    it runs."""
    from engine.checkpoint.source import resolve_model

    try:
        resolve_model(str(path))
        return ""
    except ModelError as exc:
        message = str(exc)
    for prefix in (str(path), str(real), path.name, real.name):
        if prefix and message.startswith(prefix + ": "):
            return message[len(prefix) + 2:]
    return message


def _gguf_weights(info: Any) -> str:
    """The file's weight type as llama.cpp names it (general.file_type), else its commonest matrix type."""
    from gguf.constants import GGMLQuantizationType, LlamaFileType

    file_type = info.fields.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool):
        try:
            return LlamaFileType(file_type & ~LlamaFileType.GUESSED).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    counts: dict[int, int] = {}
    for t in info.tensors.values():
        if len(t.shape) >= 2:
            counts[t.ggml_type] = counts.get(t.ggml_type, 0) + math.prod(t.shape)
    try:
        return GGMLQuantizationType(max(counts, key=counts.__getitem__)).name if counts else ""
    except ValueError:
        return ""


def _gguf_params(info: Any) -> str:
    label = info.fields.get("general.size_label")
    if isinstance(label, str) and label.strip():
        return label.strip()
    return _count(sum(math.prod(t.shape) for t in info.tensors.values()))


def _count(n: int) -> str:
    """A parameter count as model names write it: 1.2B, 13B, 135M."""
    if n >= 1e9:
        return (f"{n / 1e9:.1f}".removesuffix(".0") if n < 1e10 else f"{n / 1e9:.0f}") + "B"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K" if n >= 1e3 else (str(n) if n else "")
