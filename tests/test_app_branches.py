"""Alternatives and branches, end to end on the real compiled tiny-random module: regenerated replies and edited
messages as alternatives (‹ 2/3 ›), switching between them (the engine follows), forking a chat, a database
from before branches, and exports of the branch shown and of the whole tree."""
from __future__ import annotations

import json
import sqlite3

from conftest_app import TURN_TIMEOUT_MS, last_reply, open_window, send_text, wait_idle, write_settings

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMenu

import app.store_migrations as store_migrations
from app.store import DB_FILE, Store
from app.transcript import to_markdown
from engine.run.session import ChatSession, ChatSettings
from engine.run.sampling import SamplingParams


def regenerate(qtbot, window):
    with qtbot.waitSignal(window.controller.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.regenerate_button, Qt.MouseButton.LeftButton)
    return blocker.args[0]


def switch(qtbot, window, index: int, step: int) -> None:
    """Clicks ‹ (step -1) or › (+1) on message `index` and waits until the engine has followed."""
    window.chat_view.flush()
    w = window.chat_view.widgets[index]
    qtbot.mouseClick(w.previous if step < 0 else w.next, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, window)
    window.chat_view.flush()


def menu_action(window, index: int, text: str) -> None:
    menu = QMenu()
    window.chat_view.widgets[index].fill_menu(menu)
    (action,) = [a for a in menu.actions() if a.text() == text]
    assert action.isEnabled()
    action.trigger()


def menu_texts(window, index: int) -> list[str]:
    menu = QMenu()
    window.chat_view.widgets[index].fill_menu(menu)
    return [a.text() for a in menu.actions()]


def switcher(window, index: int) -> str:
    w = window.chat_view.widgets[index]
    return w.position.text() if w.position.isVisibleTo(w) else ""


def shown(window) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in window.controller.chat.messages]


def three_turns(qtbot, data, **settings):
    """A window whose chat has three short questions answered: (window, controller, the chat as shown)."""
    write_settings(data, **settings)
    window = open_window(qtbot, data)
    for text in ("First question", "Second question", "Third question"):
        send_text(qtbot, window, text)
    window.chat_view.flush()
    return window, window.controller, shown(window)


def session_conversation(window) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in window.controller.host.worker._session.conversation]


def test_regenerated_replies_are_alternatives_that_survive_a_restart_and_export(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data, temperature=1.0)  # sampled: each reply its own (they are told apart by id anyway)
    window = open_window(qtbot, data)
    c = window.controller
    send_text(qtbot, window, "Name a colour")
    replies = [last_reply(window)]
    for _ in range(2):
        regenerate(qtbot, window)
        replies.append(last_reply(window))
    window.chat_view.flush()
    assert [m.role for m in c.chat.messages] == ["user", "assistant"]
    assert switcher(window, 1) == "3/3" and switcher(window, 0) == ""
    assert window.chat_view.widgets[1].previous.isEnabled() and not window.chat_view.widgets[1].next.isEnabled()
    conv = c.chat.conversation_id
    assert len(c.store.tree(conv)) == 4  # the question and its three replies
    rebuilds = len([r for r in c.turns.rows if r.kind == "rebuild"])
    switch(qtbot, window, 1, -1)
    assert switcher(window, 1) == "2/3" and last_reply(window) == replies[1]
    # The engine took the branch shown: its cache was rebuilt from the question on (a ↻ row in the stats).
    assert session_conversation(window) == shown(window)
    assert len([r for r in c.turns.rows if r.kind == "rebuild"]) == rebuilds + 1
    assert c.turns.rows[-1].prefill_tokens > 0 and window.stats.table.model().rowCount() == len(c.turns.rows)
    assert c.chat.messages[-1].span[1] == window.stats.cache_bar.stats.position

    # Export: Markdown is the branch shown; JSON has it, and the whole tree with the branch shown marked.
    c.export_chat(tmp_path / "chat.md", "markdown")
    # As bytes: read_text's universal newlines would turn a "\r" in a sampled reply into "\n".
    md = (tmp_path / "chat.md").read_bytes().decode("utf-8")
    assert md == to_markdown("Name a colour", shown(window)) and md.count("**Eddy:**") == 1
    c.export_chat(tmp_path / "chat.json", "json")
    doc = json.loads((tmp_path / "chat.json").read_text())
    assert [(m["role"], m["content"]) for m in doc["messages"]] == list(shown(window))
    assert doc["messages"][1]["model"] == "tiny-random"  # which model wrote the reply
    tree = doc["tree"]
    assert [(n["role"], n["content"], n["parent"]) for n in tree] == \
        [("user", "Name a colour", None)] + [("assistant", r, 0) for r in replies]
    assert [n["shown"] for n in tree] == [True, False, True, False]

    with qtbot.waitSignal(window.closed, timeout=TURN_TIMEOUT_MS):
        window.close()
    again = open_window(qtbot, data)
    c = again.controller
    again.chat_view.flush()
    assert c.chat.conversation_id == conv and shown(again) == [("user", "Name a colour"), ("assistant", replies[1])]
    assert switcher(again, 1) == "2/3"
    switch(qtbot, again, 1, +1)
    assert last_reply(again) == replies[2] and switcher(again, 1) == "3/3"
    assert session_conversation(again) == shown(again)


