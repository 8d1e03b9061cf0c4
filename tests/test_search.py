"""Search across chats: the store's FTS5 index (kept in step by triggers, filled by the migration for an old
database) and, in the window, a hit opening its chat scrolled to the message."""
from __future__ import annotations

import conftest_app  # noqa: F401  (headless Qt platform; skips without PySide6)

import app.store_migrations as store_migrations
from app.store import Store
from app.store_search import MARK_END, MARK_START, fts_query
from test_app_store import V1_CHATS, assert_v1_chats, user_version, v1_database


def marked(hit) -> list[str]:
    """The words a snippet marks as matches."""
    out, rest = [], hit.snippet
    while MARK_START in rest:
        rest = rest.split(MARK_START, 1)[1]
        word, rest = rest.split(MARK_END, 1)
        out.append(word)
    return out


def test_search_finds_titles_and_messages_and_follows_every_change(tmp_path):
    store = Store.open(tmp_path)
    fruit = store.create_conversation("Fruit salad")
    store.append_message(fruit, 0, "user", "How do I pick a ripe mango?")
    store.append_message(fruit, 1, "assistant", "Press it gently: a ripe mango gives a little.")
    other = store.create_conversation("Café notes")
    store.append_message(other, 0, "user", "Espresso or filter?")
    hits = store.search("mango")
    assert sorted((h.conversation_id, h.seq, h.role) for h in hits) == [(fruit, 0, "user"), (fruit, 1, "assistant")]
    assert all(marked(h) == ["mango"] for h in hits)
    assert hits[0].title == "Fruit salad" and hits[0].message_id is not None
    # Titles first; a word's start finds the word; accents are not needed.
    (title,) = store.search("cafe")
    assert (title.conversation_id, title.message_id, title.seq, marked(title)) == (other, None, -1, ["Café"])
    assert {h.seq for h in store.search("ESPRESS")} == {0}
    assert [h.seq for h in store.search("ripe gently")] == [1]  # every word must be there
    # The index follows renames, truncation, a whole chat rewritten and a deleted chat.
    store.rename_conversation(other, "Coffee notes")
    assert store.search("cafe") == [] and store.search("coffee")[0].conversation_id == other
    store.truncate_messages(fruit, 1)
    assert [h.seq for h in store.search("mango")] == [0]
    store.replace_messages(fruit, "Fruit salad", [("user", "papaya instead")])
    assert store.search("mango") == [] and store.search("papaya")[0].seq == 0
    store.delete_conversation(other)
    assert store.search("espresso") == [] and store.search("coffee") == []
    store.close()


def test_what_a_user_types_is_never_a_query_syntax_error(tmp_path):
    store = Store.open(tmp_path)
    conv = store.create_conversation("Syntax")
    store.append_message(conv, 0, "user", 'He said "AND( NOT x OR y)" near: title:* -z ^ {a b}')
    for text in ['"', '""', 'AND(', 'NOT', 'a OR', '*', 'title:', '-z', '^', '{a', "NEAR(a b)", "'", "\\", "\x00",
                 "\ud800", "   ", ""]:
        store.search(text)  # never raises
    assert fts_query('say "hi"') == '"say"* """hi"""*'
    assert store.search('AND(')[0].seq == 0 and store.search('"AND(')[0].seq == 0
    assert store.search('"') == [] and store.search("") == []
    store.close()


def test_an_old_database_keeps_every_chat_and_becomes_searchable(tmp_path):
    db = v1_database(tmp_path)
    store = Store.open(tmp_path)
    assert_v1_chats(store)
    assert user_version(db) == store_migrations.SCHEMA_VERSION >= 2
    poem = next(c.id for c in store.conversations() if c.title.startswith("Poem"))
    assert [(h.conversation_id, h.seq) for h in store.search("roses")] == [(poem, 1)]
    assert [h.message_id for h in store.search("quotes")] == [None]  # the title
    assert len(store.search("2")) == 1  # "What is 2+2?"
    store.close()
    # Opening it again runs no step twice, and the chats are still all there.
    store = Store.open(tmp_path)
    assert_v1_chats(store)
    assert len(store.search("again")) == 1
    store.close()
    assert len(V1_CHATS) == 2


