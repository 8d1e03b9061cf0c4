#!/usr/bin/env python3
"""Engine benchmark: prints the table and writes bench/results/engine-<model>.json.

    python bench/bench_engine.py [--model M] [--runs 3] [--sinks 4 --window 1020 --dtype f16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.bench import run_bench  # noqa: E402
from engine.config import BuildSettings  # noqa: E402

if __name__ == "__main__":
    d = BuildSettings()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sinks", type=int, default=d.sinks)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--long-tokens", type=int, default=20_000)
    a = p.parse_args()
    name = (a.model or "smollm2-135m-instruct").replace("/", "_")
    run_bench(a.model, BuildSettings(sinks=a.sinks, window=a.window, dtype=a.dtype), a.runs,
              str(ROOT / "bench" / "results" / f"engine-{name}.json"), a.long_tokens)