def test_a_branch_switch_past_the_window_rebuilds_and_the_marker_follows(qtbot, tmp_path, tiny):
    write_settings(tmp_path / "data")
    window = open_window(qtbot, tmp_path / "data")
    c = window.controller
    for i in range(4):
        send_text(qtbot, window, f"Message number {i} in a conversation longer than the window")
    first = last_reply(window)
    # Greedy decoding writes the same reply again; an edit of the last question gives another branch instead.
    window.start_edit()
    window.compose.clear()
    qtbot.keyClicks(window.compose, "A different last question, long enough to push this branch's start out")
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    window.chat_view.flush()
    assert switcher(window, 6) == "2/2" and c.chat.messages[6].content.startswith("A different last question")
    assert window.stats.cache_bar.stats.evicted > 0  # what the branches share is no longer all in the cache
    rows = len(c.turns.rows)
    switch(qtbot, window, 6, -1)
    assert c.chat.messages[6].content.startswith("Message number 3") and last_reply(window) == first
    # Tokens of the shared part have left the cache, so it was rebuilt from what fits of this branch.
    rebuild = c.turns.rows[-1]
    assert len(c.turns.rows) == rows + 1 and rebuild.kind == "rebuild"
    session = c.host.worker._session
    assert rebuild.prefill_tokens == session.engine.stats.position
    assert session.dropped > 0 and session_conversation(window) == shown(window)[session.dropped:]
    # The marker is where the engine's Context says the model's view begins.
    assert c.chat.forgotten() == c.chat.context.forgotten == session.dropped
    assert window.chat_view.marker_index() == session.dropped and window.chat_view.marker.isVisible()
    assert all(m.span is None for m in c.chat.messages[: session.dropped])
    assert all(m.span is not None for m in c.chat.messages[session.dropped:])
    # And the chat goes on from that branch.
    more = send_text(qtbot, window, "And then?")
    assert more.prefill_tokens < rebuild.prefill_tokens
    assert session_conversation(window) == shown(window)[session.dropped:]


def test_editing_a_middle_message_branches_and_the_old_branch_stays(qtbot, tmp_path, tiny):
    window, c, before = three_turns(qtbot, tmp_path / "data", max_new_tokens=6)
    menu_action(window, 2, "Edit message…")  # the second question
    assert window.editing and window.compose.toPlainText() == "Second question"
    assert "new branch" in window.edit_label.text() and "last" not in window.edit_label.text()
    window.compose.clear()
    qtbot.keyClicks(window.compose, "Second question, edited")
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    edited = blocker.args[0]
    window.chat_view.flush()
    assert not window.editing
    assert shown(window)[:2] == before[:2] and shown(window)[2] == ("user", "Second question, edited")
    assert len(c.chat.messages) == 4 and switcher(window, 2) == "2/2"
    # The session went back to before the edited message (rewound, or rebuilt when that was evicted: its
    # choice), so the turn prefilled that message alone, right after the first reply.
    assert [r.kind for r in c.turns.rows] == ["turn"] * 4
    begin, end = c.chat.messages[2].span
    assert edited.prefill_tokens == end - begin and begin == c.chat.messages[1].span[1]
    assert session_conversation(window) == shown(window)
    conv = c.chat.conversation_id
    assert [(m.role, m.content) for m in c.store.messages(conv)] == shown(window)
    assert len(c.store.tree(conv)) == 8
    # The old branch, with everything after it, is one click away.
    switch(qtbot, window, 2, -1)
    assert shown(window) == before and switcher(window, 2) == "1/2"
    views = window.chat_view.widgets
    assert len(views) == 6 and [views[i].body.toPlainText() for i in (2, 4)] == ["Second question", "Third question"]
    assert session_conversation(window) == before
    assert [(m.role, m.content) for m in c.store.messages(conv)] == before


