#!/usr/bin/env python3
"""GUI responsiveness: how late the Qt event loop runs while replies stream at full speed.

A precise QTimer fires every few milliseconds on the GUI thread of the real app (real window, real worker
thread, real compiled model); each firing records how late it came. Lateness is what a user feels as a
stall: a key press, a scroll or a repaint waits that long. The script sends a fixed list of prompts that
ask for long replies (plus one long pasted text, whose prefill runs in chunks on the worker) and reports
lateness percentiles per phase: idle (model loaded, nothing running), prefill (send → first token) and
decode (prefill done → reply done).

    xvfb-run -a -s "-screen 0 1600x1000x24" python bench/gui_responsiveness.py [--model M] [--json FILE]
    QT_QPA_PLATFORM=offscreen python bench/gui_responsiveness.py        (no X server: no real painting)

Prints a table and writes JSON (default bench/results/gui-responsiveness-<platform>.json).
"""
from __future__ import annotations

import argparse
import json
import platform
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE_MS = 5
STALL_MS = 20
PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a CPU cache works, with examples, in at least ten paragraphs.",
    "Write a Python module that implements a linked list with insert, delete, search and reverse, "
    "with docstrings and tests.",
    "Describe the history of the printing press and its effects on Europe, at length.",
    "List forty interesting facts about the ocean, one per line, each with a short explanation.",
]


def _paste_text(words: int) -> str:
    text = (ROOT / "resources" / "texts" / "devils-dictionary.txt").read_text(encoding="utf-8").split()
    return "Summarise this text:\n" + " ".join(text[2000:2000 + words])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarise(lateness_ms: list[float]) -> dict:
    return {"samples": len(lateness_ms),
            "p50_ms": percentile(lateness_ms, 50), "p90_ms": percentile(lateness_ms, 90),
            "p99_ms": percentile(lateness_ms, 99), "p999_ms": percentile(lateness_ms, 99.9),
            "max_ms": max(lateness_ms) if lateness_ms else float("nan"),
            "over_20ms": sum(1 for x in lateness_ms if x > 20)}


