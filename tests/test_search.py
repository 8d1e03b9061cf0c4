"""Search across chats: the store's FTS5 index (kept in step by triggers, filled by the migration for an old
database) and, in the window, a hit opening its chat scrolled to the message."""
from __future__ import annotations

import conftest_app  # noqa: F401  (headless Qt platform; skips without PySide6)

import app.store as store_module
from app.store import MARK_END, MARK_START, Store, fts_query
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
    assert user_version(db) == store_module.SCHEMA_VERSION >= 2
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