def test_regenerating_an_earlier_reply_makes_it_an_alternative_with_its_branch_kept(qtbot, tmp_path, tiny):
    # Sampled: the regenerated reply is one of its own.
    window, c, before = three_turns(qtbot, tmp_path / "data", max_new_tokens=6, temperature=1.0)
    menu = QMenu()
    window.chat_view.widgets[0].fill_menu(menu)
    assert "Regenerate reply" not in [a.text() for a in menu.actions()]  # a user message has Edit instead
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        menu_action(window, 3, "Regenerate reply")  # the second reply
    again = blocker.args[0]
    window.chat_view.flush()
    # The chat now ends with the new second reply; the turn fed the second question again after the first reply.
    assert shown(window)[:3] == before[:3] and len(c.chat.messages) == 4 and switcher(window, 3) == "2/2"
    begin, end = c.chat.messages[2].span
    assert begin == c.chat.messages[1].span[1] and again.prefill_tokens == end - begin
    assert session_conversation(window) == shown(window)
    conv = c.chat.conversation_id
    assert [(m.role, m.content) for m in c.store.messages(conv)] == shown(window)
    # The old reply is one click away, with the third question and its reply after it.
    switch(qtbot, window, 3, -1)
    assert shown(window) == before and switcher(window, 3) == "1/2"
    assert session_conversation(window) == before[c.host.worker._session.dropped:]  # what fits the tiny window


