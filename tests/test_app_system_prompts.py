"""System prompts per chat and their presets (issue 16, item 4): the store's step 4 on a step-3 database, and the real
window on the real tiny-random module (the pinning build: one module for every test here) giving each chat its own
prompt, the engine's prefill and the cache bar's pinned segment following it."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel

import app.store_migrations as store_migrations
from app.store import DB_FILE, Store
from app.system_prompts import CUSTOM_CHOICE, DEFAULT_CHOICE
from conftest_app import open_window, send_text, wait_idle, write_settings
from test_app_store import V1_CHATS, v1_database

PIRATE = "You are a pirate. Answer every question in one short line, like a pirate would."
ROBOT = "You are a robot."


def step_3_database(data: Path, monkeypatch) -> None:
    """A database as the release with schema version 3 (branches) left it: release 1's chats, migrated by the real
    steps 1 to 3, with an alternative reply added by that release's Store."""
    v1_database(data)
    with monkeypatch.context() as m:
        m.setattr(store_migrations, "MIGRATIONS", store_migrations.MIGRATIONS[:3])
        m.setattr(store_migrations, "SCHEMA_VERSION", 3)
        store = Store.open(data)
        maths = next(c for c in store.conversations() if c.title == "Maths")
        # As that release wrote it: today's Store writes columns a version 3 file does not have yet.
        (question,) = store.conn.execute("SELECT id FROM messages WHERE conversation_id=? ORDER BY seq, id LIMIT 1",
                                         (maths.id,)).fetchone()
        with store.conn:
            store.conn.execute("INSERT INTO messages(conversation_id, seq, role, content, created, parent_id, chosen) "
                               "VALUES (?, 1, 'assistant', 'Four.', 0, ?, 5)", (maths.id, question))
        store.close()
    conn = sqlite3.connect(str(data / DB_FILE))
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
        assert "system_prompt" not in [r[1] for r in conn.execute("PRAGMA table_info(conversations)")]
    finally:
        conn.close()


def test_a_step_3_database_keeps_every_chat_and_gains_system_prompts(tmp_path, monkeypatch):
    step_3_database(tmp_path, monkeypatch)
    store = Store.open(tmp_path)
    try:
        assert store.conn.execute("PRAGMA user_version").fetchone()[0] == store_migrations.SCHEMA_VERSION >= 4
        convs = store.conversations()
        assert sorted(c.title for c in convs) == sorted(V1_CHATS)
        for conv in convs:
            shown = [(m.role, m.content) for m in store.messages(conv.id)]
            if conv.title == "Maths":  # the alternative added at version 3 is the one shown, the first one kept
                assert shown == [("user", "What is 2+2?"), ("assistant", "Four.")]
                assert sorted(m.content for m in store.tree(conv.id)) == sorted(["What is 2+2?", "**4**", "Four."])
            else:
                assert shown == V1_CHATS[conv.title]
            assert store.system_prompt(conv.id) is None  # it follows Settings, as before
            assert len(store.turns(conv.id)) == sum(role == "assistant" for role, _ in V1_CHATS[conv.title])
        assert store.presets() == []
        # The new parts work on the migrated file: a chat's own prompt, presets with unique names.
        store.set_system_prompt(convs[0].id, ROBOT)
        store.save_preset("Robot", ROBOT)
        store.save_preset("Robot", ROBOT + " Beep.")  # same name: its text is replaced
        assert store.system_prompt(convs[0].id) == ROBOT and store.presets() == [("Robot", ROBOT + " Beep.")]
    finally:
        store.close()


def pick(qtbot, window, choice: str) -> None:
    """Chooses `choice` in the header's preset picker with the keyboard, as a user would."""
    picker = window.system_bar.picker
    target = picker.findText(choice)
    assert target >= 0, choice
    picker.setFocus()
    while picker.currentIndex() != target:
        qtbot.keyClick(picker, Qt.Key.Key_Down if picker.currentIndex() < target else Qt.Key.Key_Up)
    wait_idle(qtbot, window)


def chat_id(window, title_start: str) -> int:
    return next(r.id for r in window.controller.conversations.rows if r.title.startswith(title_start))


