#!/usr/bin/env python3
"""Engine soak: N generated tokens in streaming mode, resident memory and decode speed per 1k tokens.

    python bench/soak_engine.py [--tokens 100000] [--model smollm2-135m-instruct] [--json FILE]

One chat turn (the default model, default build settings: q8, sinks 4 + window 1020) is answered, then the
reply simply continues: sampling (temperature 0.8, top-p 0.95, repeat penalty 1.1, seed 0) with the stop
tokens masked out, so generation never ends on its own and runs past the window again and again. Every
generated token goes through the detokeniser as in a chat. Every 1000 tokens the script records the
process's RSS and the decode rate of that block (sampling and detokenising included). The verdict:
after warm-up (the first 10% of blocks, at least 2) RSS stays within 5% of its median and per-block tok/s
within 10% of its median. Prints a table and writes JSON (default bench/results/soak-engine-<model>.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import BuildSettings  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.run.sampling import Sampler, SamplingParams  # noqa: E402

BLOCK = 1000


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def spread(values: list[float]) -> dict:
    med = statistics.median(values)
    return {
        "median": round(med, 2), "min": round(min(values), 2), "max": round(max(values), 2),
        "max_dev_pct": round(100 * max(abs(v - med) for v in values) / med, 2) if med else 0.0,
        "first": round(values[0], 2), "last": round(values[-1], 2),
        "first_to_last_pct": round(100 * (values[-1] - values[0]) / values[0], 2) if values[0] else 0.0,
    }


def main() -> int:
    d = BuildSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sinks", type=int, default=d.sinks)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out = Path(a.json or ROOT / "bench" / "results" / f"soak-engine-{a.model.replace('/', '_')}.json")

    settings = BuildSettings(sinks=a.sinks, window=a.window, dtype=a.dtype)
    rss_start = rss_mb()
    m = open_model(a.model, settings)
    engine, tok = m.engine, m.tokenizer
    rss_loaded = rss_mb()
    prompt = tok.encode_chat([{"role": "user", "content": "Tell me a very long story about a river, a town "
                                                          "and the people who live there."}], True)
    logits = engine.prefill(prompt)
    sampler = Sampler(SamplingParams(temperature=0.8, top_p=0.95, repeat_penalty=1.1, seed=0))
    recent: list[int] = []
    stop = np.array(sorted(tok.stop_ids), dtype=np.int64)
    decoder = tok.detokenizer()
    chars = 0
    blocks: list[dict] = []
    print(f"model {a.model}  settings {settings.to_dict()}  prompt {len(prompt)} tokens  "
          f"RSS {rss_start:.0f} MB at start, {rss_loaded:.0f} MB loaded", flush=True)
    print(f"{'tokens':>8} {'position':>9} {'evicted':>8} {'tok/s':>7} {'CPU ms/tok':>10} {'RSS MB':>8} {'load':>5}",
          flush=True)
    t0 = time.perf_counter()
    block_start, cpu_start = t0, time.process_time()
    for i in range(1, a.tokens + 1):
        logits = logits.copy()
        logits[stop] = -np.inf  # streaming mode: the text never ends on its own
        token = sampler.sample(logits, recent)
        recent.append(token)
        if len(recent) > 64:
            del recent[0]
        chars += len(decoder.push(token))
        logits = engine.decode(token)
        if i % BLOCK == 0:
            now = time.perf_counter()
            st = engine.stats
            row = {"tokens": i, "position": st.position, "evicted": st.evicted,
                   "tok_s": round(BLOCK / (now - block_start), 2), "rss_mb": round(rss_mb(), 1),
                   "cpu_ms_per_token": round(1e3 * (time.process_time() - cpu_start) / BLOCK, 3),
                   "load1": round(os.getloadavg()[0], 2)}
            blocks.append(row)
            print(f"{i:>8} {st.position:>9} {st.evicted:>8} {row['tok_s']:>7.1f} {row['cpu_ms_per_token']:>10.2f} "
                  f"{row['rss_mb']:>8.1f} "
                  f"{row['load1']:>5.2f}", flush=True)
            block_start, cpu_start = time.perf_counter(), time.process_time()
    chars += len(decoder.flush())
    total_s = time.perf_counter() - t0

    warm = max(2, len(blocks) // 10) if len(blocks) > 4 else 1
    steady = blocks[warm:] or blocks
    rss = spread([b["rss_mb"] for b in steady])
    tps = spread([b["tok_s"] for b in steady])
    cpu = spread([b["cpu_ms_per_token"] for b in steady])
    result = {
        "model": a.model, "settings": settings.to_dict(), "tokens": a.tokens, "block": BLOCK,
        "warmup_blocks": warm, "total_s": round(total_s, 1), "text_chars": chars,
        "rss_mb_start": round(rss_start, 1), "rss_mb_loaded": round(rss_loaded, 1),
        "rss_steady": rss, "tok_s_steady": tps, "cpu_ms_per_token_steady": cpu,
        "rss_flat_within_5pct": rss["max_dev_pct"] <= 5.0,
        "tok_s_flat_within_10pct": tps["max_dev_pct"] <= 10.0,
        "cpu_per_token_flat_within_10pct": cpu["max_dev_pct"] <= 10.0,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "note": "2-core machine shared with other work: tok/s is noisy"},
        "blocks": blocks,
    }
    print(f"\nsteady state (after {warm} warm-up blocks of {BLOCK}):")
    print(f"  RSS MB  median {rss['median']}  min {rss['min']}  max {rss['max']}  max dev {rss['max_dev_pct']}%  "
          f"first->last {rss['first']} -> {rss['last']} ({rss['first_to_last_pct']:+}%)")
    print(f"  tok/s   median {tps['median']}  min {tps['min']}  max {tps['max']}  max dev {tps['max_dev_pct']}%  "
          f"first->last {tps['first']} -> {tps['last']} ({tps['first_to_last_pct']:+}%)")
    print(f"  CPU ms/token  median {cpu['median']}  min {cpu['min']}  max {cpu['max']}  max dev {cpu['max_dev_pct']}%  "
          f"first->last {cpu['first']} -> {cpu['last']} ({cpu['first_to_last_pct']:+}%)")
    print(f"  RSS flat within 5%: {result['rss_flat_within_5pct']}   tok/s flat within 10%: "
          f"{result['tok_s_flat_within_10pct']}   total {total_s:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
