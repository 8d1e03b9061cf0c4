"""The desktop app end to end, headless, on the real compiled tiny-random module (no engine mocks)."""
from __future__ import annotations

import json
import sqlite3

import pytest

from conftest_app import TURN_TIMEOUT_MS, last_reply, open_window, send_text, wait_idle, write_settings

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QAbstractButton, QAbstractItemView, QLineEdit, QPlainTextEdit


@pytest.fixture
def window(qtbot, tmp_path, tiny):
    write_settings(tmp_path / "data")
    return open_window(qtbot, tmp_path / "data")


def stored(window, conv_id=None):
    c = window.controller
    return [(m.role, m.content) for m in c.store.messages(conv_id or c.chat.conversation_id)]


def test_message_streams_and_turn_finishes(qtbot, window):
    qtbot.keyClicks(window.compose, "line one")
    qtbot.keyClick(window.compose, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)  # a new line, not a send
    qtbot.keyClicks(window.compose, "line two")
    assert window.compose.toPlainText() == "line one\nline two" and window.controller.chat.messages == []
    window.compose.clear()
    tokens = []
    window.controller.chat.changed.connect(lambda i: i == 1 and tokens.append(window.controller.chat.messages[1].content))
    done = send_text(qtbot, window, "Hello there")
    reply = last_reply(window)
    chat = window.controller.chat
    assert done.stop_reason in ("length", "eos") and done.tokens > 0
    # Streamed piece by piece (each update a longer prefix of the reply), then the final text.
    assert len(tokens) > 2 and tokens[-1] == reply
    assert all(reply.startswith(t) for t in tokens) and len(set(tokens)) > 2
    assert [m.role for m in chat.messages] == ["user", "assistant"]
    assert not chat.messages[1].streaming
    assert window.compose.toPlainText() == ""
    assert stored(window) == [("user", "Hello there"), ("assistant", reply)]
    # The stats panel: one turn, its numbers, and the cache bar.
    assert window.stats.table.model().rowCount() == 1
    row = window.controller.turns.rows[0]
    assert row.kind == "turn" and row.prefill_tokens > 0 and row.tokens == done.tokens and row.tok_s > 0
    assert window.stats.cache_bar.stats.position == done.cache["position"] > 0
    assert "tok/s" in window.stats.rate_value.text()
    assert window.controller.chat.title == "Hello there"
    assert window.controller.conversations.rowCount() == 1


def test_stop_mid_reply(qtbot, tmp_path, tiny):
    write_settings(tmp_path / "data", max_new_tokens=4000)
    window = open_window(qtbot, tmp_path / "data")
    c = window.controller
    qtbot.keyClicks(window.compose, "Tell me everything")
    qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    assert c.busy and window.stop_button.isVisible() and not window.send_button.isVisible()
    qtbot.waitUntil(lambda: len(c.chat.messages[-1].content) > 0, timeout=TURN_TIMEOUT_MS)
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    done = blocker.args[0]
    assert done.stop_reason == "stopped" and done.tokens < 4000
    assert not c.busy and window.send_button.isVisible()
    assert c.chat.messages[-1].meta["stop_reason"] == "stopped"
    window.chat_view.flush()  # the view renders a changed message on its next tick
    assert "stopped" in window.chat_view.widgets[-1].meta.text()
    assert stored(window)[-1] == ("assistant", last_reply(window))
    # Esc stops too, and the app keeps working after a stop.
    qtbot.keyClicks(window.compose, "Again")
    qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: len(c.chat.messages[-1].content) > 0, timeout=TURN_TIMEOUT_MS)
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        window.escape()
    assert blocker.args[0].stop_reason == "stopped"
    assert [m.role for m in c.chat.messages] == ["user", "assistant"] * 2


def test_regenerate_replaces_last_reply(qtbot, window):
    c = window.controller
    first = send_text(qtbot, window, "Name a colour")
    first_reply = last_reply(window)
    assert window.regenerate_button.isEnabled()
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.regenerate_button, Qt.MouseButton.LeftButton)
    again = blocker.args[0]
    assert [(m.role, m.content) for m in c.chat.messages] == [("user", "Name a colour"), ("assistant", last_reply(window))]
    assert stored(window) == [("user", "Name a colour"), ("assistant", last_reply(window))]
    # The cache went back to before the question, which was prefilled again; greedy decoding gives the same answer.
    assert [r.kind for r in c.turns.rows] == ["turn", "turn"]
    assert last_reply(window) == first_reply
    assert again.prefill_tokens == first.prefill_tokens


