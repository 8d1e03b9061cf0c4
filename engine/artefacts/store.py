"""The artefact cache: one folder per (model, build settings, compiler, export code), built once.

A folder holds module.vmfb, weights.irpa, tokenizer.json, chat.json and manifest.json (the model config,
the settings and each file's size and hash). Finding a warm entry needs no torch: the key comes from the
model's memoised fingerprint, the settings and versions read from package metadata and our own sources.

Packaged Eddy (packaging/) also ships precompiled entries: folders under $EDDY_BUNDLED_MODELS (the frozen
app sets it to its own models/ folder). They are found by model name and settings, without the checkpoint
and without the compiler, and checked in full (sha256 of every byte) before use.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..config import AUTO_DTYPE, BuildSettings, ModelConfig, auto_kv_dtype
from ..errors import ArtefactError, ModelError
from ..paths import artefacts_root
from .export_code import export_code_hash, module_key

if TYPE_CHECKING:
    from ..checkpoint import ModelSource
    from .progress import Progress

MANIFEST = "manifest.json"
BUILT_FILES = ("module.vmfb", "weights.irpa", "tokenizer.json", "chat.json")
SAMPLE = 1 << 20  # bytes hashed at each end of a large file: catches truncation and foreign files cheaply
BUNDLED_ENV = "EDDY_BUNDLED_MODELS"  # os.pathsep-separated folders holding precompiled entries
# Modules that building an entry needs; a packaged Eddy leaves them out.
COMPILER_MODULES = ("torch", "iree.compiler", "iree.turbine")
FULL_VERSION_HINT = ("install the full version, which can compile: pip install 'eddy[compile]' "
                     "(see the README's Quick start)")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def artefact_key(source: "ModelSource", settings: BuildSettings) -> str:
    parts = {
        "model": source.fingerprint(),
        "settings": settings.for_source(source).to_dict(),  # "auto" and what it picks share one entry
        "compiler": _version("iree-base-compiler"),
        "export": export_code_hash(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def artefact_dir(source: "ModelSource", settings: BuildSettings) -> Path:
    settings = settings.for_source(source)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[-40:]
    return artefacts_root() / f"{safe}-{settings.dtype}-{settings.sinks}+{settings.window}-{artefact_key(source, settings)}"


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


def file_sha256(path: Path) -> str:
    """sha256 of every byte of the file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def seal(folder: Path) -> dict:
    """Adds each file's full sha256 to the entry's manifest (for a package, checked by read_manifest(full=True))."""
    manifest = read_manifest(folder)
    for name, entry in manifest["files"].items():
        entry["sha256"] = file_sha256(folder / name)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(folder: Path, full: bool = False) -> dict:
    """The manifest of a complete, undamaged entry; ArtefactError naming the problem otherwise.

    `full` also checks the sha256 of every byte of the files whose entry records one (sealed entries)."""
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
        if full and "sha256" in expected and file_sha256(path) != expected["sha256"]:
            raise ArtefactError(f"{path} is damaged (its sha256 differs from when it was built)")
    if set(manifest.get("files", {})) != set(BUILT_FILES):
        raise ArtefactError(f"incomplete compiled model in {folder}")
    return manifest


def mark_used(folder: Path) -> None:
    """The manifest's mtime is when the entry was last used (`eddy cache list` shows it); the folder's own
    mtime stays when it was built. A read-only entry (a package's) keeps its dates."""
    try:
        os.utime(folder / MANIFEST)
    except OSError:
        pass


def compiler_available() -> bool:
    """Whether this installation can build entries (a packaged Eddy has no torch and no compiler)."""
    for name in COMPILER_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):
            return False
    return True


def no_compiler_error(what: str) -> ModelError:
    return ModelError(f"{what} needs compiling, and this Eddy package cannot compile models (it ships only the "
                      f"precompiled default model with its default settings). To use other models or build "
                      f"settings, {FULL_VERSION_HINT}.")


def bundled_roots() -> list[Path]:
    return [Path(p) for p in os.environ.get(BUNDLED_ENV, "").split(os.pathsep) if p.strip()]


