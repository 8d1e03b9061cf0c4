"""Issue 44, item 3: a model on another machine, through its OpenAI-compatible server. The server here is a real
`eddy serve` app on the compiled tiny-random module over real HTTP; its context (64 tokens: 4 sinks + a 60-token
window) is far shorter than the chats sent to it, which must still finish every turn."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY_SETTINGS
from test_serve import KEY, _free_port, serve, stop


@pytest.fixture(scope="module")
def server(tiny):
    from engine.loader import open_model

    model = open_model("tiny-random", TINY_SETTINGS)
    served = serve(model.chat(), conversations=2, defaults=model.chat_defaults, max_tokens=8)
    yield f"http://127.0.0.1:{served.port}/v1"
    stop(served)


def test_the_server_says_its_model_and_context_and_a_reply_streams(server):
    from engine.events import Done, Prefill, Token
    from engine.remote import open_remote
    from engine.run.session import ChatSettings

    model = open_remote(server, KEY)
    assert model.info.model == "tiny-random" and model.info.context == 64 and model.info.context_known
    session = model.chat(ChatSettings(max_new_tokens=6))
    events = []
    result = session.answer("Hello there", events.append)
    kinds = [type(e) for e in events]
    assert kinds[0] is Prefill and kinds[-1] is Done and Token in kinds
    assert "".join(e.text for e in events if isinstance(e, Token)) == result.text
    assert result.tokens == events[-1].tokens > 0 and result.prefill_tokens > 0  # the server's own counts


def test_a_chat_longer_than_the_servers_context_finishes_every_turn_and_says_what_left(server):
    from engine.remote import open_remote
    from engine.run.session import ChatSettings

    session = open_remote(server, KEY).chat(ChatSettings(system_prompt="Be brief.", max_new_tokens=6))
    contexts = []
    for turn in range(12):
        result = session.answer(f"Question number {turn}: what comes after {turn}?", contexts.append)
        assert result.stop_reason in ("eos", "length")
        assert result.prefill_tokens <= 64, (turn, result)  # the server's count of what was sent: it fitted
    assert len(session.conversation) == 24
    from engine.events import Context

    last = [e for e in contexts if isinstance(e, Context)][-1]
    assert last.first > 0 and last.forgotten == last.first  # the window's marker: what was left out
    assert last.cache.evicted > 0 and last.cache.capacity == 64


def test_a_wrong_key_or_no_server_is_one_sentence(server):
    from engine.errors import ModelError
    from engine.remote import open_remote

    with pytest.raises(ModelError, match="refused the API key"):
        open_remote(server, "wrong")
    port = _free_port()
    with pytest.raises(ModelError, match="connection was refused"):
        open_remote(f"http://127.0.0.1:{port}/v1")


def test_a_stop_ends_a_remote_reply_at_once(server):
    from engine.events import Token
    from engine.remote import open_remote
    from engine.run.session import ChatSettings

    session = open_remote(server, KEY).chat(ChatSettings(max_new_tokens=8))

    def on_event(event):
        if isinstance(event, Token):
            session.stop()

    start = time.monotonic()
    result = session.answer("Go on and on", on_event)
    assert result.stop_reason == "stopped" and time.monotonic() - start < 10
    assert session.answer("And now?").stop_reason in ("eos", "length")  # the next turn goes on


def test_eddy_chat_talks_to_a_server_given_as_the_model(server):
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDDY_API_KEY=KEY)
    out = subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--model", server, "--prompt", "Hi", "--json",
                          "--max-new-tokens", "5"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["event"] == "prefill" and events[-1]["event"] == "done" and events[-1]["tokens"] > 0


def test_the_window_chats_with_a_remote_model_and_marks_what_left_its_context(server, qtbot, tmp_path):
    import conftest_app  # noqa: F401  (headless Qt, pytest-qt)
    from conftest_app import open_window, send_text, write_settings

    data = tmp_path / "data"
    write_settings(data, api_key=KEY, max_new_tokens=6)
    window = open_window(qtbot, data, model=server)
    c = window.controller
    assert c.model_info.remote and "remote" in window.status_label.text()
    assert window.stats.remote_label.isVisible() and "server's own counts" in window.stats.remote_label.text()
    for turn in range(12):
        row = send_text(qtbot, window, f"Question {turn}: say something short.")
        assert row.stop_reason in ("eos", "length") and row.prefill_tokens <= 64
    assert len(c.chat.messages) == 24 and all(not m.streaming for m in c.chat.messages)
    assert c.chat.forgotten() > 0 and c.cache.capacity == 64  # the marker: what left the server's context


def test_eddy_gui_ask_answers_through_a_server_given_as_the_model(server, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDDY_API_KEY=KEY, QT_QPA_PLATFORM="offscreen")
    out = subprocess.run([sys.executable, "-m", "app", "--data-dir", str(tmp_path / "data"), "--model", server,
                          "--ask", "Hello"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # the reply, streamed to stdout
