"""The artefact cache as a user sees it: each cached build with its size and dates, and deleting them.

Deleting is confined to the folders directly inside the cache root: a symlink there (or one inside an entry)
is never followed, so nothing outside the cache is touched. An entry a running Eddy (the app, `eddy serve`,
`eddy chat`) has open is held with a shared lock on its manifest (`hold`): deleting it is refused. Where
locks do not exist (no fcntl) an entry is simply deleted, which a running process survives on POSIX (its
open files live until closed) and which only costs a rebuild at its next start.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..config import AUTO_DTYPE, AUTO_KV_DTYPE, BuildSettings, auto_kv_dtype
from ..errors import EddyError
from .store import BUILT_FILES, MANIFEST, artefacts_root, remove_stale_staging, staging_alive
from .progress import megabytes

try:
    import fcntl
except ImportError:  # Windows: no in-use detection
    fcntl = None  # type: ignore[assignment]

KEY = re.compile(r"-([0-9a-f]{20})(?:\.building-(\d+))?$")
# artefact_dir's name: model, dtype, sinks+window, key; what is known of a folder without a manifest.
NAME = re.compile(r"^(?P<model>.+)-(?P<dtype>[a-z0-9]+)-(?P<sinks>\d+)\+(?P<window>\d+)-[0-9a-f]{20}")
MIN_PREFIX = 4  # shortest key prefix `eddy cache rm` accepts: fewer would match by accident


class CacheError(EddyError):
    """A cache entry cannot be found or deleted."""


@dataclass(frozen=True)
class CacheEntry:
    folder: Path
    key: str  # the artefact key (20 hex digits), "" when the folder name carries none
    model: str  # from the manifest, else from the folder's name
    settings: dict = field(default_factory=dict)
    size: int = 0  # bytes on disk
    built: float = 0.0  # seconds since the epoch
    last_used: float = 0.0
    state: str = "ready"  # "ready", "damaged" (no usable manifest or files), "building" (a build writing it)
    in_use: bool = False

    @property
    def name(self) -> str:
        return self.folder.name

    def summary(self) -> str:
        if self.settings:
            return settings_summary(self.settings)
        named = NAME.match(self.name)
        return f"{named['dtype']}, {named['sinks']} sinks + {named['window']} window" if named else "?"


def settings_summary(settings: dict) -> str:
    """The build settings in a few words, the defaults left out: "q8, 4 sinks + 1020 window, cpu"."""
    d = BuildSettings().to_dict()
    s = {**d, **settings}
    parts = [str(s["dtype"]), f"{s['sinks']} sinks + {s['window']} window"]
    if s["max_sinks"] and s["max_sinks"] > s["sinks"]:
        parts.append(f"{s['max_sinks']} sink slots")
    if s["max_chunk"] != d["max_chunk"]:
        parts.append(f"chunk {s['max_chunk']}")
    own = auto_kv_dtype(s["dtype"], AUTO_DTYPE, s["device"]) if s["dtype"] in AUTO_KV_DTYPE else None
    if s["kv_dtype"] not in (AUTO_DTYPE, own):  # named only when not what "auto" gives
        parts.append(f"KV cache {s['kv_dtype']}")
    if s["device"] in ("cuda", "vulkan"):
        parts.append(f"{s['device']} {s['gpu_target']}".strip())
    else:
        parts.append(str(s["device"]) if s["target_cpu"] == "host" or s["device"] != "cpu" else f"cpu {s['target_cpu']}")
    return ", ".join(parts)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)  # lstat: a symlink to a folder is not one
    except OSError:
        return False


def disk_bytes(folder: Path) -> int:
    """Bytes the folder's files take on disk (allocated blocks: a sparse file counts what it holds), without
    following symlinks."""
    total = 0
    for dirpath, dirs, files in os.walk(folder, followlinks=False):
        for name in files + dirs:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += getattr(st, "st_blocks", 0) * 512 or st.st_size
    return total


def _read(folder: Path) -> tuple[dict | None, str]:
    """(manifest, state) without hashing: a listing must stay quick however large the entries."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None, "damaged"
    files = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    if set(files) != set(BUILT_FILES):
        return manifest if isinstance(manifest, dict) else None, "damaged"
    for name, expected in files.items():
        try:
            if (folder / name).stat().st_size != expected.get("size"):
                return manifest, "damaged"
        except OSError:
            return manifest, "damaged"
    return manifest, "ready"