def test_edit_last_message_and_resend(qtbot, window):
    c = window.controller
    send_text(qtbot, window, "First question")
    send_text(qtbot, window, "Second question")
    qtbot.mouseClick(window.edit_button, Qt.MouseButton.LeftButton)
    assert window.editing and window.compose.toPlainText() == "Second question"
    window.compose.clear()
    qtbot.keyClicks(window.compose, "Edited question")
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    done = blocker.args[0]
    assert not window.editing
    expected = ["First question", c.chat.messages[1].content, "Edited question", last_reply(window)]
    assert [m.content for m in c.chat.messages] == expected
    assert [m for _, m in stored(window)] == expected
    # The engine's session took the edit itself: three turns, the chat never sent back to it.
    assert [r.kind for r in c.turns.rows] == ["turn", "turn", "turn"] and done.prefill_tokens > 0
    session = c.host.worker._session
    assert [m["content"] for m in session.messages[-4:]] == expected


def test_eviction_shows_in_cache_bar_and_chat_view(qtbot, window):
    c = window.controller
    for i in range(4):
        send_text(qtbot, window, f"Message number {i} in a conversation longer than the window")
    window.chat_view.flush()
    bar = window.stats.cache_bar
    assert bar.stats.evicted > 0 and bar.stats.used == bar.stats.capacity == 64
    assert f"{bar.stats.evicted:,} tokens evicted" in window.stats.cache_label.text()
    assert f"{bar.stats.evicted:,} evicted" in bar.summary()
    forgotten = c.chat.forgotten()
    assert 0 < forgotten < len(c.chat.messages)
    assert window.chat_view.marker_index() == forgotten and window.chat_view.marker.isVisible()
    assert "no longer sees" in window.chat_view.marker.label.text()
    total = len(c.chat.messages)
    assert f"the last {total - forgotten} of {total} messages" in window.stats.context_label.text()
    window.stats.context_label.linkActivated.emit("#marker")  # "Show where" scrolls the marker into view
    qtbot.waitUntil(lambda: not window.chat_view.marker.visibleRegion().isEmpty())
    assert window.chat_view.widgets[0].forgotten and not window.chat_view.widgets[-1].forgotten
    assert "out of the model's window" in window.chat_view.widgets[0].meta.text()
    # Per-message spans agree with the engine's positions: the last reply ends where the cache is.
    assert c.chat.messages[-1].span[1] == bar.stats.position
    assert window.stats.table.model().rowCount() == 4 and window.stats.chart.model.rows[-1].kind == "turn"


def test_chats_survive_a_restart_and_rebuild_the_cache(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data)
    first = open_window(qtbot, data)
    send_text(qtbot, first, "Remember this")
    reply = last_reply(first)
    conv_id = first.controller.chat.conversation_id
    with qtbot.waitSignal(first.closed, timeout=TURN_TIMEOUT_MS):
        first.close()

    second = open_window(qtbot, data)
    c = second.controller
    assert c.chat.conversation_id == conv_id and c.chat.title == "Remember this"
    assert [(m.role, m.content) for m in c.chat.messages] == [("user", "Remember this"), ("assistant", reply)]
    wait_idle(qtbot, second)
    # Opening the chat rebuilt the cache from it: a ↻ entry with its prefill time, after the stored turn.
    kinds = [r.kind for r in c.turns.rows]
    assert kinds == ["turn", "rebuild"], kinds
    assert c.turns.rows[-1].prefill_tokens > 0 and c.turns.rows[-1].prefill_ms > 0
    assert second.stats.cache_bar.stats.position == c.turns.rows[-1].prefill_tokens
    assert all(m.span is not None for m in c.chat.messages), [(m.span, m.content) for m in c.chat.messages]
    more = send_text(qtbot, second, "And now?")
    assert more.prefill_tokens < c.turns.rows[1].prefill_tokens  # only the new turn is prefilled