# --- in the window --------------------------------------------------------------------------------------------

def old_database_with_a_long_chat(data) -> None:
    """A release-1 database (no search index) with a long chat about animals and a newer short one."""
    import sqlite3

    from test_app_store import V1_SCHEMA

    data.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(data / "eddy.db"), isolation_level=None)
    conn.executescript(V1_SCHEMA)
    conn.execute("PRAGMA user_version=1")
    for n, (title, texts) in enumerate([
            ("Animals", [f"Message {i}: " + ("a zebra grazes on the plain. " if i == 3 else "lorem ipsum dolor. ") * 12
                         for i in range(30)]),
            ("Shopping", ["milk", "and bread"])]):
        conv = conn.execute("INSERT INTO conversations(title, created, updated) VALUES (?, ?, ?)",
                            (title, 100.0 + n, 200.0 + n)).lastrowid
        for seq, text in enumerate(texts):
            conn.execute("INSERT INTO messages(conversation_id, seq, role, content, created) VALUES (?, ?, ?, ?, 0)",
                         (conv, seq, "user" if seq % 2 == 0 else "assistant", text))
    conn.close()


def test_a_hit_opens_its_chat_scrolled_to_the_message(qtbot, tmp_path, tiny):
    from PySide6.QtCore import Qt

    from conftest_app import open_window, write_settings

    data = tmp_path / "data"
    write_settings(data)
    old_database_with_a_long_chat(data)
    window = open_window(qtbot, data)
    c = window.controller
    assert c.chat.title == "Shopping" and len(c.conversations.rows) == 2  # the old chats are all there
    animals = next(r.id for r in c.conversations.rows if r.title == "Animals")

    # Ctrl+K, type, Enter: the chat opens at message 3, highlighted, not at the bottom.
    assert window.search_action.shortcut().toString() == "Ctrl+K"
    window.search_action.trigger()
    popup = window.search_popup
    assert popup.isVisible()
    qtbot.keyClicks(popup.field, "zebr")
    qtbot.waitUntil(lambda: len(popup.model.hits) == 1)
    assert "1 match" in popup.status.text()
    assert "<b>zebra</b>" in popup.model.hits[0].snippet.replace("\x02", "<b>").replace("\x03", "</b>")
    qtbot.keyClick(popup.field, Qt.Key.Key_Return)
    assert not popup.isVisible() and c.chat.conversation_id == animals and len(c.chat.messages) == 30
    view, bar = window.chat_view, window.chat_view.verticalScrollBar()

    def seen(i: int) -> bool:
        return not view.widgets[i].visibleRegion().isEmpty()

    # Once laid out (before that every bubble sits at the top), the hit is in view and the chat's end is not.
    qtbot.waitUntil(lambda: bar.maximum() > 0 and seen(3) and not seen(-1))
    assert view.widgets[3].flashing and 0 < bar.value() < bar.maximum()
    qtbot.wait(300)  # the layout settles: the hit stays in view (the chat did not jump to its end)
    assert seen(3) and not seen(-1)

    # Typing that is not a valid FTS query never raises; it just finds nothing or the words it has.
    for text in ['"', 'AND(', 'zebra OR']:
        popup.field.setText(text)
        popup.live.run()
    assert popup.status.text() == "No matches"

    # The sidebar filter searches messages too; a click opens the chat at the message.
    window.controller.open_chat(next(r.id for r in c.conversations.rows if r.title == "Shopping"))
    qtbot.keyClicks(window.filter, "bread")
    qtbot.waitUntil(lambda: window.hits_list.isVisible() and len(window.hits.hits) == 1)
    assert window.proxy.rowCount() == 0  # no title has it
    window.hits_list.hit_activated.emit(window.hits.hits[0])
    assert c.chat.title == "Shopping" and view.widgets[1].flashing
    window.filter.clear()
    qtbot.waitUntil(lambda: not window.hits_list.isVisible())
    # A message sent now is searchable at once (the index follows every write).
    from conftest_app import send_text

    send_text(qtbot, window, "remember the giraffe")
    assert [h.seq for h in c.search("giraffe")] == [2]
