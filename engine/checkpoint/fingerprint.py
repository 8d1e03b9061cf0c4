"""What identifies a model's content: sha256 over its files, memoised on disk by (path, size, mtime)."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelError
from engine.paths import cache_dir

if TYPE_CHECKING:
    from .source import ModelSource

# Bumped when the way a checkpoint maps to weights changes, so fingerprints (and whatever
# is cached under them) change too.
FINGERPRINT_VERSION = "eddy-checkpoint-1"


def fingerprint(source: "ModelSource") -> str:
    """sha256 hex identifying the model's content; file hashes are memoised on disk."""
    from .bundled import default_gguf_path, dist_version
    from .tiny import TINY_SEED, tiny_spec

    if source.kind == "tiny-random":
        h = hashlib.sha256()
        h.update(FINGERPRINT_VERSION.encode())
        h.update(b"\0" + source.kind.encode())
        # Random init can change between torch/transformers releases even with the same
        # seed, so the versions are part of what defines these weights.
        spec = {
            "spec": tiny_spec(source.name),
            "seed": TINY_SEED,
            "torch": dist_version("torch"),
            "transformers": dist_version("transformers"),
        }
        h.update(b"\0" + json.dumps(spec, sort_keys=True).encode())
        h.update(b"\0" + _of_files("gguf", [default_gguf_path()]).encode())  # the default model's tokenizer
        return h.hexdigest()
    return _of_files(source.kind, source.files())


def _of_files(kind: str, files: list[Path]) -> str:
    """A GGUF's or Hugging Face folder's fingerprint: its files' contents."""
    h = hashlib.sha256()
    h.update(FINGERPRINT_VERSION.encode())
    h.update(b"\0" + kind.encode())
    for path, digest in zip(files, file_hashes(files)):
        label = path.name if kind == "hf" else "model.gguf"
        h.update(b"\0" + label.encode() + b"\0" + digest.encode())
    return h.hexdigest()


def _memo_path() -> Path:
    return cache_dir() / "fingerprints.json"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(paths: list[Path]) -> list[str]:
    """sha256 of each file, reusing the on-disk memo while (path, size, mtime_ns) is unchanged:
    hashing ~100 MB on every start would blow the warm-start budget."""
    memo_file = _memo_path()
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    changed = False
    out: list[str] = []
    for path in paths:
        real = path.resolve()
        try:
            st = real.stat()
        except OSError as exc:
            raise ModelError(f"{path}: cannot read the file ({exc.strerror}).") from None
        key = str(real)
        entry = memo.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
        ):
            out.append(str(entry["sha256"]))
            continue
        try:
            digest = _hash_file(real)
        except OSError as exc:
            raise ModelError(f"{path}: cannot read the file ({exc.strerror}).") from None
        memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        changed = True
        out.append(digest)
    if changed:
        try:
            # Per thread too: two builds started together (a test's, a server's) each write the memo.
            tmp = memo_file.with_name(f"{memo_file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(memo, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, memo_file)  # atomic, so a concurrent reader never sees half a file
        except OSError:
            pass  # the memo is only a speed-up
    return out