def test_deleting_an_alternative_takes_its_branch_and_the_cache_follows(qtbot, tmp_path, tiny, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    data = tmp_path / "data"
    window, c, before = three_turns(qtbot, data, max_new_tokens=6)
    assert "Delete this alternative…" not in menu_texts(window, 2)  # nothing to show in its place
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        assert c.edit_message(2, "Second question about zebras")
    window.chat_view.flush()
    conv = c.chat.conversation_id
    assert switcher(window, 2) == "2/2" and len(c.store.tree(conv)) == 8
    gone = {c.chat.messages[2].id, c.chat.messages[3].id}  # the edited question and its reply
    assert None not in gone
    asked: list[str] = []

    def answer(parent, title, text, *args):
        asked.append(text)
        return QMessageBox.StandardButton.Yes

    monkeypatch.setattr(QMessageBox, "question", answer)
    menu_action(window, 2, "Delete this alternative…")  # the edited question: its reply goes with it
    wait_idle(qtbot, window)
    window.chat_view.flush()
    assert asked and "alternative 2 of 2" in asked[0]
    # The branch chosen before it is shown again, with all of its messages, and the engine took it.
    assert shown(window) == before and switcher(window, 2) == ""
    assert session_conversation(window) == before[c.host.worker._session.dropped:]
    assert [(m.role, m.content) for m in c.store.messages(conv)] == before and len(c.store.tree(conv)) == 6
    # The deleted rows left the search index too: nothing finds them, and the index matches the table.
    assert not [h for h in c.store.search("zebras") if h.message_id is not None]
    c.store.conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")
    assert not gone & {m.id for m in c.store.tree(conv)}

    with qtbot.waitSignal(window.closed, timeout=TURN_TIMEOUT_MS):
        window.close()
    again = open_window(qtbot, data)
    again.chat_view.flush()
    assert shown(again) == before and switcher(again, 2) == ""


def test_fork_copies_the_chat_up_to_a_message_into_a_new_chat(qtbot, tmp_path, tiny):
    write_settings(tmp_path / "data", max_new_tokens=6)  # two turns that fit the window
    window = open_window(qtbot, tmp_path / "data")
    c = window.controller
    send_text(qtbot, window, "Where do we start?")
    send_text(qtbot, window, "And where do we go?")
    original, whole = c.chat.conversation_id, shown(window)
    window.chat_view.flush()
    menu_action(window, 1, "Fork chat here")
    wait_idle(qtbot, window)
    fork = c.chat.conversation_id
    assert fork not in (None, original) and c.chat.title == "Where do we start? (fork)"
    assert shown(window) == whole[:2]
    assert [r.title for r in c.conversations.rows][:2] == ["Where do we start? (fork)", "Where do we start?"]
    assert [(m.role, m.content) for m in c.store.messages(fork)] == whole[:2]
    assert [(m.role, m.content) for m in c.store.messages(original)] == whole
    assert window.chat_list.currentIndex().data() == "Where do we start? (fork)"
    # The engine went back to the shared start: nothing was prefilled, and the fork goes on from there.
    assert session_conversation(window) == whole[:2] and c.turns.rows == []
    more = send_text(qtbot, window, "Somewhere else")
    assert more.prefill_tokens < c.host.worker._session.engine.stats.position // 2
    assert len(c.store.messages(fork)) == 4 and len(c.store.messages(original)) == 4


def test_switching_while_a_reply_is_written_is_refused(qtbot, tmp_path, tiny):
    write_settings(tmp_path / "data", max_new_tokens=4000)
    window = open_window(qtbot, tmp_path / "data")
    c = window.controller
    qtbot.keyClicks(window.compose, "Hello")
    qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: len(c.chat.messages[-1].content) > 0, timeout=TURN_TIMEOUT_MS)
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        window.escape()
    qtbot.mouseClick(window.regenerate_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(c.chat.messages[-1].content) > 0, timeout=TURN_TIMEOUT_MS)
    window.chat_view.flush()
    assert not window.chat_view.widgets[1].previous.isEnabled()  # locked while writing
    before = [m.content for m in c.chat.messages]
    assert not c.switch_alternative(1, -1) and not c.fork_chat(0)
    assert window.notice.level == "info" and "Wait for the reply" in window.notice.label.text()
    assert c.busy and c.chat.messages[-1].streaming and c.chat.messages[0].content == before[0]
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        window.escape()
    window.chat_view.flush()
    assert switcher(window, 1) == "2/2" and window.chat_view.widgets[1].previous.isEnabled()
    assert c.switch_alternative(1, -1)
    wait_idle(qtbot, window)
    assert session_conversation(window) == shown(window)


# --- a database from before branches ----------------------------------------------------------------------


def version_2_database(data) -> None:
    """A database as the previous Eddy left it: only steps 1 and 2 of the migrations, rows as its Store wrote
    them (two messages at one seq, as a crash between two writes could leave, included)."""
    data.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(data / DB_FILE), isolation_level=None)
    for version, step in store_migrations.MIGRATIONS[:2]:
        assert version <= 2
        for statement in store_migrations.statements(step):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=2")
    chats = {"Old one": ["u a", "r a", "u b", "r b"], "Old two": ["u c", "r c", "u d"]}
    for n, (title, texts) in enumerate(chats.items()):
        conv = conn.execute("INSERT INTO conversations(title, created, updated) VALUES (?, ?, ?)",
                            (title, 1.0 + n, 2.0 + n)).lastrowid
        for seq, text in enumerate(texts):
            conn.execute("INSERT INTO messages(conversation_id, seq, role, content, created) VALUES (?, ?, ?, ?, 0)",
                         (conv, min(seq, 2), "user" if text.startswith("u") else "assistant", text))
    conn.close()


