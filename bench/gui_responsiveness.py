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

--case long-chat measures the same lateness with a 200-message chat (stored through the app's Store before the
window opens, replies of realistic length, some with code blocks): while it opens from the chat list and
renders, while the view is scrolled through it in steps, while replies stream at its bottom, and while a
document five times the model's window, attached through the app's document path (app/documents.py, what a
drop or Attach does), streams through the window with its progress bar and is answered.

    xvfb-run -a -s "-screen 0 1600x1000x24" python bench/gui_responsiveness.py --case long-chat [--profile PHASE]

Prints a table and writes JSON (default bench/results/gui-responsiveness-<platform>.json, or
gui-responsiveness-long-chat-<platform>.json); --profile runs cProfile on the GUI thread during the phases named
and prints where that thread spent its time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE_MS = 5
STALL_MS = 20
TURN_PHASES = ("prefill", "decode", "reading")  # a turn's phases (long-chat's are "chat-decode" and the like)
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

    def __init__(self, profile: set[str] | None = None) -> None:
        from PySide6.QtCore import Qt, QTimer

        self.phase = "idle"
        # cProfile of the GUI thread (the only thread a Profile enabled here sees) during the phases named.
        self.profile_phases = profile or set()
        self.profiles: dict[str, cProfile.Profile] = {}
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
        if self.phase in self.profiles:
            self.profiles[self.phase].disable()
        self.phase = phase
        if phase in self.profile_phases:
            self.profiles.setdefault(phase, cProfile.Profile()).enable()

    def profile_text(self, phase: str, lines: int = 25) -> str:
        out = io.StringIO()
        stats = pstats.Stats(self.profiles[phase], stream=out)
        stats.sort_stats("tottime").print_stats(lines)
        stats.sort_stats("cumulative").print_stats(lines)
        return out.getvalue()

    def _tick(self) -> None:
        now, cpu, runq = time.perf_counter(), time.thread_time(), _runqueue_ms()
        late = max(0.0, (now - self._last) * 1000 - PROBE_MS)
        if late > STALL_MS:
            self.stalls.append({"phase": self.phase, "late_ms": late, "gui_cpu_ms": (cpu - self._last_cpu) * 1000,
                                "runqueue_ms": runq - self._last_runq})
        self._last, self._last_cpu, self._last_runq = now, cpu, runq
        self.samples.setdefault(self.phase, []).append(late)
        if self.phase in TURN_PHASES or self.phase.endswith(TURN_PHASES):
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

        def on_prefilled(ev) -> None:  # a turn's Prefill (a rebuild's comes as `rebuilt`)
            if state["first_at"] is None:
                state["first_at"] = time.perf_counter()
                probe.set_phase("decode")

        def on_done(ev) -> None:  # the turn's TurnRow
            probe.set_phase("between")
            result["turns"].append({"prompt_chars": len(prompts[(state["i"] - 1) % len(prompts)]),
                                    "p99_ms": percentile(probe.turn, 99), "max_ms": max(probe.turn, default=0.0),
                                    "tokens": ev.tokens, "tok_s": ev.tok_s,
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


# --- the long-chat case ------------------------------------------------------------------------------------

LONG_CHAT_MESSAGES = 200
LONG_CHAT_PROMPTS = PROMPTS[:3]
CODE_SOURCES = ["app/chat_view.py", "app/store.py", "app/models.py", "app/documents.py", "bench/machine.py"]


def _words() -> list[str]:
    return (ROOT / "resources" / "texts" / "devils-dictionary.txt").read_text(encoding="utf-8").split()


def _prose(rng: random.Random, words: list[str], n: int) -> str:
    """About n words of English in sentences, from the Devil's Dictionary (real words, real punctuation)."""
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(8, 24)
        start = rng.randrange(len(words) - k)
        sentence = [w.strip("_") for w in words[start:start + k]]
        sentence[0] = sentence[0][:1].upper() + sentence[0][1:]
        out += sentence[:-1] + [sentence[-1].rstrip(",;:.") + "."]
    return " ".join(out)


def _code(rng: random.Random, sources: list[list[str]]) -> str:
    """A fenced block of 8-30 lines of real Python from this repository."""
    lines = rng.choice(sources)
    n = rng.randint(8, 30)
    start = rng.randrange(max(1, len(lines) - n))
    return "```python\n" + "\n".join(lines[start:start + n]).strip("\n") + "\n```"


def long_chat(n: int = LONG_CHAT_MESSAGES, seed: int = 16) -> list[tuple[str, str]]:
    """n messages (user, assistant, ...) of realistic lengths: questions of a sentence or three (one in eight
    pastes code), replies of 2-6 paragraphs (50-600 words), one in three with a code block, one in four with a
    list, some with a heading and inline code. Always the same chat for the same seed."""
    rng = random.Random(seed)
    words = _words()
    sources = [(ROOT / f).read_text(encoding="utf-8").splitlines() for f in CODE_SOURCES]
    out: list[tuple[str, str]] = []
    for i in range(n):
        if i % 2 == 0:
            text = _prose(rng, words, rng.randint(8, 60)).rstrip(".") + "?"
            if rng.random() < 1 / 8:
                text += "\n\n" + _code(rng, sources)
        else:
            parts = []
            if rng.random() < 0.2:
                parts.append("## " + _prose(rng, words, 4).rstrip("."))
            for _ in range(rng.randint(2, 6)):
                para = _prose(rng, words, rng.randint(25, 90))
                if rng.random() < 0.3:
                    w = rng.choice(words).strip(".,;:_\"'()")
                    para += f" See `{w.lower() or 'x'}()` for the details."
                parts.append(para)
            if rng.random() < 1 / 4:
                parts.insert(rng.randint(1, len(parts)), "\n".join(
                    f"- **{rng.choice(words).strip('.,;:_')}**: {_prose(rng, words, rng.randint(6, 18))}"
                    for _ in range(rng.randint(3, 7))))
            if i % 6 == 1 or rng.random() < 0.1:
                parts.insert(rng.randint(1, len(parts)), _code(rng, sources))
            text = "\n\n".join(parts)
        out.append(("user" if i % 2 == 0 else "assistant", text))
    return out


def document_text(chars: int, seed: int = 5) -> str:
    """A plain-text document of about `chars` characters: the Devil's Dictionary from an arbitrary entry on."""
    text = (ROOT / "resources" / "texts" / "devils-dictionary.txt").read_text(encoding="utf-8")
    start = text.find("\n\n", 20_000 + seed * 1000) + 2
    return text[start:start + chars]


def _store_chats(data: Path, messages: list[tuple[str, str]]) -> int:
    """The long chat, then a short one after it (the most recent: the one the window opens with), written
    through the app's Store; returns the long chat's id."""
    from app.store import Store

    store = Store.open(data)
    try:
        long_id = store.create_conversation("A long chat (200 messages)")
        for seq, (role, text) in enumerate(messages):
            store.append_message(long_id, seq, role, text)
        short = store.create_conversation("A short chat")
        store.append_message(short, 0, "user", "Hello!")
        store.append_message(short, 1, "assistant", "Hello! How can I help?")
    finally:
        store.close()
    return long_id


def run_long_chat(model: str | None, max_new_tokens: int, idle_s: float, profile: set[str],
                  doc_windows: float, turns: int) -> dict:
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QGuiApplication

    from app.main import main, seconds_since_process_start
    from app.settings import AppSettings, save_settings

    data = Path(tempfile.mkdtemp(prefix="eddy-guibench-long-"))
    messages = long_chat()
    long_id = _store_chats(data, messages)
    replies = [len(t.split()) for r, t in messages if r == "assistant"]
    result: dict = {"case": "long-chat", "turns": [], "chat": {
        "messages": len(messages), "chars": sum(len(t) for _, t in messages),
        "code_blocks": sum(t.count("```python") for _, t in messages),
        "reply_words_median": statistics.median(replies), "reply_words_max": max(replies)}}
    prompts = LONG_CHAT_PROMPTS[:turns] if turns <= len(LONG_CHAT_PROMPTS) else \
        [LONG_CHAT_PROMPTS[i % len(LONG_CHAT_PROMPTS)] for i in range(turns)]

    def drive(window) -> None:
        window.resize(1360, 860)
        c = window.controller
        view = window.chat_view
        probe = Probe(profile)
        steps: list = []
        state: dict = {"turn": None, "reading": []}

        def next_step() -> None:
            if not steps:
                finish()
                return
            QTimer.singleShot(300, steps.pop(0))

        def finish() -> None:
            probe.set_phase("end")
            probe.stop()
            result["phases"] = {k: summarise(v) for k, v in probe.samples.items() if k != "end"}
            result["stalls"] = probe.stalls
            result["platform"] = QGuiApplication.platformName()
            result["profiles"] = {ph: probe.profile_text(ph) for ph in probe.profiles}
            window.close()

        def when_idle(then) -> None:
            """`then` once the engine has handled everything queued so far (a rebuild, a count)."""
            def done() -> None:
                c.host.idle.disconnect(done)
                then()
            c.host.idle.connect(done)
            c.host.ping()

        # 1. Open the long chat from the chat list (what a click on it does), let it render and rebuild.
        def open_long() -> None:
            probe.set_phase("open")
            proxy = window.proxy
            row = next(r for r in range(proxy.rowCount())
                       if proxy.data(proxy.index(r, 0), c.conversations.IdRole) == long_id)
            t0 = time.perf_counter()
            window.chat_list.setCurrentIndex(proxy.index(row, 0))
            result["open_call_ms"] = (time.perf_counter() - t0) * 1000
            assert c.chat.conversation_id == long_id and len(c.chat.messages) == len(messages)

            def rebuilt() -> None:  # the chat's cache rebuilt on the worker; then 1.5 s for the view to settle
                result["open_to_rebuilt_s"] = time.perf_counter() - t0
                QTimer.singleShot(1500, opened)
            when_idle(rebuilt)

        def opened() -> None:
            probe.set_phase("between")
            result["chat"]["forgotten_after_open"] = c.chat.forgotten()
            next_step()

        # 2. Scroll from the bottom to the top and back in steps, a frame apart (a fast wheel or drag).
        def scroll() -> None:
            probe.set_phase("scroll")
            bar = view.verticalScrollBar()
            step = max(40, view.viewport().height() // 4)
            targets = list(range(bar.maximum(), -1, -step)) + [0] + list(range(0, bar.maximum() + 1, step)) \
                + [bar.maximum()]
            result["scroll"] = {"range_px": bar.maximum(), "step_px": step, "steps": len(targets), "frame_ms": 16}
            t0 = time.perf_counter()

            def one() -> None:
                if targets:
                    bar.setValue(targets.pop(0))
                    return
                timer.stop()
                result["scroll"]["seconds"] = time.perf_counter() - t0
                probe.set_phase("between")
                next_step()

            timer = QTimer(window)
            timer.setInterval(16)
            timer.timeout.connect(one)
            timer.start()

        # 3. Replies streaming at the bottom of the long chat.
        def send(prompt: str, phase: str, first: str = "prefill") -> None:
            probe.set_phase(f"{phase}-{first}")
            probe.turn = []
            state["turn"] = {"phase": phase, "sent_at": time.perf_counter(), "first_at": None,
                             "prompt_chars": len(prompt)}

        def turn(prompt: str) -> None:
            send(prompt, "chat")
            c.send(prompt)

        # 4. A document of doc_windows x the window, attached as a drop attaches it, counted, sent, answered.
        def attach_doc(chars: int | None = None) -> None:
            win = int(c.model_info.window)
            chars = chars or int(doc_windows * win * 4.1)  # about 4 characters a token in English
            path = data / "notes-from-the-devils-dictionary.txt"
            path.write_text(document_text(chars), encoding="utf-8")
            probe.set_phase("doc-attach")
            t0 = time.perf_counter()
            window.attach_paths([path])  # what compose.files_dropped (a drop) and Attach file call
            result["doc"] = {"chars": chars, "bytes": path.stat().st_size, "window": win,
                             "attach_ms": (time.perf_counter() - t0) * 1000}
            wait_count(win, chars)

        def wait_count(win: int, chars: int) -> None:
            if c.draft.tokens is None:
                QTimer.singleShot(50, lambda: wait_count(win, chars))
                return
            result["doc"]["draft_tokens"] = c.draft.tokens
            result["doc"]["draft_summary"] = window.draft_bar.summary.text()
            if c.draft.tokens < doc_windows * win:  # a denser text than guessed: a longer file, attached again
                c.detach(0)
                attach_doc(int(chars * doc_windows * win / c.draft.tokens * 1.05))
                return
            probe.set_phase("between")
            QTimer.singleShot(300, send_doc)

        def send_doc() -> None:
            question = "What are the three sharpest definitions in this document, and why?"
            window.compose.setPlainText(question)
            send(question, "doc", "reading")
            window.send_button.click()  # submit(compose text): the document goes with it

        def on_reading(done: int, total: int) -> None:
            if state["turn"] is not None and state["turn"]["phase"] == "doc":
                state["reading"].append((time.perf_counter(), done, total, window.reading_bar.isVisible()))

        def on_prefilled(ev) -> None:
            t = state["turn"]
            if t is not None and t["first_at"] is None:
                t["first_at"] = time.perf_counter()
                t["prefill_tokens"] = ev.new_tokens
                probe.set_phase(f"{t['phase']}-decode")

        def on_done(row) -> None:
            t = state["turn"]
            if t is None:
                return
            probe.set_phase("between")
            state["turn"] = None
            result["turns"].append({"phase": t["phase"], "prompt_chars": t["prompt_chars"],
                                    "prefill_tokens": row.prefill_tokens, "prefill_ms": row.prefill_ms,
                                    "p99_ms": percentile(probe.turn, 99), "max_ms": max(probe.turn, default=0.0),
                                    "tokens": row.tokens, "tok_s": row.tok_s,
                                    "ttft_ms": ((t["first_at"] or time.perf_counter()) - t["sent_at"]) * 1000})
            if t["phase"] == "doc":
                r = state["reading"]
                result["doc"].update(reading_events=len(r), reading_total=r[-1][2] if r else 0,
                                     reading_s=(r[-1][0] - r[0][0]) if r else 0.0,
                                     bar_shown_throughout=all(x[3] for x in r),
                                     seen_of_document=c.chat.seen_of(len(c.chat.messages) - 2))
            next_step()

        steps += [open_long, scroll] + [lambda p=p: turn(p) for p in prompts] + [attach_doc]

        def on_state(s: str) -> None:
            if s == "ready" and "ready_after_start_s" not in result:
                result["ready_after_start_s"] = seconds_since_process_start()
                probe.start()
                probe.set_phase("idle")

                def idle_done() -> None:
                    probe.set_phase("between")
                    next_step()
                QTimer.singleShot(int(idle_s * 1000), idle_done)
            elif s == "failed":
                result["error"] = "the model failed to load"
                window.close()

        c.model_state_changed.connect(on_state)
        c.turn_prefilled.connect(on_prefilled)
        c.turn_finished.connect(on_done)
        c.reading.connect(on_reading)
        QTimer.singleShot(60 * 60 * 1000, window.close)  # never hang

    save_settings(data, AppSettings.of(max_new_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.1))
    main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)
    return result


LONG_PHASES = ["idle", "open", "scroll", "chat-prefill", "chat-decode", "doc-attach", "doc-reading", "doc-decode",
               "between"]


def print_stalls(result: dict) -> None:
    stalls = result.get("stalls", [])

    def longest(kind: list[dict]) -> str:
        return f"{len(kind)} (longest {max((x['late_ms'] for x in kind), default=0):.1f} ms)"

    # Where the time of each stall went, by its largest part: the GUI thread computing, the GUI thread
    # ready but waiting for a core (other threads and processes), or neither (blocked: the GIL, a lock).
    kinds: dict[str, list[dict]] = {"busy": [], "runqueue": [], "blocked": []}
    for x in stalls:
        blocked = x["late_ms"] + PROBE_MS - x["gui_cpu_ms"] - x["runqueue_ms"]
        part = max(("busy", x["gui_cpu_ms"]), ("runqueue", x["runqueue_ms"]), ("blocked", blocked), key=lambda t: t[1])
        x["cause"] = part[0]
        kinds[part[0]].append(x)
    print(f"\nstalls over {STALL_MS} ms: {len(stalls)}, mostly spent: computing on the GUI thread "
          f"{longest(kinds['busy'])}; waiting for a core {longest(kinds['runqueue'])}; "
          f"blocked (GIL, locks) {longest(kinds['blocked'])}")
    result["stall_causes"] = {k: len(v) for k, v in kinds.items()}


def print_long_chat(result: dict) -> None:
    ch = result["chat"]
    print(f"\nlong chat: {ch['messages']} messages, {ch['chars']:,} characters, {ch['code_blocks']} code blocks, "
          f"replies of median {ch['reply_words_median']} words (max {ch['reply_words_max']})")
    print(f"Event-loop lateness of a {PROBE_MS} ms PreciseTimer on the GUI thread (platform {result.get('platform')}):")
    # The last two columns are the app's own share: stalls in which the GUI thread itself computed for more than
    # STALL_MS (the rest of the stalls it spent waiting for a core or blocked), and the most it computed in one.
    print(f"{'phase':<13} {'samples':>8} {'p50':>7} {'p90':>7} {'p99':>7} {'p99.9':>7} {'max':>8} {'>20ms':>6} "
          f"{'gui>20':>6} {'gui max':>8}")
    for phase in LONG_PHASES:
        s = result.get("phases", {}).get(phase)
        if s:
            own = [x["gui_cpu_ms"] for x in result.get("stalls", []) if x["phase"] == phase]
            s["stalls_gui_cpu_over_20ms"] = sum(1 for x in own if x > STALL_MS)
            s["stall_gui_cpu_max_ms"] = max(own, default=0.0)
            print(f"{phase:<13} {s['samples']:>8} {s['p50_ms']:>7.2f} {s['p90_ms']:>7.2f} {s['p99_ms']:>7.2f} "
                  f"{s['p999_ms']:>7.2f} {s['max_ms']:>8.2f} {s['over_20ms']:>6} "
                  f"{s['stalls_gui_cpu_over_20ms']:>6} {s['stall_gui_cpu_max_ms']:>8.1f}")
    print_stalls(result)
    by_phase: dict[str, list[dict]] = {}
    for x in result.get("stalls", []):
        by_phase.setdefault(x["phase"], []).append(x)
    for phase, xs in by_phase.items():
        top = sorted(xs, key=lambda x: -x["late_ms"])[:5]
        print(f"  {phase}: " + ", ".join(f"{x['late_ms']:.0f} ms ({x['cause']}, gui cpu {x['gui_cpu_ms']:.0f})"
                                         for x in top))
    print(f"\nopening the chat (the list's click handler): {result.get('open_call_ms', 0):.0f} ms; "
          f"scrolled {result.get('scroll', {}).get('range_px')} px in {result.get('scroll', {}).get('steps')} steps")
    d = result.get("doc", {})
    if d:
        print(f"document: {d['chars']:,} characters, {d.get('draft_tokens')} tokens = "
              f"{d.get('draft_tokens', 0) / max(1, d['window']):.1f}x the {d['window']}-token window; "
              f"read in {d.get('reading_s', 0):.1f} s, {d.get('reading_events')} progress reports; "
              f"seen of it after: {d.get('seen_of_document')}")
    print("\nturns:")
    for t in result["turns"]:
        print(f"  {t['phase']:<4} {t['prefill_tokens']:>6} prefill tokens  ttft {t['ttft_ms']:>7.0f} ms  "
              f"{t['tokens']:>4} tokens at {t['tok_s']:>5.1f} tok/s  lateness p99 {t['p99_ms']:>6.1f} ms, "
              f"max {t['max_ms']:>6.1f} ms")
    for phase, text in result.get("profiles", {}).items():
        print(f"\n--- cProfile of the GUI thread during {phase} ---\n{text}")


def print_table(result: dict) -> None:
    print(f"\nEvent-loop lateness of a {PROBE_MS} ms PreciseTimer on the GUI thread "
          f"(platform {result.get('platform')}):")
    print(f"{'phase':<9} {'samples':>8} {'p50':>7} {'p90':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'>20ms':>6}")
    for phase in ("idle", "prefill", "decode", "between"):
        s = result.get("phases", {}).get(phase)
        if s:
            print(f"{phase:<9} {s['samples']:>8} {s['p50_ms']:>7.2f} {s['p90_ms']:>7.2f} {s['p99_ms']:>7.2f} "
                  f"{s['p999_ms']:>7.2f} {s['max_ms']:>7.2f} {s['over_20ms']:>6}")
    print_stalls(result)
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
    p.add_argument("--case", choices=["replies", "long-chat"], default="replies",
                   help="replies: the prompts above in fresh chats; long-chat: a 200-message chat opened, scrolled "
                        "and answered in, then a document of --doc-windows windows")
    p.add_argument("--doc-windows", type=float, default=5.0, help="long-chat: the document's length in windows")
    p.add_argument("--turns", type=int, default=3, help="long-chat: replies streamed at the bottom of the chat")
    p.add_argument("--profile", action="append", default=[], metavar="PHASE",
                   help="long-chat: cProfile the GUI thread during this phase (repeatable), e.g. open, chat-decode")
    p.add_argument("--engine-nice", type=int, default=None,
                   help="the niceness the app gives IREE's worker threads (default app.worker.ENGINE_NICE; 0: "
                        "the GUI thread shares the CPU with them as equals), for an A/B in one run of the machine")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from bench.machine import cpu_info

    import app.worker

    if a.engine_nice is not None:
        app.worker.ENGINE_NICE = a.engine_nice

    load_before = os.getloadavg()
    if a.case == "long-chat":
        res = run_long_chat(a.model, a.max_new_tokens, a.idle_seconds, set(a.profile), a.doc_windows, a.turns)
    else:
        res = run(a.model, a.max_new_tokens, a.idle_seconds, a.paste_words, a.rounds)
    if "error" in res:
        sys.exit(res["error"])
    res.update(model=a.model or "smollm2-135m-instruct", probe_ms=PROBE_MS, max_new_tokens=a.max_new_tokens,
               machine=f"{platform.machine()}, {os.cpu_count()} cores", cpu=cpu_info(),
               load_average_before=[round(x, 2) for x in load_before],
               load_average_after=[round(x, 2) for x in os.getloadavg()], engine_nice=app.worker.ENGINE_NICE,
               date=time.strftime("%Y-%m-%d %H:%M"))
    if a.case == "long-chat":
        res.update(turns_asked=a.turns, doc_windows=a.doc_windows)
        print_long_chat(res)
    else:
        res["rounds"] = a.rounds
        print_table(res)
    print(f"\nmachine: {res['cpu'].get('Model name')}, {res['cpu'].get('CPU(s)')} CPUs; load average "
          f"{res['load_average_before']} before, {res['load_average_after']} after")
    name = "gui-responsiveness-long-chat" if a.case == "long-chat" else "gui-responsiveness"
    out = Path(a.json or ROOT / "bench" / "results" / f"{name}-{res.get('platform')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")
