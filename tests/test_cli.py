"""`eddy` end to end, as a user runs it: the real default model answers, bad input gets a clear error."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def eddy(*args: str, stdin: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_default_model_knows_the_capital_of_france():
    """Compiles SmolLM2-135M-Instruct on first use (about two minutes), then answers greedily."""
    run = eddy("chat", "--prompt", "What is the capital of France?", "--json", "--max-new-tokens", "40")
    assert run.returncode == 0, run.stderr[-3000:]
    ev = events(run.stdout)
    answer = "".join(e["text"] for e in ev if e["event"] == "token")
    assert "Paris" in answer, answer
    assert ev[0]["event"] == "prefill" and ev[-1]["event"] == "done" and ev[-1]["stop_reason"] == "eos"


def test_interactive_chat_over_stdin_keeps_the_cache(tiny):
    run = eddy("chat", "--model", "tiny-random", "--sinks", "4", "--window", "60", "--dtype", "f32",
               "--max-new-tokens", "3", "--json", stdin="first\nsecond\n")
    assert run.returncode == 0, run.stderr[-3000:]
    prefills = [e for e in events(run.stdout) if e["event"] == "prefill"]
    assert len(prefills) == 2
    assert prefills[1]["cache"]["position"] > prefills[1]["new_tokens"]  # the first turn stayed cached


def test_unknown_model_is_a_clear_error():
    run = eddy("chat", "--model", "/no/such/model.gguf", "--prompt", "hi", "--json")
    assert run.returncode == 1
    assert "does not exist" in run.stderr or "not found" in run.stderr.lower()
    assert events(run.stdout)[-1]["event"] == "error"


def test_bad_setting_is_a_clear_error():
    run = eddy("compile", "--model", "tiny-random", "--window", "0")
    assert run.returncode == 1 and "window" in run.stderr