def test_a_database_from_before_branches_keeps_every_chat_in_order(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    version_2_database(data)
    store = Store.open(data)
    # Migrated through every later step (branches' parents are step 3).
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == store_migrations.SCHEMA_VERSION >= 3
    convs = {r.title: r.id for r in store.conversations()}
    assert list(convs) == ["Old two", "Old one"]
    assert [m.content for m in store.messages(convs["Old one"])] == ["u a", "r a", "u b", "r b"]
    assert [m.content for m in store.messages(convs["Old two"])] == ["u c", "r c", "u d"]
    # One chain each: every message the child of the one before it.
    for conv in convs.values():
        tree = store.tree(conv)
        assert [m.parent_id for m in tree] == [None] + [m.id for m in tree[:-1]]
    assert [h.conversation_id for h in store.search("d")] == [convs["Old two"]]  # still searchable
    store.close()
    write_settings(data)
    window = open_window(qtbot, data)
    c = window.controller
    window.chat_view.flush()
    assert c.chat.title == "Old two" and [m.content for m in c.chat.messages] == ["u c", "r c", "u d"]
    assert all(switcher(window, i) == "" for i in range(3))
    c.open_chat(convs["Old one"])
    wait_idle(qtbot, window)
    assert [m.content for m in c.chat.messages] == ["u a", "r a", "u b", "r b"]
    regenerate(qtbot, window)
    window.chat_view.flush()
    assert switcher(window, 3) == "2/2" and [m.content for m in c.chat.messages][:3] == ["u a", "r a", "u b"]
    assert len(c.store.tree(convs["Old one"])) == 5


# --- the engine side of a switch --------------------------------------------------------------------------


def test_follow_leaves_the_cache_as_a_rebuild_would(tiny):
    settings = ChatSettings(max_new_tokens=6, sampling=SamplingParams(temperature=0.0))
    session = ChatSession(tiny.engine, tiny.tokenizer, settings)
    session.reset()
    session.answer("one")
    session.answer("two")
    a = [dict(m) for m in session.conversation]
    b = [*a[:2], {"role": "user", "content": "two, edited"}, {"role": "assistant", "content": "a reply"}]
    events = []
    prefill = session.follow(b, events.append)
    # Rewound to the second question, which is where the branches part: only the new branch's end was prefilled.
    assert 0 < prefill.new_tokens < session.engine.stats.position
    assert [type(e).__name__ for e in events] == ["Prefill", "Context"]
    assert [dict(m) for m in session.conversation] == b and session.dropped == 0
    followed = session.engine.mirror()
    assert events[-1].spans[-1][1] == session.engine.stats.position
    session.resume(b)
    # The new branch's tokens are what a rebuild renders for it (the shared start holds the replies' tokens as
    # sampled, which a rebuild tokenizes afresh).
    n = prefill.new_tokens
    assert followed[-n:] == session.engine.mirror()[-n:]
    # A branch ending with a question whose reply is not in it: cut before that question (the cache after it
    # also holds the generation prompt, which a rendered chat does not end with), and it is fed again.
    prefill = session.follow(b[:3])
    assert 0 < prefill.new_tokens < session.engine.stats.position
    followed = session.engine.mirror()
    session.resume(b[:3])
    assert followed[-prefill.new_tokens:] == session.engine.mirror()[-prefill.new_tokens:]
    assert session.context().spans[-1][1] == session.engine.stats.position
    # Going back to the start of a turn prefills nothing.
    start_of_third = session.spans[2][0]
    assert session.follow(a[:2]).new_tokens == 0 and session.engine.stats.position == start_of_third
    # A branch that goes on from the reply just written: the tokens owed for closing that reply come first.
    session.reset()
    session.answer("one")
    longer = [*[dict(m) for m in session.conversation], {"role": "user", "content": "more"},
              {"role": "assistant", "content": "yes"}]
    prefill = session.follow(longer)
    followed = session.engine.mirror()
    session.resume(longer)
    assert followed[-prefill.new_tokens:] == session.engine.mirror()[-prefill.new_tokens:]
    # A branch that shares nothing is a rebuild.
    other = [{"role": "user", "content": "else"}, {"role": "assistant", "content": "x"}]
    assert session.follow(other).new_tokens == session.engine.stats.position > 0
