#!/usr/bin/env python3
"""Per-turn chat template cost: what ChatSession asks the tokenizer for on every turn, as the chat grows.

A turn after the first costs the session two template calls: chat_delta(history, [user]) for the ids to feed,
and turn_suffix(history + [user]) for the text that closes the reply. The script plays one conversation of
--turns turns on the default model's tokenizer (its ChatML template), the way a session does, and at turn
10, 100, 500 and 1000 times those calls (median of --repeats runs).

    python bench/template_cost.py [--turns 1000] [--repeats 15] [--json FILE]

Prints a table and writes JSON (default bench/results/template-cost.json).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_info  # noqa: E402  (bench/machine.py, beside this script)

from engine.checkpoint import resolve_model, save_tokenizer  # noqa: E402
from engine.run.tokenizer import Tokenizer  # noqa: E402

CHECKPOINTS = (10, 100, 500, 1000)
USER = "Could you tell me a little more about {i}, and why it matters for the rest of the plan?"
REPLY = ("Sure. Point {i} is about keeping the work small and steady: each step is checked before the next "
         "one starts, so a mistake is cheap to find and the whole plan stays easy to follow.")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def one_turn(tok: Tokenizer, history: list[dict], user: dict) -> tuple[float, float]:
    """(chat_delta ms, turn_suffix ms) of one turn, called as ChatSession calls them."""
    delta_ms = timed(lambda: tok.chat_delta(history, [user], add_generation_prompt=True))
    suffix_ms = timed(lambda: tok.turn_suffix([*history, user]))
    return delta_ms, suffix_ms


def run(turns: int, repeats: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        save_tokenizer(resolve_model(None), Path(folder))  # the default model's tokenizer, from its GGUF
        tok = Tokenizer.from_dir(Path(folder))
    history: list[dict] = []  # the session's own list: it grows in place, turn by turn
    rows = []
    for turn in range(1, turns + 1):
        user = {"role": "user", "content": USER.format(i=turn)}
        if turn in CHECKPOINTS:
            runs = [one_turn(tok, history, user) for _ in range(repeats)]
            delta = statistics.median(r[0] for r in runs)
            suffix = statistics.median(r[1] for r in runs)
            total = statistics.median(r[0] + r[1] for r in runs)
            rows.append({"turn": turn, "messages": len(history), "chat_delta_ms": round(delta, 3),
                         "turn_suffix_ms": round(suffix, 3), "total_ms": round(total, 3)})
        elif turn > 1:
            one_turn(tok, history, user)
        history += [user, {"role": "assistant", "content": REPLY.format(i=turn)}]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=max(CHECKPOINTS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--label", default="", help="free text stored with the figures (e.g. the code measured)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "template-cost.json"))
    a = p.parse_args()
    rows = run(a.turns, a.repeats)
    cpu = cpu_info()
    print(f"chat template cost per turn, default model (ChatML), {cpu.get('Model name', cpu['machine'])}")
    print(f"{'turn':>6} {'messages':>9} {'chat_delta':>11} {'turn_suffix':>12} {'total':>9}")
    for r in rows:
        print(f"{r['turn']:>6} {r['messages']:>9} {r['chat_delta_ms']:>9.3f}ms {r['turn_suffix_ms']:>10.3f}ms "
              f"{r['total_ms']:>7.3f}ms")
    ratio = rows[-1]["total_ms"] / rows[0]["total_ms"] if len(rows) > 1 else 1.0
    print(f"turn {rows[-1]['turn']} / turn {rows[0]['turn']}: {ratio:.2f}x")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": a.label, "repeats": a.repeats, "cpu": cpu, "python": platform.python_version(),
                               "rows": rows, "last_over_first": round(ratio, 3)}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