def test_a_preset_saved_and_picked_for_a_chat_survives_a_restart(qtbot, tmp_path, tiny_pinning):
    data = tmp_path / "data"
    write_settings(data, pin_system="true")
    window = open_window(qtbot, data)
    c, bar = window.controller, window.system_bar
    assert bar.picker.currentText() == DEFAULT_CHOICE and c.prompts.effective == ""
    send_text(qtbot, window, "First chat")
    c.prompts.set_chat_prompt(PIRATE)  # what the editor's OK does
    assert bar.picker.currentText() == CUSTOM_CHOICE
    assert bar.save_as_preset("Pirate")
    assert bar.picker.currentText() == "Pirate" and [n for n, _ in c.prompts.presets] == ["Pirate"]
    window.new_button.click()
    wait_idle(qtbot, window)
    assert bar.picker.currentText() == DEFAULT_CHOICE  # a new chat starts on the default
    send_text(qtbot, window, "Second chat")
    pick(qtbot, window, "Pirate")
    assert c.prompts.chat_prompt == PIRATE
    c.open_chat(chat_id(window, "First chat"))
    wait_idle(qtbot, window)
    pick(qtbot, window, DEFAULT_CHOICE)  # the first chat goes back to Settings' prompt
    window.close()

    window = open_window(qtbot, data)
    c, bar = window.controller, window.system_bar
    assert c.prompts.presets == [("Pirate", PIRATE)]
    c.open_chat(chat_id(window, "Second chat"))
    wait_idle(qtbot, window)
    assert bar.picker.currentText() == "Pirate" and bar.shown_text == PIRATE
    assert c.host.worker.session.messages[0] == {"role": "system", "content": PIRATE}
    c.open_chat(chat_id(window, "First chat"))
    wait_idle(qtbot, window)
    assert bar.picker.currentText() == DEFAULT_CHOICE and c.prompts.chat_prompt is None
    assert all(m["role"] != "system" for m in c.host.worker.session.messages)


def test_two_chats_each_get_their_own_system_prompt(qtbot, tmp_path, tiny_pinning):
    data = tmp_path / "data"
    write_settings(data, pin_system="true")
    window = open_window(qtbot, data)
    c = window.controller
    contexts: list = []
    c.host.worker.context.connect(lambda ctx, origin: contexts.append(ctx), Qt.ConnectionType.DirectConnection)
    send_text(qtbot, window, "Pirate chat")
    c.prompts.set_chat_prompt(PIRATE)
    wait_idle(qtbot, window)
    window.new_button.click()
    wait_idle(qtbot, window)
    send_text(qtbot, window, "Robot chat")
    c.prompts.set_chat_prompt(ROBOT)
    wait_idle(qtbot, window)
    session = c.host.worker.session

    def system_tokens(text: str) -> int:
        return len(session.tokenizer.encode_chat([{"role": "system", "content": text}], add_generation_prompt=False))

    assert system_tokens(PIRATE) != system_tokens(ROBOT)
    for title, prompt in (("Pirate chat", PIRATE), ("Robot chat", ROBOT), ("Pirate chat", PIRATE)):
        c.open_chat(chat_id(window, title))
        wait_idle(qtbot, window)
        # What the engine prefilled for this chat: its system message, and the span the Context event gives it.
        assert session.messages[0] == {"role": "system", "content": prompt}
        assert session.messages[1]["content"] == title
        ctx = contexts[-1]
        assert ctx.system == (0, system_tokens(prompt))
        # A turn in this chat is answered after its own prompt.
        send_text(qtbot, window, f"Again in {title}")
        assert c.chat.title == title  # still this chat (its row moved to the top of the list)
        assert session.messages[0] == {"role": "system", "content": prompt}
        assert contexts[-1].system == (0, system_tokens(prompt))


