"""The desktop app's local server on the real compiled tiny-random module: the official `openai` client talks to the
window's own engine on a free loopback port, its requests line up with the window's turns, the window's chat
goes on from its cache after them, and the switch frees the port (or says clearly why it cannot take it)."""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable

import conftest_app  # noqa: F401  (headless Qt, pytest-qt)
import openai
from conftest_app import TURN_TIMEOUT_MS, open_window, send_text, wait_idle, write_settings
from PySide6.QtCore import QObject, Qt, Signal, Slot

KEY = "app-test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    """Whether another program could listen on `port` now (closed connections' TIME_WAIT aside)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
            return True
        except OSError:
            return False


def _switch(qtbot, window, on: bool, port: int, key: str = KEY) -> None:
    """Sets the Local server section of the real settings dialog and applies it, as OK does."""
    from app.settings_dialog import SettingsDialog

    dialog = SettingsDialog(window.controller.settings, window)
    qtbot.addWidget(dialog)
    dialog.server.enabled.setChecked(on)
    dialog.server.port.setValue(port)
    dialog.server.key.setText(key)
    window.controller.apply_settings(dialog.value())


def _client(window) -> openai.OpenAI:
    return openai.OpenAI(base_url=window.controller.server_address, api_key=KEY, max_retries=0, timeout=60)


class Background:
    """A client call on a thread of its own, so the GUI's event loop goes on while it waits for its answer."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as e:  # the test reports it
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


class HoldEngine(QObject):
    """Keeps the engine worker's thread busy until released: whatever is posted meanwhile queues behind it, so
    a window turn and a server request are in flight together for certain."""

    _hold = Signal()

    def __init__(self, thread) -> None:
        super().__init__()
        self.holding, self.release = threading.Event(), threading.Event()
        self.moveToThread(thread)
        self._hold.connect(self._wait, Qt.ConnectionType.QueuedConnection)

    def hold(self) -> None:
        self._hold.emit()

    @Slot()
    def _wait(self) -> None:
        self.holding.set()
        self.release.wait(TURN_TIMEOUT_MS / 1000)


def _stream_text(stream) -> tuple[str, dict]:
    chunks = [c.to_dict() for c in stream]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]


def test_the_switch_serves_the_windows_engine_to_the_openai_client_and_frees_the_port(qtbot, tmp_path, tiny):
    from app.settings import load_settings
    from app.settings import ServerOptions

    data = tmp_path / "data"
    write_settings(data)
    window = open_window(qtbot, data)
    send_text(qtbot, window, "Hello there")
    c = window.controller
    window_cache = c.cache
    port = _free_port()
    _switch(qtbot, window, True, port)
    address = f"http://127.0.0.1:{port}/v1"
    assert c.server_address == address and load_settings(data).server == ServerOptions(True, port, KEY)
    assert window.server_status.isVisible() and window.server_status.text() == f"Serving on {address}"

    client = _client(window)
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=6,
                                           temperature=0).to_dict()
    assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"] > 0
    text, last = _stream_text(client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=6,
                                                             temperature=0, stream=True))
    assert text == whole["choices"][0]["message"]["content"]  # the same greedy reply, piece by piece
    assert last["timings"]["predicted_n"] == whole["timings"]["predicted_n"]
    # A key is asked for once one is set.
    stranger = openai.OpenAI(base_url=address, api_key="wrong", max_retries=0, timeout=60)
    try:
        stranger.models.list()
        raise AssertionError("a wrong key was let in")
    except openai.AuthenticationError:
        pass
    wait_idle(qtbot, window)

    # Both requests show as the server's own rows, not as the window's turns or rebuilds.
    rows = c.turns.rows
    assert [r.kind for r in rows] == ["turn", "server", "server"]
    served = rows[1]
    assert (served.prefill_tokens, served.tokens) == (whole["timings"]["prompt_n"], whole["timings"]["predicted_n"])
    assert c.turns.data(c.turns.index(1, 0)) == "server" and c.turns.turn_number(2) == 1
    # The window's chat is back in the cache, as the engine reports it: the bar shows it, not the server's.
    assert c.cache == window_cache and window.stats.cache_bar.stats == window_cache
    assert not c.server_busy and not window.server_status.text().endswith("request")

    _switch(qtbot, window, False, port)
    qtbot.waitUntil(lambda: not c.local_server.running, timeout=TURN_TIMEOUT_MS)
    assert _port_free(port) and c.server_address is None and not window.server_status.isVisible()
    assert load_settings(data).server.serve is False
    # On again, on the port it has just let go of.
    _switch(qtbot, window, True, port)
    assert c.server_address == address
    assert _client(window).models.list().data[0].id == "tiny-random"


def test_a_window_turn_and_a_server_request_in_flight_together_both_finish_from_their_caches(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data, serve="true", server_port=_free_port(), server_key=KEY)
    window = open_window(qtbot, data)
    c = window.controller
    assert c.server_address is not None  # switched on in the settings: on once the model is ready
    first = send_text(qtbot, window, "First question")
    after_first = first.cache["position"]
    prefills: list[tuple[Any, Any]] = []
    c.host.worker.prefill.connect(lambda ev, origin: prefills.append((ev, origin)))
    statuses: list[str] = []
    c.server_changed.connect(lambda: statuses.append(window.server_status.text()))
    client = _client(window)
    conversation = [{"role": "system", "content": "You are a client."}, {"role": "user", "content": "turn one"}]
    opening = client.chat.completions.create(model="tiny-random", messages=conversation, max_tokens=5,
                                             temperature=0).to_dict()
    conversation.append({"role": "assistant", "content": opening["choices"][0]["message"]["content"]})
    conversation.append({"role": "user", "content": "turn two"})
    wait_idle(qtbot, window)

    hold = HoldEngine(c.host.thread)
    hold.hold()
    qtbot.waitUntil(hold.holding.is_set, timeout=TURN_TIMEOUT_MS)
    # The server's request reaches the engine's queue first, the window's message after it.
    request = Background(lambda: _stream_text(client.chat.completions.create(
        model="tiny-random", messages=conversation, max_tokens=5, temperature=0, stream=True)))
    qtbot.waitUntil(lambda: c.local_server.runner.waiting == 1, timeout=TURN_TIMEOUT_MS)
    assert c.send("Second question") and c.busy
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as finished:
        hold.release.set()
    qtbot.waitUntil(request.done.is_set, timeout=TURN_TIMEOUT_MS)
    assert request.error is None, request.error
    text, last = request.result
    assert last["timings"]["predicted_n"] > 0
    # The server's conversation went on from its own cache, though the window's was in the engine meanwhile.
    assert last["timings"]["reuse"] == "extend" and last["timings"]["cache_n"] > 0, last["timings"]

    # The window's message waited its turn (and said so), then went on from the window's cache: what it
    # prefilled starts exactly where its first reply ended, with no rebuild.
    assert any("your message is next" in s for s in statuses), statuses
    assert [r.kind for r in c.turns.rows] == ["turn", "server", "server", "turn"]
    second, origin = next((ev, o) for ev, o in prefills if o.ticket >= 0 and not o.rebuild)
    assert second.cache.position - second.new_tokens == after_first, (second, after_first)
    history = [{"role": m.role, "content": m.content} for m in c.chat.messages[:2]]
    new = c.host.worker.session.tokenizer.chat_delta(history, [{"role": "user", "content": "Second question"}],
                                                     add_generation_prompt=True)
    assert len(new) <= second.new_tokens <= len(new) + 2
    assert not any(o.rebuild for _, o in prefills)
    row = finished.args[0]
    assert row.prefill_tokens == second.new_tokens and row.tokens > 0 and not c.chat.messages[-1].streaming


def test_a_port_in_use_is_refused_clearly_and_the_switch_goes_off(qtbot, tmp_path, tiny):
    from app.settings import load_settings

    data = tmp_path / "data"
    write_settings(data)
    window = open_window(qtbot, data)
    c = window.controller
    with socket.socket() as other:  # another program's server on that port
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        _switch(qtbot, window, True, port)
        assert c.server_address is None and not c.local_server.running
        assert "already in use" in window.notice.label.text() and str(port) in window.notice.label.text()
        assert c.settings.server.serve is False and load_settings(data).server.serve is False
        assert not window.server_status.isVisible()
    send_text(qtbot, window, "Still here?")  # the window is not affected


def test_closing_the_window_mid_server_request_stops_it_and_frees_the_port(qtbot, tmp_path, tiny):
    from conftest_app import close_window

    port = _free_port()
    data = tmp_path / "data"
    write_settings(data, serve="true", server_port=port, server_key=KEY)
    window = open_window(qtbot, data)
    c = window.controller
    client = _client(window)
    started = threading.Event()

    def long_reply() -> int:
        stream = client.chat.completions.create(model="tiny-random", max_tokens=4000, temperature=0.8, stream=True,
                                                messages=[{"role": "user", "content": "Tell me everything"}])
        seen = 0
        try:
            for _ in stream:
                seen += 1
                started.set()
        except openai.APIError:
            pass  # the server went away mid-stream: what it sent before is what counts
        return seen

    request = Background(long_reply)
    qtbot.waitUntil(started.is_set, timeout=TURN_TIMEOUT_MS)
    pool = c.local_server.runner.pool
    close_window(qtbot, window)  # waits for closed: the engine and the server's thread have both ended
    assert not c.local_server.running and _port_free(port)
    qtbot.waitUntil(request.done.is_set, timeout=TURN_TIMEOUT_MS)
    assert request.error is None, request.error
    assert pool.last.stop_reason == "stopped" and pool.last.tokens < 4000
