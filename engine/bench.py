"""`eddy bench`: the engine's speed and memory figures, as a table and as JSON.

Timings are medians over `runs` repetitions; ratios are computed from figures taken in the same run.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from .build_flags import build_arguments
from .config import BuildSettings
from .loader import open_model


def _ids(n: int, seed: int) -> list[int]:
    # Ordinary-vocabulary ids; content does not change the cost of a forward pass.
    return np.random.RandomState(seed).randint(100, 40000, n).tolist()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _decode_rate(engine, logits: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    for _ in range(n):
        logits = engine.decode(int(np.argmax(logits)))
    return n / (time.perf_counter() - start), logits


def _cold_start(model: str | None, settings: BuildSettings) -> float:
    """Seconds from spawning `eddy chat --prompt` (artefacts warm) to its first token event."""
    cmd = [sys.executable, "-m", "engine.cli", "chat", "--prompt", "Hi", "--json", "--max-new-tokens", "4",
           *build_arguments(settings)]
    if model:
        cmd += ["--model", model]
    # The repository first, and whatever else the caller's path held (a runtime installed with --target).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                  os.environ.get("PYTHONPATH", "")])))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    first = None
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "token" and first is None:
            first = time.perf_counter() - start
        if event["event"] == "error":
            raise RuntimeError(event["message"])
    proc.wait()
    return first if first is not None else float("nan")


def run_bench(model: str | None, settings: BuildSettings, runs: int = 3, json_file: str | None = None,
              long_tokens: int = 20_000) -> dict[str, Any]:
    start_load = time.perf_counter()
    loaded = open_model(model, settings, progress=lambda s, f, d='': None)
    eng = loaded.engine
    cap = settings.capacity
    r: dict[str, Any] = {
        "model": loaded.source.name, "settings": eng.settings.to_dict(), "runs": runs,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "open_s": time.perf_counter() - start_load,
    }

    # Time to first token of a 30-token turn after growing history, reusing the cache.
    turn = _ids(30, 1)
    ttft: dict[str, float] = {}
    for history in (0, 1000, 4000, 8000):
        eng.reset()
        if history:
            eng.prefill(_ids(history, 2))
        ttft[str(history)] = statistics.median(_timed(lambda: eng.prefill(turn)) for _ in range(runs)) * 1e3
    r["ttft_ms_reuse"] = ttft
    hist = _ids(1000, 2)

    def recompute() -> None:
        eng.reset()
        eng.prefill(hist + turn)

    r["ttft_ms_recompute_1000"] = statistics.median(_timed(recompute) for _ in range(runs)) * 1e3
    r["ttft_ratio_4000_vs_0"] = ttft["4000"] / ttft["0"]
    r["recompute_vs_reuse_1000"] = r["ttft_ms_recompute_1000"] / ttft["1000"]

    prefill = {}
    for n in (128, 512, 1024):
        ids = _ids(n, 3)

        def fresh() -> None:
            eng.reset()
            eng.prefill(ids)

        prefill[str(n)] = n / statistics.median(_timed(fresh) for _ in range(runs))
    r["prefill_tok_s"] = prefill

    decode = {}
    for ctx in (128, 1000):
        rates = []
        for _ in range(runs):
            eng.reset()
            rate, _ = _decode_rate(eng, eng.prefill(_ids(ctx, 4)), 64)
            rates.append(rate)
        decode[str(ctx)] = statistics.median(rates)
    # Sliding: three capacities of decoding from an empty cache; the speed of each capacity-long segment.
    eng.reset()
    logits = eng.prefill(_ids(8, 5))
    segments = []
    for _ in range(3):
        rate, logits = _decode_rate(eng, logits, cap)
        segments.append(rate)
    decode["sliding_segments"] = segments
    decode["sliding_spread"] = (max(segments[1:]) - min(segments[1:])) / statistics.median(segments[1:])
    r["decode_tok_s"] = decode

    # Resident memory over a long generation (the cache is preallocated: it must not grow).
    eng.reset()
    logits = eng.prefill(_ids(8, 6))
    memory, done = {}, 0
    for mark in (2000, long_tokens):
        _, logits = _decode_rate(eng, logits, mark - done)
        done = mark
        memory[str(mark)] = _rss_mb()
    r["rss_mb"] = memory
    r["rss_growth"] = memory[str(long_tokens)] / memory["2000"] - 1

    r["cold_start_first_token_s"] = statistics.median(_cold_start(model, settings) for _ in range(runs))
    print(format_table(r))
    if json_file:
        Path(json_file).parent.mkdir(parents=True, exist_ok=True)
        Path(json_file).write_text(json.dumps(r, indent=1))
    return r


def format_table(r: dict[str, Any]) -> str:
    t = r["ttft_ms_reuse"]
    d = r["decode_tok_s"]
    rows = [
        ("model", f"{r['model']} ({r['settings']['dtype']}, {r['settings']['sinks']} sinks + {r['settings']['window']} window)"),
        *[(f"30-token turn after {h} tokens (reuse)", f"{ms:8.1f} ms") for h, ms in t.items()],
        ("30-token turn after 1000, recomputing", f"{r['ttft_ms_recompute_1000']:8.1f} ms"),
        ("  ratio 4000 vs 0 history", f"{r['ttft_ratio_4000_vs_0']:8.2f} x"),
        ("  recompute vs reuse at 1000", f"{r['recompute_vs_reuse_1000']:8.1f} x"),
        *[(f"prefill {n} tokens", f"{v:8.0f} tok/s") for n, v in r["prefill_tok_s"].items()],
        ("decode at 128 context", f"{d['128']:8.1f} tok/s"),
        ("decode at 1000 context", f"{d['1000']:8.1f} tok/s"),
        ("decode sliding, per capacity", " ".join(f"{v:.1f}" for v in d["sliding_segments"]) + " tok/s"),
        ("  spread once sliding", f"{d['sliding_spread'] * 100:8.1f} %"),
        *[(f"resident memory after {n} tokens", f"{v:8.0f} MiB") for n, v in r["rss_mb"].items()],
        ("  growth", f"{r['rss_growth'] * 100:8.1f} %"),
        ("cold start to first token (warm artefacts)", f"{r['cold_start_first_token_s']:8.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