def bundled_entries() -> list[tuple[Path, dict]]:
    """(folder, manifest) of every precompiled entry under $EDDY_BUNDLED_MODELS (manifests parsed, files not
    checked yet). A root may itself be an entry or hold entries one level down."""
    found = []
    for root in bundled_roots():
        candidates = [root] if (root / MANIFEST).is_file() else sorted(p for p in root.glob("*") if p.is_dir())
        for folder in candidates:
            try:
                manifest = json.loads((folder / MANIFEST).read_text())
                found.append((folder, manifest))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                raise ArtefactError(f"The installed Eddy package is damaged: {folder / MANIFEST} cannot be read "
                                    f"({e}). Reinstall Eddy.") from e
    return found


def _same_build(a: dict, b: dict) -> bool:
    """Equal build settings, whatever CPU each was (or would be) compiled for."""
    keys = (set(a) | set(b)) - {"target_cpu"}
    defaults = BuildSettings().to_dict()
    return all(a.get(k, defaults.get(k)) == b.get(k, defaults.get(k)) for k in keys)


# Preference among entries that differ only in their target CPU: the most capable one this CPU can run.
_CPU_RANK = {"host": 5, "x86-64-v4": 4, "x86-64-v3": 3, "x86-64-v2": 2, "x86-64": 1}


def find_bundled(name: str, settings: BuildSettings) -> Path | None:
    """The packaged entry of model `name` built with `settings`, checked in full; None if there is none.

    A package may hold the same model for several CPU levels (x86-64-v3 and -v4): the highest level this CPU
    supports wins. ArtefactError naming the file if that entry is damaged; ModelError if this CPU runs none."""
    matches = [(folder, manifest) for folder, manifest in bundled_entries()
               if str(manifest.get("model", "")).lower() == name.lower()
               and _same_build(manifest.get("settings", {}), _as_built(settings, manifest))]
    if not matches:
        return None
    runnable = [(folder, m) for folder, m in matches if not _missing_cpu_flags(_target_of(m))]
    if not runnable:
        check_cpu(min(matches, key=lambda fm: _CPU_RANK.get(_target_of(fm[1]), 0))[0])  # raises, naming what lacks
    folder, _ = max(runnable, key=lambda fm: _CPU_RANK.get(_target_of(fm[1]), 0))
    try:
        read_manifest(folder, full=True)
    except ArtefactError as e:
        raise ArtefactError(f"The installed Eddy package is damaged: {e}. Reinstall Eddy.") from None
    return folder


def _as_built(settings: BuildSettings, manifest: dict) -> dict:
    """`settings` as the entry's build would have resolved them: "auto" is the entry's auto_dtype (q8 for an
    entry from before it was recorded, when q8 was every build's default), and an "auto" KV cache type that
    weight type's own."""
    wanted = settings.to_dict()
    if settings.dtype == AUTO_DTYPE:
        wanted["dtype"] = manifest.get("auto_dtype", "q8")
    wanted["kv_dtype"] = auto_kv_dtype(wanted["dtype"], settings.kv_dtype, settings.device)
    return wanted


def _target_of(manifest: dict) -> str:
    return manifest.get("settings", {}).get("target_cpu", "host")


# What each portable llvm-cpu target needs, as /proc/cpuinfo names the flags (lzcnt is "abm" there).
_CPU_FLAGS = {
    "x86-64": set(),
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
}
_CPU_FLAGS["x86-64-v3"] = _CPU_FLAGS["x86-64-v2"] | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_CPU_FLAGS["x86-64-v4"] = _CPU_FLAGS["x86-64-v3"] | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _missing_cpu_flags(target: str) -> list[str]:
    """The CPU features a module compiled for `target` needs that this CPU lacks ([] if unknown)."""
    needed = _CPU_FLAGS.get(target)
    have = _cpu_flags()
    if not needed or have is None:
        return []
    return sorted(needed - have)


def check_cpu(folder: Path) -> None:
    """A module compiled for a named CPU level dies of an illegal instruction on an older CPU: say so instead."""
    try:
        target = _target_of(json.loads((folder / MANIFEST).read_text()))
    except (OSError, ValueError):
        return  # read_manifest reports it
    missing = _missing_cpu_flags(target)
    if missing:
        raise ModelError(f"This compiled model needs a {target} CPU, and this CPU lacks {', '.join(missing)}. "
                         f"To build one for this CPU, {FULL_VERSION_HINT}.")


STAGING = re.compile(r"\.building-(\d+)$")  # a build in progress writes "<entry>.building-<its PID>"


