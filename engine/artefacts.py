"""The artefact cache: one folder per (model, build settings, compiler, export code), built once.

A folder holds module.vmfb, weights.irpa, tokenizer.json, chat.json and manifest.json (the model config,
the settings and each file's size and hash). Finding a warm entry needs no torch: the key comes from the
model's memoised fingerprint, the settings and versions read from package metadata and our own sources.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .config import BuildSettings, ModelConfig
from .errors import ArtefactError
from .paths import cache_dir

if TYPE_CHECKING:
    from .checkpoint import ModelSource

MANIFEST = "manifest.json"
BUILT_FILES = ("module.vmfb", "weights.irpa", "tokenizer.json", "chat.json")
# Source files whose content decides what gets compiled: editing them invalidates every entry.
EXPORT_SOURCES = ("model.py", "export.py")
SAMPLE = 1 << 20  # bytes hashed at each end of a large file: catches truncation and foreign files cheaply


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def export_code_hash() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in EXPORT_SOURCES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def artefact_key(source: "ModelSource", settings: BuildSettings) -> str:
    parts = {
        "model": source.fingerprint(),
        "settings": settings.to_dict(),
        "compiler": _version("iree-base-compiler"),
        "export": export_code_hash(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def artefact_dir(source: "ModelSource", settings: BuildSettings) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[-40:]
    return cache_dir() / "artefacts" / f"{safe}-{settings.dtype}-{settings.sinks}+{settings.window}-{artefact_key(source, settings)}"


def file_digest(path: Path) -> str:
    """sha256 of the whole file when small, else of its size and first and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= 4 * SAMPLE:
            h.update(f.read())
        else:
            h.update(f.read(SAMPLE))
            f.seek(size - SAMPLE)
            h.update(f.read(SAMPLE))
    return h.hexdigest()


def read_manifest(folder: Path) -> dict:
    """The manifest of a complete, undamaged entry; ArtefactError naming the problem otherwise."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtefactError(f"no compiled model in {folder}") from None
    except (OSError, ValueError) as e:
        raise ArtefactError(f"damaged manifest in {folder}: {e}") from e
    for name, expected in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            raise ArtefactError(f"{path} is missing")
        if path.stat().st_size != expected["size"] or file_digest(path) != expected["digest"]:
            raise ArtefactError(f"{path} is damaged (size or hash differs from when it was built)")
    if set(manifest.get("files", {})) != set(BUILT_FILES):
        raise ArtefactError(f"incomplete compiled model in {folder}")
    return manifest


def ensure_artefacts(source: "ModelSource", settings: BuildSettings,
                     progress: Callable[[str, float], None] | None = None,
                     should_cancel: Callable[[], bool] | None = None) -> Path:
    """The folder of a valid entry, building it first if it is missing, stale or damaged."""
    folder = artefact_dir(source, settings)
    try:
        read_manifest(folder)
        return folder
    except ArtefactError:
        pass
    from . import export  # torch and the compiler are needed only from here on
    from .checkpoint import read_config, save_tokenizer

    cfg = ModelConfig.from_hf(read_config(source))
    staging = folder.with_name(f"{folder.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_tokenizer(source, staging)
        times = export.build(source, cfg, settings, staging, progress, should_cancel)
        manifest = {
            "model": source.name,
            "config": cfg.to_dict(),
            "settings": settings.to_dict(),
            "build_seconds": times,
            "files": {n: {"size": (staging / n).stat().st_size, "digest": file_digest(staging / n)} for n in BUILT_FILES},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(folder, ignore_errors=True)  # a damaged or partial entry
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
