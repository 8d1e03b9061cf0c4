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
    result = session.answer(text, lambda e: events.append(e.to_dict()))
    return result, events


def test_turn_streams_tokens_and_reports_events(session):
    result, events = collect(session, "Hello there")
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["prefill", "context"] and kinds[-2:] == ["context", "done"] and "token" in kinds
    assert "".join(e["text"] for e in events if e["event"] == "token") == result.text
    done = events[-1]
    assert done["tokens"] == result.tokens > 0
    assert set(done["cache"]) == {"sinks", "window", "capacity", "used", "evicted", "position", "pinned"}
    assert events[0]["new_tokens"] == events[0]["cache"]["position"]
    # The user message, then the reply, end to end up to where the cache is.
    assert events[-2]["spans"] == ((0, events[0]["new_tokens"]), (events[0]["new_tokens"], done["cache"]["position"]))
    assert events[-2]["first"] == 0 and events[-2]["left"] == () and events[-2]["cut"] == -1


def test_typed_events_serialise_to_the_json_lines_of_the_contract():
    """Field names and order as docs/CONTRACT.md gives them (and as eddy chat --json printed before typed events),
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
    ctx = Context(first=2, spans=((8, 20), (20, 30)), left=(2,), cut=3, system=(0, 8), cache=cache)
    assert ctx.forgotten == 3 and ctx.to_dict() == {
        "event": "context", "first": 2, "spans": ((8, 20), (20, 30)), "left": (2,), "cut": 3, "system": (0, 8),
        "cache": cache.to_dict()}


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

    result = session.answer("Count forever", on_event)
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

    result = session.answer("word " * 2000, on_event)
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


# --- the conversation owned by the session: resume, regenerate, edit_last, the context event ----------------

def _history(n: int) -> list[dict]:
    history = []
    for i in range(n):
        history += [{"role": "user", "content": f"question number {i} about something"},
                    {"role": "assistant", "content": f"answer number {i}, with a few more words"}]
    return history


def _recording(monkeypatch, engine) -> list:
    """Every prefill call's logits, in order (the module's own outputs, as the session got them)."""
    outputs: list = []
    real = engine.prefill

    def prefill(ids):
        outputs.append(out := real(ids))
        return out

    monkeypatch.setattr(engine, "prefill", prefill)
    return outputs


def _recompute(engine, tokens: list[int]):
    """The logits after `tokens`, computed afresh in an empty cache (the cache is left holding them)."""
    engine.reset()
    return engine.prefill(tokens)


def test_resume_keeps_the_recent_messages_that_fit_and_says_where_they_are(tiny):
    session = tiny.chat(ChatSettings(system_prompt="You are terse.", max_new_tokens=4))
    history = _history(12)
    events: list = []
    prefill = session.resume(history, events.append)
    assert [e.kind for e in events] == ["prefill", "context"] and prefill.new_tokens == tiny.engine.position
    first = session.dropped
    assert 0 < first < len(history) and history[first]["role"] == "user"
    assert session.messages == [{"role": "system", "content": "You are terse."}, *history[first:]]
    # What the cache holds is exactly the kept part's rendering, within the window.
    assert tiny.engine.mirror() == tiny.tokenizer.encode_chat(session.messages, add_generation_prompt=False)
    assert tiny.engine.stats.evicted == 0
    ctx = events[-1]
    assert ctx.first == first and ctx.forgotten == first and len(ctx.spans) == len(history) - first
    assert ctx.system[0] == 0 and ctx.spans[0][0] == ctx.system[1]
    assert all(a[1] == b[0] for a, b in zip(ctx.spans, ctx.spans[1:])) and ctx.spans[-1][1] == tiny.engine.position
    # A short chat is kept whole, and the conversation goes on from it.
    session.resume(history[:2])
    assert session.dropped == 0 and session.messages[1:] == history[:2]
    assert session.answer("and one more").tokens > 0 and session.messages[-2]["content"] == "and one more"


def test_regenerate_and_edit_last_rewind_the_cache_and_match_a_fresh_recompute(tiny, monkeypatch):
    from engine.run.sampling import SamplingParams

    session = tiny.chat(ChatSettings(system_prompt="Be brief.", max_new_tokens=5, sampling=SamplingParams(temperature=0)))
    session.resume([])
    session.answer("Hi there")
    first = session.answer("Tell me more")
    user_span = session.spans[-2]
    outputs = _recording(monkeypatch, tiny.engine)
    events: list = []
    again = session.regenerate(events.append)
    # Only the user message went in again: the cache was rewound to where it began, the earlier turns kept.
    prefill = next(e for e in events if e.kind == "prefill")
    assert prefill.new_tokens == user_span[1] - user_span[0] and len(outputs) == 1
    assert again.text == first.text and [m["content"] for m in session.messages[-2:]] == ["Tell me more", again.text]
    tokens = tiny.engine.mirror()[: session.spans[-2][1]]
    assert np.abs(outputs[0] - _recompute(tiny.engine, tokens)).max() < 1e-4

    session.resume([{"role": m["role"], "content": m["content"]} for m in session.messages[1:]])
    outputs.clear()
    edited = session.edit_last("Something else entirely", events.append)
    assert [m["content"] for m in session.messages[1:]][-2:] == ["Something else entirely", edited.text]
    assert [m["content"] for m in session.messages[1:3]] == ["Hi there", session.messages[2]["content"]]
    assert len(session.messages) == 5 and len(outputs) == 1
    assert session.context().spans[-1][1] == tiny.engine.position
    tokens = tiny.engine.mirror()[: session.spans[-2][1]]
    assert np.abs(outputs[0] - _recompute(tiny.engine, tokens)).max() < 1e-4


def test_regenerate_after_the_window_slid_rebuilds_from_what_fits(session, tiny, monkeypatch):
    for i in range(8):
        session.answer(f"message number {i}")
    assert tiny.engine.stats.evicted > 0 and not tiny.engine.can_truncate(session.spans[-2][0])
    last_user = session.messages[-2]["content"]
    outputs = _recording(monkeypatch, tiny.engine)
    events: list = []
    held: list[list[int]] = []  # the cache's tokens when the reply began (the reply may evict some)
    result = session.regenerate(lambda e: (events.append(e), e.kind == "prefill" and held.append(tiny.engine.mirror())))
    prefill = next(e for e in events if e.kind == "prefill")
    # A rebuild: the cache starts afresh from the recent messages that fit, the last question last.
    assert prefill.new_tokens == prefill.cache.position == session.spans[-2][1] and result.tokens > 0
    assert session.messages[-2] == {"role": "user", "content": last_user} and session.dropped > 0
    ctx = [e for e in events if e.kind == "context"][-1]
    assert ctx.kind == "context" and ctx.first == session.dropped and ctx.spans[-1][1] == tiny.engine.position
    assert len(held[0]) == prefill.new_tokens
    assert np.abs(outputs[-1] - _recompute(tiny.engine, held[0])).max() < 1e-4


def test_nothing_to_regenerate_or_edit_is_a_clear_error(session):
    from engine.errors import EddyError

    with pytest.raises(EddyError, match="no reply to regenerate"):
        session.regenerate()
    with pytest.raises(EddyError, match="no message to edit"):
        session.edit_last("hello")


def test_a_rebuild_caused_by_the_template_reports_the_new_spans(tiny, tmp_path):
    """A template that marks the latest user message changes an earlier turn every turn: the session rebuilds
    the cache on its own, and its context event says where each message now sits."""
    import json
    import shutil

    from conftest import MARK_LATEST_USER
    from engine.run.tokenizer import Tokenizer

    folder = tmp_path / "marking"
    folder.mkdir()
    shutil.copy(tiny.folder / "tokenizer.json", folder / "tokenizer.json")
    chat = json.loads((tiny.folder / "chat.json").read_text())
    (folder / "chat.json").write_text(json.dumps({**chat, "chat_template": MARK_LATEST_USER}))
    tok = Tokenizer.from_dir(folder)
    session = ChatSession(tiny.engine, tok, ChatSettings(max_new_tokens=4))
    session.reset()
    contexts: list = []
    for i in range(6):
        session.answer(f"Turn {i}: a message that takes a fair share of the small window",
                       lambda e: e.kind == "context" and contexts.append(e))
    ctx = contexts[-1]
    assert session.dropped > 0 and ctx.first == session.dropped == ctx.forgotten
    # The spans are those of a fresh rendering of the kept messages: each turn's prefill rebuilt the cache. The
    # last question's span runs to the end of the generation prompt, where the reply begins.
    rendered = [len(tok.encode_chat(session.messages[: j + 1], add_generation_prompt=False))
                for j in range(len(session.messages) - 2)]
    asked = tok.encode_chat(session.messages[:-1], add_generation_prompt=True)
    assert [end for _, end in ctx.spans] == [*rendered, len(asked), tiny.engine.position]
    assert tiny.engine.mirror()[: len(asked)] == asked
    assert ctx.spans[-1][1] == tiny.engine.position and ctx.left == ()