def test_the_cache_bar_shows_the_chat_prompt_pinned_in_the_sinks(qtbot, tmp_path, tiny_pinning):
    from app.cache_bar import BAR_PX, PIN_COLOUR

    data = tmp_path / "data"
    write_settings(data, pin_system="true")
    window = open_window(qtbot, data)
    c, bar = window.controller, window.stats.cache_bar
    assert bar.stats.pinned == 0 and bar.pinned_label() == "" and bar.height() == BAR_PX
    send_text(qtbot, window, "Ahoy?")
    c.prompts.set_chat_prompt(PIRATE)
    wait_idle(qtbot, window)
    pinned = c.host.worker.session.engine.pinned  # the engine's own count
    assert pinned > 20 and bar.stats.pinned == pinned == c.cache.pinned
    assert c.chat.messages and c.cache.sinks == pinned
    assert bar.pinned_label() == f"system prompt: {pinned} tokens pinned"
    assert bar.height() > BAR_PX
    image = bar.grab().toImage()
    # The pinned slots in the bar, and the bracket under them in the caption row, are the pin colour.
    bar_row = {image.pixelColor(x, BAR_PX // 2).name() for x in range(2, int(bar.pinned_width(bar.width())) - 3)}
    assert bar_row == {PIN_COLOUR.name()}
    bracket_row = {image.pixelColor(x, BAR_PX + 3).name() for x in range(3, int(bar.pinned_width(bar.width())) - 2)}
    assert PIN_COLOUR.name() in bracket_row
    # A reply keeps it pinned; a chat without a system prompt has no pinned segment.
    send_text(qtbot, window, "And again?")
    assert bar.stats.pinned == pinned
    window.new_button.click()
    wait_idle(qtbot, window)
    assert bar.stats.pinned == 0 and bar.pinned_label() == "" and bar.height() == BAR_PX


def test_a_fork_keeps_the_chat_prompt_and_the_export_writes_it(qtbot, tmp_path, tiny_pinning):
    import json

    data = tmp_path / "data"
    write_settings(data, pin_system="true")
    window = open_window(qtbot, data)
    c = window.controller
    send_text(qtbot, window, "Pirate chat")
    c.prompts.set_chat_prompt(PIRATE)
    wait_idle(qtbot, window)
    c.export_chat(tmp_path / "chat.md", "markdown")
    md = (tmp_path / "chat.md").read_text()
    assert md.index("**System:**") < md.index(PIRATE) < md.index("**You:**")
    c.export_chat(tmp_path / "chat.json", "json")
    messages = json.loads((tmp_path / "chat.json").read_text())["messages"]
    assert messages[0] == {"role": "system", "content": PIRATE} and messages[1]["content"] == "Pirate chat"

    forked_from = c.chat.conversation_id
    assert c.fork_chat(1)
    wait_idle(qtbot, window)
    assert c.chat.conversation_id != forked_from and c.prompts.chat_prompt == PIRATE
    assert c.store.system_prompt(c.chat.conversation_id) == PIRATE
    assert c.host.worker.session.messages[0] == {"role": "system", "content": PIRATE}
    assert [m["content"] for m in c.host.worker.session.messages[1:]] == [m.content for m in c.chat.messages]


def test_a_long_prompt_is_elided_in_the_header_and_whole_in_its_tooltip(qtbot, tmp_path):
    from app.system_prompt_bar import SystemPromptBar
    from app.system_prompts import SystemPrompts

    long_prompt = "You are a careful assistant. " * 40
    store = Store.open(tmp_path)
    prompts = SystemPrompts(store, lambda: long_prompt)
    bar = SystemPromptBar(prompts)
    qtbot.addWidget(bar)
    bar.resize(600, 40)
    bar.show()
    qtbot.waitExposed(bar)
    label = bar.text_label
    assert label.text() == " ".join(long_prompt.split())  # the whole prompt, on one line
    shown = QLabel.text(label)  # what is painted
    assert shown.endswith("…") and len(shown) < len(label.text())
    assert bar.minimumSizeHint().width() < 600  # the prompt asks for no width: the header never widens the chat
    assert label.toolTip().startswith("Settings' default system prompt; click to edit:") and long_prompt in label.toolTip()
    bar.resize(1400, 40)  # a wider window shows more of it
    qtbot.waitUntil(lambda: len(QLabel.text(label)) > len(shown))
    label.clicked.disconnect(bar.edit_prompt)  # the editor is modal
    with qtbot.waitSignal(label.clicked):
        qtbot.mouseClick(label, Qt.MouseButton.LeftButton)
    store.close()
