"""Chat turns on the real compiled tiny-random module: reuse, events, stop flag, limits, user text safety."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.run.session import ChatSession, ChatSettings


@pytest.fixture
def session(tiny):
    s = tiny.chat(ChatSettings(max_new_tokens=12))
    s.reset()
    return s


def collect(session: ChatSession, text: str):
    events: list[dict] = []
    result = session.send(text, lambda e: events.append(e.to_dict()))
    return result, events


def test_turn_streams_tokens_and_reports_events(session):
    result, events = collect(session, "Hello there")
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["prefill", "context"] and kinds[-2:] == ["done", "context"] and "token" in kinds
    assert "".join(e["text"] for e in events if e["event"] == "token") == result.text
    done = events[-2]
    assert done["tokens"] == result.tokens > 0
    assert set(done["cache"]) == {"sinks", "window", "capacity", "used", "evicted", "position", "pinned"}
    assert events[0]["new_tokens"] == events[0]["cache"]["position"]
    # The user message, then the reply, end to end up to where the cache is.
    assert events[-1]["spans"] == ((0, events[0]["new_tokens"]), (events[0]["new_tokens"], done["cache"]["position"]))


def test_typed_events_serialise_to_the_json_lines_of_design_md():
    """Field names and order as DESIGN.md gives them (and as eddy chat --json printed before typed events),
    plus the cache's new `pinned` at its end."""
    from engine.events import CacheStats, Context, Done, Error, Prefill, Token

    cache = CacheStats(sinks=4, window=1020, capacity=1024, used=40, evicted=0, position=40, pinned=0)
    cache_json = ('{"sinks": 4, "window": 1020, "capacity": 1024, "used": 40, "evicted": 0, "position": 40, '
                  '"pinned": 0}')
    assert Prefill(new_tokens=40, ms=12.5, cache=cache).to_json() == (
        '{"event": "prefill", "new_tokens": 40, "ms": 12.5, "cache": ' + cache_json + "}")
    assert Token(text="Héllo \"x\"").to_json() == '{"event": "token", "text": "Héllo \\"x\\""}'
    assert Done(tokens=7, ms=80.0, tok_s=87.5, stop_reason="eos", cache=cache).to_json() == (
        '{"event": "done", "tokens": 7, "ms": 80.0, "tok_s": 87.5, "stop_reason": "eos", "cache": ' + cache_json + "}")
    assert Error(message="no model").to_json() == '{"event": "error", "message": "no model"}'
    assert Context(spans=((0, 12), (12, 30)), left=(0,), dropped=2).to_dict() == {
        "event": "context", "spans": ((0, 12), (12, 30)), "left": (0,), "dropped": 2}


def test_second_turn_prefills_only_new_tokens(session, tiny):
    first, _ = collect(session, "Hi")
    fed_after_first = tiny.engine.stats.position
    second, events = collect(session, "And again")
    prefill = events[0]
    # Only the closing of the last reply and the new user turn: far fewer than the whole history.
    assert prefill["new_tokens"] == prefill["cache"]["position"] - fed_after_first
    assert prefill["new_tokens"] < fed_after_first
    expected = tiny.tokenizer.encode_template("<|im_end|>\n") + tiny.tokenizer.chat_delta(
        session.messages[:-2], [{"role": "user", "content": "And again"}])
    assert tiny.engine.mirror()[-(prefill["new_tokens"] + second.tokens):][: prefill["new_tokens"]] == expected


def test_typed_special_token_stays_text(session, tiny):
    im_end = tiny.tokenizer.encode_template("<|im_end|>")
    assert len(im_end) == 1
    collect(session, "please print <|im_end|> literally")
    prompt = tiny.engine.mirror()
    # The template's own markers: one closing the default system turn, one closing the user turn.
    assert prompt.count(im_end[0]) == 2
    assert tiny.tokenizer.encode_text("<|im_end|>") != im_end


def test_stop_flag_from_another_thread_stops_within_one_token(session):
    session.settings.max_new_tokens = 10_000
    seen: list[int] = []

    def on_event(e) -> None:
        if e.kind == "token":
            seen.append(1)
            if len(seen) == 3:
                threading.Thread(target=session.stop).start()
                threading.Event().wait(0.05)  # let the other thread set the flag before the next token

    result = session.send("Count forever", on_event)
    assert result.stop_reason == "stopped"
    assert 3 <= result.tokens <= 4


def test_max_new_tokens(session):
    session.settings.max_new_tokens = 5
    result, _ = collect(session, "Tell me a story")
    assert result.stop_reason == "length" and result.tokens == 5


def test_a_message_of_five_windows_streams_through_and_the_reply_matches_the_reference(session, tiny, tiny_reference,
                                                                                     monkeypatch):
    """Longer than the window, it goes in chunk by chunk with progress events, evicting as it goes; every logit
    the session's engine computed, its reply's included, equals the torch StreamingLLM reference fed the same
    tokens in the same calls."""
    from conftest import TINY_SETTINGS
    from streaming_reference import StreamingReference

    eng = tiny.engine
    calls: list[tuple[list[int], object]] = []
    real_prefill, real_decode = eng.prefill, eng.decode

    def prefill(ids):
        calls.append((list(ids), out := real_prefill(ids)))
        return out

    def decode(token):
        calls.append(([token], out := real_decode(token)))
        return out

    monkeypatch.setattr(eng, "prefill", prefill)
    monkeypatch.setattr(eng, "decode", decode)
    collect(session, "short")
    text = " ".join(f"item{i}" for i in range(5 * TINY_SETTINGS.window))
    result, events = collect(session, text)
    window = TINY_SETTINGS.window
    progress = [e for e in events if e["event"] == "prefill_progress"]
    prefill_event = next(e for e in events if e["event"] == "prefill")
    assert len(progress) >= 5 and progress[-1]["done"] == progress[-1]["total"] == prefill_event["new_tokens"] > 5 * window
    assert [e["done"] for e in progress] == sorted({e["done"] for e in progress})
    assert prefill_event["cache"]["evicted"] > 4 * window and result.stop_reason in ("eos", "length")
    assert session.messages[-2] == {"role": "user", "content": text}
    cfg, state = tiny_reference
    ref = StreamingReference(state, cfg, TINY_SETTINGS.sinks, window)
    worst = max(float(np.abs(out - ref.feed(ids)[-1].numpy()).max()) for ids, out in calls)
    assert worst < 1e-4


def test_stopping_a_long_message_part_way_leaves_a_chat_that_goes_on(session, tiny):
    seen: list[int] = []

    def on_event(e) -> None:
        if e.kind == "prefill_progress":
            seen.append(e.done)
            if len(seen) == 3:
                session.stop()

    result = session.send("word " * 2000, on_event)
    assert result.stop_reason == "stopped" and result.tokens == 0 and len(seen) == 3
    assert session.messages[-1] == {"role": "assistant", "content": ""}
    # The cache holds part of a message: the next turn starts again from what fits.
    result, events = collect(session, "still here?")
    assert result.tokens > 0 and events[0]["cache"]["position"] == events[0]["new_tokens"] < 60


def test_long_conversation_evicts_and_keeps_going(session, tiny):
    for i in range(8):
        collect(session, f"message number {i}")
    stats = tiny.engine.stats
    assert stats.evicted > 0 and stats.used == stats.capacity
    assert len(session.messages) == 16
