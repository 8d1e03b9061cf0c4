"""The system prompt pinned in the sinks: a run-time sink count up to the compiled bound, on the real tiny-random
module, against the torch StreamingLLM reference; the session, the command line and the app's cache bar."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import PIN_SETTINGS, ROOT
from streaming_reference import StreamingReference

TOL = 1e-4
SYSTEM = "You are Eddy, a pirate who answers every question in one short line and never forgets it."


def test_a_run_time_sink_count_matches_the_reference_with_that_many_sinks(tiny_pinning, tiny_reference):
    cfg, state = tiny_reference
    eng = tiny_pinning.engine
    for sinks in (23, 0):  # a pinned prompt's count, and none at all (the build's --sinks is 4)
        eng.reset()
        eng.pin(sinks)
        in_force = max(sinks, PIN_SETTINGS.sinks)
        ref = StreamingReference(state, cfg, in_force, PIN_SETTINGS.window)
        rng = np.random.RandomState(sinks)
        worst = 0.0
        for n in [16, 9, 1, 1, 16, 16, 3, 1, 16, 16, 16, 5, 1, 16, 16, 2]:
            ids = rng.randint(0, 49152, n).tolist()
            got = eng.decode(ids[0]) if n == 1 else eng.prefill(ids)
            worst = max(worst, float(np.abs(got - ref.feed(ids)[-1].numpy()).max()))
        stats = eng.stats
        assert (stats.sinks, stats.capacity, stats.pinned) == (in_force, in_force + PIN_SETTINGS.window, sinks)
        assert stats.evicted == stats.position - stats.capacity > 0
        assert worst < TOL


def test_pinned_system_prompt_stays_after_ten_windows_of_chat(tiny_pinning, tiny_reference, monkeypatch):
    from engine.run.session import ChatSession, ChatSettings

    session = ChatSession(tiny_pinning.engine, tiny_pinning.tokenizer,
                          ChatSettings(system_prompt=SYSTEM, max_new_tokens=8, pin_system=True))
    session.reset()
    eng = tiny_pinning.engine
    calls: list[tuple[list[int], np.ndarray]] = []  # every call the session made, with the module's logits
    real_prefill, real_decode = eng.prefill, eng.decode
    monkeypatch.setattr(eng, "prefill", lambda ids: calls.append((list(ids), out := real_prefill(ids))) or out)
    monkeypatch.setattr(eng, "decode", lambda token: calls.append(([token], out := real_decode(token))) or out)
    events: list[dict] = []
    turn = 0
    while session.engine.position < 10 * PIN_SETTINGS.window:
        session.answer(f"Question {turn}: what is the weather like on deck today?", lambda e: events.append(e.to_dict()))
        turn += 1
    tok = tiny_pinning.tokenizer
    # What every first turn shares: the template's opening and the system prompt.
    pinned_ids = session.engine.mirror()[: session.engine.pinned]
    assert SYSTEM in tok.decode(pinned_ids) and session.engine.pinned > len(tok.encode_text(SYSTEM))
    first_turn = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}],
                                 add_generation_prompt=True)
    assert first_turn[: len(pinned_ids)] == pinned_ids
    cache = next(e for e in reversed(events) if e["event"] == "done")["cache"]
    assert cache["pinned"] == len(pinned_ids) == cache["sinks"] and cache["position"] >= 10 * PIN_SETTINGS.window
    assert cache["evicted"] == cache["position"] - cache["capacity"]
    assert list(cache) == ["sinks", "window", "capacity", "used", "evicted", "position", "pinned"]
    # One conversation, never rebuilt: the torch StreamingLLM reference with that many sinks, fed the same
    # calls in the same module-sized chunks (eviction happens between them), gives the same logits all the way.
    assert sum(len(ids) for ids, _ in calls) == cache["position"]
    cfg, state = tiny_reference
    ref = StreamingReference(state, cfg, len(pinned_ids), PIN_SETTINGS.window)
    worst = 0.0
    for ids, out in calls:
        for start in range(0, len(ids), eng.chunk):
            logits = ref.feed(ids[start : start + eng.chunk])[-1].numpy()
        worst = max(worst, float(np.abs(out - logits).max()))
    assert worst < TOL


def test_a_system_prompt_too_long_to_pin_is_refused_and_nothing_changes(tiny_pinning):
    from engine.errors import PromptTooLongError
    from engine.run.session import ChatSession, ChatSettings

    long_system = "Always answer as a pirate. " * 40
    session = ChatSession(tiny_pinning.engine, tiny_pinning.tokenizer,
                          ChatSettings(system_prompt=long_system, pin_system=True))
    session.reset()
    with pytest.raises(PromptTooLongError, match=rf"pins at most {PIN_SETTINGS.sink_slots}.*--max-sinks"):
        session.answer("Hello")
    assert session.messages == [] and session.engine.position == 0
    session.settings.system_prompt = SYSTEM  # shortened, it is pinned
    assert session.answer("Hello").stop_reason in ("eos", "length") and session.engine.pinned > 20


def test_eddy_chat_pin_system_reports_pinned_tokens(tiny_pinning):
    # The tests' artefact cache ($EDDY_CACHE_DIR, inherited) holds the build: it is found, not redone.
    cmd = [sys.executable, "-m", "engine.cli", "chat", "--model", "tiny-random", "--sinks", str(PIN_SETTINGS.sinks),
           "--window", str(PIN_SETTINGS.window), "--dtype", PIN_SETTINGS.dtype, "--max-new-tokens", "4",
           "--system", SYSTEM, "--pin-system", "--json", "--prompt", "Ahoy?"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["event"] == "prefill" and events[0]["cache"]["pinned"] > 20
    assert events[-1]["event"] == "done" and events[-1]["cache"]["pinned"] == events[0]["cache"]["pinned"]


def test_the_cache_bar_shows_the_pinned_slots(qtbot, tmp_path, tiny_pinning):
    from conftest_app import open_window, send_text, write_settings

    data = tmp_path / "data"
    write_settings(data, system_prompt=SYSTEM, pin_system="true")
    window = open_window(qtbot, data)
    for i in range(3):
        send_text(qtbot, window, f"Message {i}, long enough that the chat soon leaves the window behind")
    bar = window.stats.cache_bar
    assert bar.stats.pinned > 20 and bar.stats.sinks == bar.stats.pinned and bar.stats.evicted > 0
    assert f"system prompt pinned ({bar.stats.pinned})" in window.stats.cache_label.text()
    from app.cache_bar import BAR_PX

    image = bar.grab().toImage()
    y = BAR_PX // 2  # the bar's middle (a caption row under it names the pinned slots)
    colours = {image.pixelColor(x, y).name() for x in range(2, int(image.width() * 0.02))}
    assert "#9b51e0" in colours  # PIN_COLOUR at the bar's left end