def _runqueue_ms() -> float:
    """Milliseconds this thread has spent ready to run but waiting for a core (Linux schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


class Probe:
    """Records the lateness of a repeating PreciseTimer, tagged with the phase it fell in."""

    def __init__(self) -> None:
        from PySide6.QtCore import Qt, QTimer

        self.phase = "idle"
        self.samples: dict[str, list[float]] = {}
        self.turn: list[float] = []  # this turn's prefill and decode samples
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time()
        self._last_runq = _runqueue_ms()
        # Each stall over STALL_MS, with the GUI thread's own CPU time in it: a stall the GUI thread spent
        # computing is ours to fix; one it spent waiting is the GIL or the OS giving the core to others.
        self.stalls: list[dict] = []
        self._timer = QTimer()
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(PROBE_MS)
        self._timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def set_phase(self, phase: str) -> None:
        self._tick()  # the gap so far belongs to the phase that is ending
        self.phase = phase

    def _tick(self) -> None:
        now, cpu, runq = time.perf_counter(), time.thread_time(), _runqueue_ms()
        late = max(0.0, (now - self._last) * 1000 - PROBE_MS)
        if late > STALL_MS:
            self.stalls.append({"phase": self.phase, "late_ms": late, "gui_cpu_ms": (cpu - self._last_cpu) * 1000,
                                "runqueue_ms": runq - self._last_runq})
        self._last, self._last_cpu, self._last_runq = now, cpu, runq
        self.samples.setdefault(self.phase, []).append(late)
        if self.phase in ("prefill", "decode"):
            self.turn.append(late)


def run(model: str | None, max_new_tokens: int, idle_s: float, paste_words: int, rounds: int) -> dict:
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QGuiApplication

    from app.main import main, seconds_since_process_start
    from app.settings import AppSettings, save_settings

    prompts = PROMPTS + [_paste_text(paste_words)]
    result: dict = {"turns": []}

    def drive(window) -> None:
        window.resize(1360, 860)
        c = window.controller
        probe = Probe()
        state = {"i": 0, "sent_at": 0.0, "first_at": None}

        def finish() -> None:
            probe.stop()
            result["phases"] = {k: summarise(v) for k, v in probe.samples.items()}
            result["stalls"] = probe.stalls
            result["platform"] = QGuiApplication.platformName()
            result["median_turn_p99_ms"] = statistics.median(t["p99_ms"] for t in result["turns"])
            window.close()

        def send_next() -> None:
            if state["i"] >= len(prompts) * rounds:
                finish()
                return
            probe.set_phase("prefill")
            probe.turn = []
            state.update(sent_at=time.perf_counter(), first_at=None)
            if state["i"] and state["i"] % len(prompts) == 0:
                c.new_chat()  # each round starts from an empty cache, as a user's new chat does
            c.send(prompts[state["i"] % len(prompts)])
            state["i"] += 1

        def on_prefilled(ev: dict) -> None:
            if ev.get("kind") == "turn" and state["first_at"] is None:
                state["first_at"] = time.perf_counter()
                probe.set_phase("decode")

        def on_done(ev: dict) -> None:
            probe.set_phase("between")
            result["turns"].append({"prompt_chars": len(prompts[(state["i"] - 1) % len(prompts)]),
                                    "p99_ms": percentile(probe.turn, 99), "max_ms": max(probe.turn, default=0.0),
                                    "tokens": ev.get("tokens"), "tok_s": ev.get("tok_s"),
                                    "ttft_ms": ((state["first_at"] or time.perf_counter()) - state["sent_at"]) * 1000})
            QTimer.singleShot(300, send_next)

        def on_state(s: str) -> None:
            if s == "ready":
                # From the process's start (as the OS recorded it) to a window ready to chat.
                result["ready_after_start_s"] = seconds_since_process_start()
                probe.start()
                probe.set_phase("idle")
                QTimer.singleShot(int(idle_s * 1000), send_next)
            elif s == "failed":
                result["error"] = "the model failed to load"
                window.close()

        c.model_state_changed.connect(on_state)
        c.turn_prefilled.connect(on_prefilled)
        c.turn_finished.connect(on_done)
        QTimer.singleShot(60 * 60 * 1000, window.close)  # never hang

    data = Path(tempfile.mkdtemp(prefix="eddy-guibench-"))
    # Greedy with a repeat penalty, as before the chat defaults existed: figures stay comparable across runs.
    save_settings(data, AppSettings.of(max_new_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.1))
    main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)
    return result


def print_table(result: dict) -> None:
    print(f"\nEvent-loop lateness of a {PROBE_MS} ms PreciseTimer on the GUI thread "
          f"(platform {result.get('platform')}):")
    print(f"{'phase':<9} {'samples':>8} {'p50':>7} {'p90':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'>20ms':>6}")
    for phase in ("idle", "prefill", "decode", "between"):
        s = result.get("phases", {}).get(phase)
        if s:
            print(f"{phase:<9} {s['samples']:>8} {s['p50_ms']:>7.2f} {s['p90_ms']:>7.2f} {s['p99_ms']:>7.2f} "
                  f"{s['p999_ms']:>7.2f} {s['max_ms']:>7.2f} {s['over_20ms']:>6}")
    stalls = result.get("stalls", [])
    def longest(kind: list[dict]) -> str:
        return f"{len(kind)} (longest {max((x['late_ms'] for x in kind), default=0):.1f} ms)"

    # Where the time of each stall went, by its largest part: the GUI thread computing, the GUI thread
    # ready but waiting for a core (other threads and processes), or neither (blocked: the GIL, a lock).
    kinds: dict[str, list[dict]] = {"busy": [], "runqueue": [], "blocked": []}
    for x in stalls:
        blocked = x["late_ms"] + PROBE_MS - x["gui_cpu_ms"] - x["runqueue_ms"]
        part = max(("busy", x["gui_cpu_ms"]), ("runqueue", x["runqueue_ms"]), ("blocked", blocked), key=lambda t: t[1])
        kinds[part[0]].append(x)
    print(f"\nstalls over {STALL_MS} ms: {len(stalls)}, mostly spent: computing on the GUI thread "
          f"{longest(kinds['busy'])}; waiting for a core {longest(kinds['runqueue'])}; "
          f"blocked (GIL, locks) {longest(kinds['blocked'])}")
    result["stall_causes"] = {k: len(v) for k, v in kinds.items()}
    print(f"\nstart of the process to a window ready to chat: {result['ready_after_start_s']:.2f} s")
    print("\nturns:")
    for t in result["turns"]:
        print(f"  prompt {t['prompt_chars']:>5} chars  ttft {t['ttft_ms']:>7.0f} ms  "
              f"{t['tokens']:>4} tokens at {t['tok_s']:>5.1f} tok/s  lateness p99 {t['p99_ms']:>5.1f} ms, "
              f"max {t['max_ms']:>5.1f} ms")
    print(f"\nmedian over turns of each turn's p99 lateness: {result['median_turn_p99_ms']:.2f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--idle-seconds", type=float, default=3.0)
    p.add_argument("--paste-words", type=int, default=600, help="length of the pasted-text turn")
    p.add_argument("--rounds", type=int, default=3, help="times to go through the prompts, a new chat each")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = run(a.model, a.max_new_tokens, a.idle_seconds, a.paste_words, a.rounds)
    if "error" in res:
        sys.exit(res["error"])
    res.update(model=a.model or "smollm2-135m-instruct", probe_ms=PROBE_MS, max_new_tokens=a.max_new_tokens,
               machine=f"{platform.machine()}, {os.cpu_count()} cores", rounds=a.rounds,
               date=time.strftime("%Y-%m-%d %H:%M"))
    print_table(res)
    out = Path(a.json or ROOT / "bench" / "results" / f"gui-responsiveness-{res.get('platform')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")