def test_new_chat_switch_filter_rename_delete(qtbot, window):
    c = window.controller
    send_text(qtbot, window, "About apples")
    first_id = c.chat.conversation_id
    assert window.new_action.shortcut() == QKeySequence(QKeySequence.StandardKey.New)  # Ctrl+N
    window.new_action.trigger()
    assert c.chat.conversation_id is None and c.chat.messages == []
    send_text(qtbot, window, "About bananas")
    second_id = c.chat.conversation_id
    assert second_id != first_id and c.conversations.rowCount() == 2
    assert c.conversations.rows[0].id == second_id  # most recent first
    assert window._selected_conversation() == second_id  # and highlighted as the open one

    window.filter.setText("APPLE")
    assert window.proxy.rowCount() == 1
    index = window.proxy.index(0, 0)
    window.chat_list.setCurrentIndex(index)
    assert c.chat.conversation_id == first_id and c.chat.messages[0].content == "About apples"
    wait_idle(qtbot, window)
    assert c.turns.rows[-1].kind == "rebuild"  # switching rebuilt the cache from this chat
    window.filter.clear()

    assert window.proxy.setData(window.proxy.index(c.conversations.row_of(first_id), 0), "Fruit: apples")
    assert c.store.conversation(first_id).title == "Fruit: apples" and c.chat.title == "Fruit: apples"

    c.delete_chat(first_id)
    assert c.conversations.rowCount() == 1 and c.store.conversation(first_id) is None
    assert c.chat.conversation_id == second_id


def test_copy_and_export(qtbot, window, tmp_path):
    from PySide6.QtGui import QGuiApplication

    send_text(qtbot, window, "Export me")
    qtbot.mouseClick(window.copy_chat_button, Qt.MouseButton.LeftButton)
    assert "Export me" in QGuiApplication.clipboard().text()
    window.chat_view.widgets[0].copy.click()
    assert QGuiApplication.clipboard().text() == "Export me"
    window.controller.export_chat(tmp_path / "chat.md", "markdown")
    window.controller.export_chat(tmp_path / "chat.json", "json")
    assert "Export me" in (tmp_path / "chat.md").read_text()
    doc = json.loads((tmp_path / "chat.json").read_text())
    assert doc["messages"][1]["content"] == last_reply(window) and doc["turns"][0]["kind"] == "turn"


