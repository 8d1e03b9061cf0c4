"""Where Eddy keeps its compiled artefacts and small memo files."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user's cache folder for Eddy ($EDDY_CACHE_DIR, else $XDG_CACHE_HOME/eddy, else ~/.cache/eddy)."""
    explicit = os.environ.get("EDDY_CACHE_DIR")
    if explicit:
        root = Path(explicit)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eddy"
    root.mkdir(parents=True, exist_ok=True)
    return root


def artefacts_root() -> Path:
    """The folder holding one folder per cached build (engine/artefacts/cache.py lists and deletes them)."""
    return cache_dir() / "artefacts"
