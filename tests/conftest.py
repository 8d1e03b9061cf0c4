"""Shared fixtures: one real compiled tiny-random module per build setting, built once per test session."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
# Artefacts go to a private cache unless the caller chose one (CI may keep one between steps).
os.environ.setdefault("EDDY_CACHE_DIR", tempfile.mkdtemp(prefix="eddy-test-cache-"))

from engine.config import BuildSettings  # noqa: E402

# Small window and chunk so tests reach eviction and chunking within a few hundred tokens.
TINY_SETTINGS = BuildSettings(sinks=4, window=60, dtype="f32", max_chunk=16)


@pytest.fixture(scope="session")
def tiny():
    """LoadedModel for tiny-random (f32, capacity 64, prefill chunks of at most 16)."""
    from engine.loader import open_model

    return open_model("tiny-random", TINY_SETTINGS)


@pytest.fixture(scope="session")
def tiny_reference():
    """(HF config dict, float32 state dict) of tiny-random, for torch references."""
    from engine.build.checkpoint import load_state_dict, read_config, resolve_model

    source = resolve_model("tiny-random")
    return read_config(source), load_state_dict(source)
