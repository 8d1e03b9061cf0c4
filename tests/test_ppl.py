"""`eddy ppl` on the real compiled tiny-random module: modes agree without eviction, streaming and window
match the torch StreamingLLM reference with eviction, the CLI keeps its JSON contract, bad input is a clear error."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY_SETTINGS
from streaming_reference import StreamingReference

TEXT = ROOT / "resources" / "texts" / "devils-dictionary.txt"
S = TINY_SETTINGS
COMMON = dict(sinks=S.sinks, window=S.window, dtype=S.dtype, max_chunk=S.max_chunk, stream=None)


def ppl(tmp_path, mode: str, **kw) -> dict:
    from engine.ppl import run_ppl

    out = tmp_path / f"{mode}-{len(kw)}.json"
    run_ppl("tiny-random", TEXT, mode, json_file=out, **{**COMMON, **kw})
    return json.loads(out.read_text())


def eddy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "ppl", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def reference_losses(tiny_reference, ids: list[int], sinks: int, window: int, chunk: int) -> np.ndarray:
    """-log p(ids[1:]) from the torch reference fed ids[:-1] in chunks of `chunk`."""
    cfg, state = tiny_reference
    ref = StreamingReference(state, cfg, sinks, window)
    out = []
    for i in range(0, len(ids) - 1, chunk):
        inputs, targets = ids[i : min(i + chunk, len(ids) - 1)], ids[i + 1 : i + chunk + 1]
        logp = torch.log_softmax(ref.feed(inputs).double(), -1)
        out.append(-logp[torch.arange(len(inputs)), torch.tensor(targets)].numpy())
    return np.concatenate(out)


def text_ids(tiny, n: int) -> list[int]:
    from engine.ppl import read_text, text_ids

    return text_ids(tiny.tokenizer, read_text(TEXT), n)


def test_all_modes_agree_without_eviction(tiny, tmp_path):
    """64 tokens fit every cache (capacity 64, dense 64): the four modes are the same computation."""
    n = S.capacity
    runs = {m: ppl(tmp_path, m, max_tokens=n, stride=1) for m in ("streaming", "window", "recompute", "dense")}
    base = runs["streaming"]
    assert base["tokens"] == n - 1 and base["positions"] == list(range(1, n)) and base["bos"]
    assert base["ppl_beyond_capacity"] is None and base["tokens_beyond_capacity"] == 0
    for mode, r in runs.items():
        assert r["mode"] == mode and r["tokens"] == n - 1 and r["positions"] == base["positions"]
        assert abs(r["ppl"] / base["ppl"] - 1) < 1e-4, (mode, r["ppl"], base["ppl"])
        assert np.abs(np.array(r["losses"]) - base["losses"]).max() < 1e-4, mode
    assert runs["window"]["build"]["sinks"] == 0 and runs["window"]["build"]["window"] == S.capacity
    assert runs["dense"]["build"]["window"] >= n and runs["recompute"]["evaluated_tokens"] == sum(range(1, n))
    # A real model would do better; still a sanity bound: a random model is about as unsure as uniform.
    assert base["ppl"] < 2 * 49152


@pytest.mark.parametrize("mode,chunk", [("streaming", 16), ("streaming", 7), ("streaming", 1), ("window", 16)])
def test_eviction_matches_torch_streaming_reference(tiny, tiny_reference, tmp_path, mode, chunk):
    """Over three capacities, per-position log-probs equal the reference of the same policy and chunking."""
    n = 3 * S.capacity + 10
    r = ppl(tmp_path, mode, max_tokens=n, chunk=chunk)
    assert r["chunk"] == chunk and r["tokens"] == n - 1 and r["tokens_beyond_capacity"] == n - S.capacity
    sinks, window = (S.sinks, S.window) if mode == "streaming" else (0, S.capacity)
    want = reference_losses(tiny_reference, text_ids(tiny, n), sinks, window, chunk)
    assert np.abs(np.array(r["losses"]) - want).max() < 1e-4
    assert abs(r["ppl"] / math.exp(want.mean()) - 1) < 1e-4


def test_recompute_scores_each_stride_from_a_fresh_window(tiny, tiny_reference, tmp_path):
    n, stride, cap = 2 * S.capacity + 20, 37, S.capacity
    r = ppl(tmp_path, "recompute", max_tokens=n, stride=stride)
    ids = text_ids(tiny, n)
    assert r["positions"] == list(range(stride, n, stride)) and r["stride"] == stride
    assert r["evaluated_tokens"] == sum(min(t, cap) for t in r["positions"])
    for t, loss in zip(r["positions"], r["losses"]):
        lo = max(0, t - cap)
        want = reference_losses(tiny_reference, ids[lo : t + 1], S.sinks, S.window, S.chunk)[-1]
        assert abs(loss - want) < 1e-4, t


def test_cli_prints_the_json_contract(tiny, tmp_path):
    out = tmp_path / "losses.json"
    run = eddy("--model", "tiny-random", "--text", str(TEXT), "--sinks", str(S.sinks), "--window", str(S.window),
               "--dtype", S.dtype, "--max-chunk", str(S.max_chunk), "--mode", "streaming", "--max-tokens", "150",
               "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"ppl", "tokens", "mode", "tok_s", "chunk", "stride", "sinks", "window"} <= set(result)
    assert result["mode"] == "streaming" and result["tokens"] == 149 and result["tok_s"] > 0
    assert result["chunk"] == 16 and result["stride"] == 1 and result["sinks"] == S.sinks
    full = json.loads(out.read_text())
    assert len(full["losses"]) == len(full["positions"]) == 149
    assert abs(math.exp(np.mean(full["losses"])) / result["ppl"] - 1) < 1e-4
    assert "ppl streaming: 149/149 tokens" in run.stderr  # the progress line


def test_missing_or_empty_text_is_a_clear_error(tmp_path):
    run = eddy("--model", "tiny-random", "--text", str(tmp_path / "nope.txt"))
    assert run.returncode == 1 and "text file not found" in run.stderr and not run.stdout
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    run = eddy("--model", "tiny-random", "--text", str(empty))
    assert run.returncode == 1 and "no text to score" in run.stderr and not run.stdout


def test_ppl_imports_no_torch():
    code = "import sys, engine.ppl, engine.cli; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
