"""Which sources decide what an export (and so a build) holds, and their hash: part of every artefact's key and
of the kept exports' (engine/exporter/export.py). Torch-free: a warm start computes it."""
from __future__ import annotations

import hashlib
from pathlib import Path

# Source files (under engine/) whose content decides what gets compiled: editing them invalidates every entry.
# devices.py holds the iree-compile flags, arch.py the families the model is built from, irpa.py and
# weights_file.py how the weights file is laid out and filled.
# What an export's result depends on: every source of the build (a kernel generator missing from a hand-kept list
# once left its changes out of the key), the devices' flags, the families, the constants and the call shapes.
EXPORT_SOURCES = ("exporter", "checkpoint", "artefacts", "devices.py", "arch.py", "config.py", "shapes.py")


def export_sources() -> list[Path]:
    """The files EXPORT_SOURCES names (a folder: its Python files)."""
    here = Path(__file__).parents[1]
    return [p for name in EXPORT_SOURCES
            for p in (sorted((here / name).rglob("*.py")) if (here / name).is_dir() else [here / name])]


def export_code_hash() -> str:
    here = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in export_sources():
        h.update(str(path.relative_to(here)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
