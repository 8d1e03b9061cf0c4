"""Shared fixtures: one real compiled tiny random module per family and build setting, built once per session."""
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


def _pin_settings() -> BuildSettings:
    from dataclasses import replace

    from engine.config import PIN_SLOTS

    return replace(TINY_SETTINGS, max_sinks=PIN_SLOTS)


# The tests' build with the sink slots of a pinning build (the app's, with the pinning setting on).
PIN_SETTINGS = _pin_settings()


@pytest.fixture(scope="session")
def tiny_pinning():
    """LoadedModel for tiny-random with PIN_SETTINGS (one build shared by the engine, session and app tests)."""
    from engine.loader import open_model

    return open_model("tiny-random", PIN_SETTINGS)


@pytest.fixture(scope="session")
def tiny():
    """LoadedModel for tiny-random (f32, capacity 64, prefill chunks of at most 16)."""
    from engine.loader import open_model

    return open_model("tiny-random", TINY_SETTINGS)


@pytest.fixture(scope="session")
def tiny_reference():
    """(HF config dict, float32 state dict) of tiny-random, for torch references."""
    from engine.checkpoint import load_state_dict, read_config, resolve_model

    source = resolve_model("tiny-random")
    return read_config(source), load_state_dict(source)


# The families Eddy runs, each with its tiny random model (tests/test_engine.py runs its parity and eviction
# tests on every one). Llama's is the `tiny` module above.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def tiny_name(family: str) -> str:
    return "tiny-random" if family == "llama" else f"tiny-random-{family}"


@pytest.fixture(scope="session", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def family_model(family, request):
    """LoadedModel of the family's tiny random model, TINY_SETTINGS (one build per family and session)."""
    if family == "llama":
        return request.getfixturevalue("tiny")
    from engine.loader import open_model

    return open_model(tiny_name(family), TINY_SETTINGS)


@pytest.fixture(scope="session")
def family_reference(family, request):
    """(read_config dict, float32 HF state dict) of the family's tiny random model."""
    if family == "llama":
        return request.getfixturevalue("tiny_reference")
    from engine.checkpoint import load_state_dict, read_config, resolve_model

    source = resolve_model(tiny_name(family))
    return read_config(source), load_state_dict(source)


@pytest.fixture(scope="session")
def family_hf(family_reference):
    """transformers' own model class of the family (e.g. Qwen2ForCausalLM) holding the same weights."""
    return transformers_model(*family_reference)


def transformers_model(cfg: dict, state: dict):
    import transformers

    from engine.arch import family as family_of
    from engine.checkpoint.tiny import transformers_config

    model = getattr(transformers, family_of(cfg["model_type"]).hf_class)(transformers_config(cfg)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model


# ChatML, but the latest user message is marked wherever it stands: every new turn changes an earlier one, so
# the session rebuilds the cache on its own each turn, keeping the recent messages that fit the window.
MARK_LATEST_USER = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}{% if loop.index0 == ns.last %} (latest)"
    "{% endif %}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
