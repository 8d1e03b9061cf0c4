#!/usr/bin/env python3
"""GUI-worker soak: a long conversation driven through the app's real EngineHost/EngineWorker (the engine on
its QThread, queued signals, Qt offscreen), every message saved to a real chat store; RSS per turn.

    QT_QPA_PLATFORM=offscreen python bench/soak_gui.py [--turns 500] [--model smollm2-135m-instruct]
        [--max-new-tokens 24] [--json FILE]

Defaults: the default model at the default build settings (q8, sinks 4 + window 1020): the memory that
matters is the real module's, and 500 short turns slide its window many times over. Prints a table every
50 turns and a verdict: RSS after warm-up (the first 10% of turns) within 5% of its median, and its growth
from the median of turns 10-20% to the median of the last 10%. Writes JSON (default
bench/results/soak-gui-<model>.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import psutil  # noqa: E402
from PySide6.QtCore import QCoreApplication, QEventLoop, QTimer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.store import Store  # noqa: E402
from app.worker import EngineHost  # noqa: E402
from app.worker_payloads import ChatConfig  # noqa: E402
from engine.config import BuildSettings  # noqa: E402

PROMPTS = ["Hi! Who are you?", "What is the capital of France?", "Tell me a short joke.", "Why is the sky blue?",
           "Give me three names for a cat.", "What's 12 times 7?", "Summarise our chat so far.", "Thanks!",
           "Write a haiku about rivers.", "How do I boil an egg?", "Translate 'good morning' to Spanish.",
           "What did I ask you first?", "List two prime numbers.", "Describe a sunset in one sentence.",
           "ok", "Can you repeat that?", "What is Python?", "Name a planet.", "Tell me about the sea.", "Bye for now."]


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def wait_for(signals, timeout_s: float) -> tuple[str, object]:
    """Runs the Qt event loop until one of the (name, signal) pairs fires; returns (name, payload)."""
    loop, got = QEventLoop(), {}
    conns = []
    for name, sig in signals:
        def slot(*args, _name=name):
            got.setdefault("v", (_name, args[0] if len(args) == 1 else args))
            loop.quit()
        sig.connect(slot)
        conns.append((sig, slot))
    QTimer.singleShot(int(timeout_s * 1000), loop.quit)
    loop.exec()
    for sig, slot in conns:
        sig.disconnect(slot)
    if "v" not in got:
        raise TimeoutError(f"no answer from the worker within {timeout_s} s")
    return got["v"]


def main() -> int:
    d = BuildSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=500)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sinks", type=int, default=d.sinks)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out = Path(a.json or ROOT / "bench" / "results" / f"soak-gui-{a.model.replace('/', '_')}.json")

    app = QCoreApplication.instance() or QCoreApplication([])  # noqa: F841  (the event loop's owner)
    rss_start = rss_mb()
    data = Path(tempfile.mkdtemp(prefix="eddy-soak-gui-"))
    store = Store.open(data)
    conv = store.create_conversation("soak")
    host = EngineHost()
    settings = BuildSettings(sinks=a.sinks, window=a.window, dtype=a.dtype)
    chat = ChatConfig(max_new_tokens=a.max_new_tokens, overrides={"temperature": 0.7, "top_p": 0.9}, seed=0)
    host.load(a.model, settings, chat)
    name, info = wait_for([("loaded", host.worker.loaded), ("error", host.worker.error)], 900)
    if name != "loaded":
        print(f"load failed: {info}", file=sys.stderr)
        return 1
    rss_loaded = rss_mb()
    print(f"model {a.model}  settings {settings.to_dict()}  max_new_tokens {a.max_new_tokens}  "
          f"RSS {rss_start:.0f} MB at start, {rss_loaded:.0f} MB loaded", flush=True)
    print(f"{'turn':>5} {'position':>9} {'evicted':>8} {'turn s':>7} {'RSS MB':>8}", flush=True)

    rows, seq, errors = [], 0, []
    # The reply's text comes as Token events and its prompt's size as a Prefill, before the turn's Done.
    reply: list[str] = []
    prefilled: list[int] = []
    host.worker.token.connect(lambda ev, origin: reply.append(ev.text))
    host.worker.prefill.connect(lambda ev, origin: prefilled.append(ev.new_tokens))
    t0 = time.perf_counter()
    for turn in range(1, a.turns + 1):
        text = f"{PROMPTS[turn % len(PROMPTS)]} (turn {turn})"
        store.append_message(conv, seq, "user", text)
        seq += 1
        reply.clear()
        prefilled.clear()
        start = time.perf_counter()
        host.send(text)
        name, ev = wait_for([("done", host.worker.done), ("error", host.worker.error)], 600)
        secs = time.perf_counter() - start
        if name != "done":
            errors.append({"turn": turn, "error": [str(e) for e in ev]})
            continue
        done = ev[0]  # (the Done event, its Origin)
        store.append_message(conv, seq, "assistant", "".join(reply))
        seq += 1
        row = {"turn": turn, "position": done.cache.position, "evicted": done.cache.evicted,
               "tokens": done.tokens, "prefill_tokens": sum(prefilled), "turn_s": round(secs, 3),
               "rss_mb": round(rss_mb(), 1)}
        rows.append(row)
        if turn % 50 == 0 or turn == 1:
            print(f"{turn:>5} {row['position']:>9} {row['evicted']:>8} {secs:>7.2f} {row['rss_mb']:>8.1f}", flush=True)
    total_s = time.perf_counter() - t0
    host.shutdown()
    wait_for([("stopped", host.stopped)], 60)
    saved = len(store.messages(conv))
    store.close()

    n = len(rows)
    warm = max(1, n // 10)
    steady = [r["rss_mb"] for r in rows[warm:]] or [r["rss_mb"] for r in rows]
    med = statistics.median(steady)
    early = statistics.median([r["rss_mb"] for r in rows[warm: 2 * warm]] or steady)
    late = statistics.median([r["rss_mb"] for r in rows[-warm:]] or steady)
    result = {
        "model": a.model, "settings": settings.to_dict(), "turns": a.turns, "answered": n, "errors": errors,
        "max_new_tokens": a.max_new_tokens, "total_s": round(total_s, 1), "messages_saved": saved,
        "final_position": rows[-1]["position"] if rows else 0, "final_evicted": rows[-1]["evicted"] if rows else 0,
        "rss_mb_start": round(rss_start, 1), "rss_mb_loaded": round(rss_loaded, 1),
        "rss_steady": {"median": round(med, 1), "min": min(steady), "max": max(steady),
                       "max_dev_pct": round(100 * max(abs(v - med) for v in steady) / med, 2),
                       "first": steady[0], "last": steady[-1],
                       "early_median": early, "late_median": late,
                       "growth_pct": round(100 * (late - early) / early, 2)},
        "turn_s_median": round(statistics.median(r["turn_s"] for r in rows), 3) if rows else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "note": "2-core machine shared with other work: turn times are noisy"},
        "rows": rows,
    }
    r = result["rss_steady"]
    result["rss_flat_within_5pct"] = r["max_dev_pct"] <= 5.0
    print(f"\n{n}/{a.turns} turns answered in {total_s:.0f} s, {saved} messages saved, errors {len(errors)}; "
          f"final position {result['final_position']}, evicted {result['final_evicted']}")
    print(f"RSS MB after {warm} warm-up turns: median {r['median']}  min {r['min']}  max {r['max']}  "
          f"max dev {r['max_dev_pct']}%  first->last {r['first']} -> {r['last']}  "
          f"growth (turns {warm}-{2 * warm} vs last {warm}) {r['growth_pct']:+}%")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0 if not errors and saved == 2 * a.turns else 1


if __name__ == "__main__":
    sys.exit(main())