def fill_database(conn: sqlite3.Connection) -> int:
    """Makes the database unable to grow and fills its free space: writes then fail with SQLITE_FULL, as on
    a full disk. Returns the filler chat's id (delete it to free the space again)."""
    conn.execute("INSERT INTO conversations(title, created, updated) VALUES ('filler', 0, 0)")
    filler = conn.execute("SELECT max(id) FROM conversations").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0] + 2}")

    def insert(text: str) -> bool:
        try:
            conn.execute("INSERT INTO messages(conversation_id, seq, role, content, created) "
                         "VALUES (?, -1, 'filler', ?, 0)", (filler, text))
            return True
        except sqlite3.OperationalError as e:
            assert "full" in str(e)
            return False

    # Each message also goes into the search index, whose pages fill differently from the table's: fill
    # until a message like a chat's own no longer fits either (each probe that still fits fills some more).
    n = 0
    while True:
        for size in (20_000, 2_000, 200, 20, 1):
            while insert(" ".join(f"filler{n + i}" for i in range(max(1, size // 10)))):
                n += 1
        probes = ["After the disk filled up", "the reply of a model, " * 5, "a"]
        if not any(insert(p) for p in probes):
            return filler


def test_disk_full_keeps_the_chat_and_saves_later(qtbot, window):
    c = window.controller
    send_text(qtbot, window, "Before the disk filled up")
    filler = fill_database(c.store.conn)
    done = send_text(qtbot, window, "After the disk filled up")
    assert window.notice.isVisible() and window.notice.level == "error"
    assert "disk is full" in window.notice.label.text() and window.notice.button.text() == "Save now"
    assert len(c.chat.messages) == 4 and c.chat.messages[3].content and done.tokens  # nothing lost in memory
    assert len(stored(window)) == 2
    assert not c.retry_saves()  # still full
    c.store.conn.execute("PRAGMA max_page_count=1073741823")
    c.store.conn.execute("DELETE FROM conversations WHERE id=?", (filler,))
    qtbot.mouseClick(window.notice.button, Qt.MouseButton.LeftButton)  # "Save now"
    assert not c.saves.pending and window.notice.level == "info" and "saved again" in window.notice.label.text()
    assert [m for _, m in stored(window)] == [m.content for m in c.chat.messages]
    send_text(qtbot, window, "Saved again")  # and saving one message at a time works again
    assert len(stored(window)) == 6


def test_message_longer_than_the_window_streams_through_it(qtbot, window):
    c = window.controller
    cached: list = []
    c.cache_changed.connect(cached.append)
    text = "word " * 200  # far more than the 60-token window
    done = send_text(qtbot, window, text)
    assert done.tokens > 0 and done.prefill_tokens > 200 and done.cache["evicted"] > 100
    # The cache bar moved while the message streamed in, before the reply.
    assert len({e.position for e in cached}) > 3
    assert [(m.role, m.content.strip()) for m in c.chat.messages][0] == ("user", text.strip())
    assert c.store.messages(c.chat.conversation_id)[0].content.strip() == text.strip()
    assert send_text(qtbot, window, "short").tokens > 0  # and the chat goes on


def test_model_that_cannot_load_leaves_the_app_usable(qtbot, tmp_path):
    data = tmp_path / "data"
    write_settings(data)
    window = open_window(qtbot, data, model=str(tmp_path / "missing.gguf"), wait_ready=False)
    qtbot.waitUntil(lambda: window.controller.model_state == "failed", timeout=TURN_TIMEOUT_MS)
    assert window.notice.isVisible() and "not found" in window.notice.label.text()
    assert window.notice.button.isVisible()  # offers the settings
    assert not window.send_button.isEnabled() and not window.controller.send("hello")
    window.controller.new_chat()  # still usable


def test_damaged_database_is_reported_in_the_window(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data)
    (data / "eddy.db").write_bytes(b"garbage" * 1000)
    window = open_window(qtbot, data)
    moved = list(data.glob("eddy.db.damaged-*"))
    text = window.notice.label.text()
    assert window.notice.isVisible() and len(moved) == 1 and f"kept as {moved[0]}" in text
    assert "no chat could be read" in text
    send_text(qtbot, window, "fresh start")
    assert len(stored(window)) == 2


def test_cancelling_a_build(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data, window=52)  # settings never built: the first start compiles
    window = open_window(qtbot, data, wait_ready=False)
    qtbot.waitUntil(lambda: window.progress_dialog is not None, timeout=TURN_TIMEOUT_MS)
    dialog = window.progress_dialog
    assert dialog.isVisible() and window.isEnabled()
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.controller.model_state == "failed", timeout=60_000)
    assert window.progress_dialog is None
    assert "cancelled" in window.notice.label.text() and window.notice.button.text() == "Build again"


def test_controls_have_accessible_names(window):
    for w in window.findChildren(QAbstractButton) + window.findChildren(QLineEdit) + \
            window.findChildren(QPlainTextEdit) + window.findChildren(QAbstractItemView):
        if w.objectName().startswith("qt_") or not w.isVisibleTo(window):
            continue
        name = w.accessibleName() or (w.text() if hasattr(w, "text") and isinstance(w.text(), str) else "")
        assert name, f"{type(w).__name__} {w.objectName()!r} has no accessible name"


def test_settings_dialog_applies_generation_settings_without_a_rebuild(qtbot, window):
    from app.settings_dialog import SettingsDialog

    c = window.controller
    send_text(qtbot, window, "Hello")
    dialog = SettingsDialog(c.settings, window)
    qtbot.addWidget(dialog)
    assert dialog.rebuild_note.isHidden()
    dialog.window.setValue(dialog.window.value() + 8)
    assert not dialog.rebuild_note.isHidden()  # says that this change rebuilds the model
    dialog.window.setValue(dialog.window.value() - 8)
    assert dialog.rebuild_note.isHidden()
    dialog.system_prompt.setPlainText("You are Eddy. Be brief.")
    dialog.max_new_tokens.setValue(7)
    dialog.sampling["top_p"].setValue(0.9)
    new = dialog.value()
    c.apply_settings(new)
    assert c.model_state == "ready" and window.progress_dialog is None
    wait_idle(qtbot, window)
    # A new system prompt means a new beginning of the chat: the cache was rebuilt with it.
    assert c.turns.rows[-1].kind == "rebuild"
    done = send_text(qtbot, window, "And again")
    assert done.tokens <= 7
    session = c.host.worker._session
    assert session.messages[0] == {"role": "system", "content": "You are Eddy. Be brief."}
    assert session.settings.sampling.top_p == 0.9
    # Fields the user never set follow the loaded model's defaults (tiny-random recommends none: Eddy's).
    from engine.run.generation import EDDY_CHAT_DEFAULTS, ChatDefaults

    assert c.chat_defaults == ChatDefaults()
    assert new.chat.sampling.min_p is None and session.settings.sampling.min_p == EDDY_CHAT_DEFAULTS["min_p"]
    from app.settings import load_settings

    assert load_settings(window.data_dir) == new  # kept for the next start


def test_settings_dialog_shows_the_models_defaults_and_resets_to_them(qtbot):
    from app.settings import AppSettings
    from app.settings_dialog import SettingsDialog
    from engine.run.generation import chat_defaults

    defaults = chat_defaults({"temperature": 0.6, "top_p": 0.9}, "generation_config.json")
    dialog = SettingsDialog(AppSettings.of(top_k=5), None, None, defaults)
    qtbot.addWidget(dialog)
    # Each field shows the value in force: the user's own top-k, the model's temperature, Eddy's min-p.
    boxes = dialog.sampling
    assert (boxes["temperature"].value(), boxes["top_p"].value(), boxes["top_k"].value(), boxes["min_p"].value()) == (
        0.6, 0.9, 5, 0.05)
    assert "generation_config.json" in dialog.defaults_note.text()
    assert dialog.value().sampling_overrides() == {"top_k": 5}
    rows = dialog._sampling_rows
    assert rows["top_k"].font().bold() and not rows["temperature"].font().bold()
    boxes["temperature"].setValue(1.2)
    assert dialog.value().chat.sampling.temperature == 1.2 and rows["temperature"].font().bold()
    boxes["temperature"].setValue(0.6)  # back at the model's value: follows the model again
    assert dialog.value().chat.sampling.temperature is None
    assert dialog.reset_sampling.isEnabled()
    dialog.reset_sampling.click()
    assert dialog.value().sampling_overrides() == {} and boxes["top_k"].value() == 40
    assert not dialog.reset_sampling.isEnabled() and not rows["top_k"].font().bold()


def test_the_weight_and_kv_cache_types_start_at_auto_and_a_named_one_is_kept(qtbot):
    from app.settings import AppSettings
    from app.settings_dialog import AUTO_KV_LABEL, AUTO_LABEL, SettingsDialog

    dialog = SettingsDialog(AppSettings(), None)
    qtbot.addWidget(dialog)
    assert dialog.dtype.currentText() == AUTO_LABEL and dialog.value().build.dtype == "auto"
    assert dialog.kv_dtype.currentText() == AUTO_KV_LABEL and dialog.value().build.kv_dtype == "auto"
    assert dialog.rebuild_note.isHidden()
    dialog.dtype.setCurrentIndex(dialog.dtype.findData("q8"))
    assert dialog.value().build.dtype == "q8" and not dialog.rebuild_note.isHidden()
    dialog.dtype.setCurrentIndex(dialog.dtype.findData("auto"))
    dialog.kv_dtype.setCurrentIndex(dialog.kv_dtype.findData("f32"))
    assert dialog.value().build.kv_dtype == "f32" and not dialog.rebuild_note.isHidden()
    named = SettingsDialog(AppSettings.of(dtype="f16", kv_dtype="bf16"), None)
    qtbot.addWidget(named)
    assert named.dtype.currentText() == "f16" and named.value().build.dtype == "f16"
    assert named.kv_dtype.currentText() == "bf16" and named.value().build.kv_dtype == "bf16"


def test_a_rebuild_inside_the_session_moves_the_marker_to_the_right_message(qtbot, tmp_path, tiny, tiny_reference):
    from conftest import MARK_LATEST_USER, transformers_model

    folder = tmp_path / "latest-marking-model"
    transformers_model(*tiny_reference).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_bytes((tiny.folder / "tokenizer.json").read_bytes())
    chat = json.loads((tiny.folder / "chat.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": chat["bos_token"], "eos_token": chat["eos_token"], "chat_template": MARK_LATEST_USER}))
    data = tmp_path / "data"
    write_settings(data, model=str(folder), max_new_tokens=6)
    window = open_window(qtbot, data, model=str(folder))
    c = window.controller
    session = c.host.worker._session
    for i in range(6):
        send_text(qtbot, window, f"Turn {i}: a message that takes a fair share of the small window")
    wait_idle(qtbot, window)
    window.chat_view.flush()
    assert session.dropped > 0 and c.chat.messages[-1].role == "assistant"
    # What the session holds is the chat's tail from the message after the dropped ones; the marker sits there.
    kept = len([m for m in session.messages if m["role"] != "system"])
    assert c.chat.forgotten() == len(c.chat.messages) - kept == session.dropped
    assert window.chat_view.marker_index() == session.dropped and window.chat_view.marker.isVisible()
    # The engine's spans: the kept messages in order, the last reply ending where the cache is.
    spans = [m.span for m in c.chat.messages[session.dropped:]]
    assert spans[0][0] >= 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == session.engine.stats.position