def entry(folder: Path) -> CacheEntry:
    match = KEY.search(folder.name)
    key = match.group(1) if match else ""
    if match and match.group(2):
        state = "building" if staging_alive(folder) else "damaged"  # a build that died leaves its staging folder
        manifest = None
    else:
        manifest, state = _read(folder)
    named = NAME.match(folder.name)
    model = str((manifest or {}).get("model") or (named["model"] if named else folder.name))
    settings = (manifest or {}).get("settings") or {}
    built = last_used = 0.0
    try:
        built = os.lstat(folder).st_mtime
        last_used = os.stat(folder / MANIFEST).st_mtime
    except OSError:
        last_used = built
    return CacheEntry(folder, key, model, settings if isinstance(settings, dict) else {}, disk_bytes(folder),
                      built, last_used, state, state == "ready" and in_use(folder))


def list_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every folder in the cache root (symlinks left out), the most recently used first."""
    root = root or artefacts_root()
    if not root.is_dir():
        return []
    remove_stale_staging(root)  # a killed build's leftovers are no one's entry: gone before anyone sees them
    found = [entry(p) for p in root.iterdir() if _is_real_dir(p)]
    return sorted(found, key=lambda e: (e.last_used, e.name), reverse=True)


def find(spec: str, root: Path | None = None) -> CacheEntry:
    """The one entry `spec` names: its folder name or path, or a prefix of its key (at least MIN_PREFIX digits)."""
    entries = list_entries(root)
    spec = spec.strip()
    exact = [e for e in entries if spec in (e.name, str(e.folder))]
    if exact:
        return exact[0]
    prefix = spec.lower()
    matches = [e for e in entries if e.key and len(prefix) >= MIN_PREFIX and e.key.startswith(prefix)] \
        if re.fullmatch(r"[0-9a-f]+", prefix) else []
    # A key names a built entry; a build of the same key in progress beside it must not make it ambiguous.
    built = [e for e in matches if not KEY.search(e.name).group(2)]
    matches = built or matches
    if len(matches) == 1:
        return matches[0]
    if matches:
        names = ", ".join(e.name for e in matches)
        raise CacheError(f'"{spec}" matches {len(matches)} cached builds ({names}): give more of the key')
    if re.fullmatch(r"[0-9a-f]+", prefix) and len(prefix) < MIN_PREFIX:
        raise CacheError(f'"{spec}" is too short a key: give at least {MIN_PREFIX} of its digits '
                         f"(eddy cache list shows them)")
    raise CacheError(f'no cached build matches "{spec}" in {root or artefacts_root()} (eddy cache list shows them)')


def remove(e: CacheEntry, root: Path | None = None) -> int:
    """Deletes the entry's folder; returns the bytes freed. CacheError if it is in use, being built, or not a
    folder directly inside the cache root."""
    root = (root or artefacts_root()).resolve()
    folder = e.folder
    if folder.parent.resolve() != root or not _is_real_dir(folder):
        raise CacheError(f"{folder} is not a folder inside the artefact cache {root}: not deleted")
    if e.state == "building":
        raise CacheError(f"{folder.name} is being built right now: not deleted (cancel the build first)")
    lock = _open_lock(folder)
    try:
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheError(f"{folder.name} ({e.model}) is loaded by a running Eddy (the app, eddy serve or "
                                 f"eddy chat): not deleted. Close it, or load another model, first.") from None
        # Held while deleting, so no Eddy starts on the entry half deleted. rmtree never follows symlinks.
        shutil.rmtree(folder)
    finally:
        if lock is not None:
            lock.close()
    return e.size


def _open_lock(folder: Path) -> IO[bytes] | None:
    if fcntl is None:
        return None
    path = folder / MANIFEST
    if path.is_symlink():
        return None
    try:
        return open(path, "rb")
    except OSError:
        return None  # no manifest: nothing can have it loaded


def hold(folder: Path) -> IO[bytes] | None:
    """A shared lock on the entry, for as long as the returned file stays open: `remove` then refuses it.
    Never blocks (an entry being deleted just loads without one)."""
    lock = _open_lock(folder)
    if lock is None:
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    return lock


def in_use(folder: Path) -> bool:
    """Whether some process (this one included) holds the entry (see `hold`)."""
    lock = _open_lock(folder)
    if lock is None:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        lock.close()
    return False


def total_bytes(entries: list[CacheEntry]) -> int:
    return sum(e.size for e in entries)


def describe_total(entries: list[CacheEntry], root: Path | None = None) -> str:
    n = len(entries)
    return f"{n} cached build{'s' if n != 1 else ''}, {megabytes(total_bytes(entries))} in {root or artefacts_root()}"