def staging_name(folder: Path) -> Path:
    return folder.with_name(f"{folder.name}.building-{os.getpid()}")


def staging_alive(folder: Path) -> bool:
    """Whether the build that named this staging folder still runs. A PID the system has since given to a
    newer process does not count: that process started after the folder was last written."""
    match = STAGING.search(folder.name)
    if not match:
        return False
    pid = int(match.group(1))
    if pid == os.getpid():
        return True
    import psutil

    try:
        started = psutil.Process(pid).create_time()
        written = os.lstat(folder).st_mtime
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # cannot tell: leave it alone
    return started <= written + 2.0  # clock granularity between the two timestamps


def remove_stale_staging(root: Path) -> list[Path]:
    """Deletes the staging folders in the cache root whose build is gone (killed, crashed, power lost): no one
    will ever finish them, and each holds up to a whole model. Returns what was removed."""
    removed = []
    try:
        candidates = [p for p in root.iterdir() if STAGING.search(p.name)]
    except OSError:
        return removed
    for p in candidates:
        try:
            if p.is_symlink() or not p.is_dir() or staging_alive(p):
                continue
        except OSError:
            continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
    return removed


def built_module(key: str) -> Path | None:
    """The module.vmfb of a sound cache entry compiled from what `key` (export_code.module_key) names, if
    any: a model of the same shape, built with the same settings for the same device and CPU, whatever its
    weights."""
    for found in sorted(artefacts_root().glob(f"*/{MANIFEST}")):
        try:
            if json.loads(found.read_text()).get("module_key") != key:
                continue
            manifest = read_manifest(found.parent)
        except (OSError, ValueError, ArtefactError):
            continue
        vmfb = found.parent / "module.vmfb"
        if manifest.get("module_key") == key and vmfb.is_file():
            return vmfb
    return None


def takes_a_built_module(source: "ModelSource", settings: BuildSettings) -> bool:
    """Whether a build of `source` with `settings` would take a module built before (built_module): a fine-tune
    of a model built here costs its weights file, not a whole build."""
    from ..checkpoint import read_config

    cfg = ModelConfig.from_hf(read_config(source))
    return built_module(module_key(cfg, settings.for_source(source))) is not None


def ensure_artefacts(source: "ModelSource", settings: BuildSettings,
                     progress: "Progress | None" = None,
                     should_cancel: Callable[[], bool] | None = None) -> Path:
    """The folder of a valid entry, building it first if it is missing, stale or damaged.

    A build is refused before it starts (DiskSpaceError) when the disk lacks room for it. A cuda build with no
    target named is built for this machine's GPU (DeviceError when it has none)."""
    from ..gpu import resolve_target

    settings = resolve_target(settings).for_source(source)
    folder = artefact_dir(source, settings)
    try:
        read_manifest(folder)
        mark_used(folder)
        return folder
    except ArtefactError:
        pass
    if not compiler_available():
        raise no_compiler_error(f'The model "{source.name}" with these settings (sinks {settings.sinks}, window '
                                f"{settings.window}, {settings.dtype}, {settings.device})")
    from ..exporter.process import build_in_child
    from ..checkpoint import read_config

    from .room import check_room

    # An unsupported model or build, or one the disk has no room for, is refused here, before a build starts.
    cfg = ModelConfig.from_hf(read_config(source))
    cfg.check_build(settings)
    check_room(folder.parent, cfg, settings, source.name)
    remove_stale_staging(folder.parent)
    staging = staging_name(folder)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # A module built before for this shape and these settings spares the export and the compiler.
        key = module_key(cfg, settings)
        built = build_in_child(source, settings, staging, progress, should_cancel, built_module(key))
        manifest = {
            "model": source.name,
            "config": built["config"],
            "settings": settings.to_dict(),
            # What "auto" picks for this checkpoint: a packaged entry is found for it without the checkpoint.
            "auto_dtype": source.auto_dtype(),
            "build_seconds": built["seconds"],
            # A later build of a model of the same shape and settings takes this module (built_module).
            "module_key": key,
            "files": {n: {"size": (staging / n).stat().st_size, "digest": file_digest(staging / n)} for n in BUILT_FILES},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(folder, ignore_errors=True)  # a damaged or partial entry
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
