"""A damaged chat database is salvaged, not thrown away (issue 42): damage confined to the search index is
rebuilt in place from the chats (a damaged page of it: tests/test_security.py); damage elsewhere keeps the damaged file aside and carries every chat that can
still be read into a new one, saying how many were kept and lost. Real SQLite files, damaged one 4 KiB page
at a time, as a bad sector or a stray write would.
"""
from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.store import DB_FILE, Store, StoreError, TurnRow

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4096
CHATS, MESSAGES = 12, 20


def text(chat: int, i: int) -> str:
    # A word unique to each message, so a search can name the one message it must find.
    return f"chat{chat} says uniq{chat}x{i} " + "lorem ipsum dolor sit amet " * 8


def filled(data: Path) -> dict[str, list[tuple[str, str]]]:
    """A closed database with CHATS chats of MESSAGES messages, a turn each and a preset; returns what it holds."""
    store = Store.open(data)
    chats = {}
    for c in range(CHATS):
        conv = store.create_conversation(f"Chat number {c}")
        messages = [("user" if i % 2 == 0 else "assistant", text(c, i)) for i in range(MESSAGES)]
        for i, (role, content) in enumerate(messages):
            msg = store.append_message(conv, i, role, content)
        store.add_turn(conv, TurnRow("turn", 30, 4.5, 12, 100.0, 120.0, "eos", {"evicted": c}, message_id=msg))
        chats[f"Chat number {c}"] = messages
    store.save_preset("terse", "Answer in one line.")
    store.close()
    return chats


def content(store: Store) -> dict[str, list[tuple[str, str]]]:
    return {c.title: [(m.role, m.content) for m in store.messages(c.id)] for c in store.conversations()}


def pages_of(db: Path, table: str) -> list[tuple[int, str]]:
    """(page number, 'internal' | 'leaf' | 'overflow') of every page of a table, root first (SQLite's dbstat)."""
    conn = sqlite3.connect(str(db))
    try:
        return [(r[0], r[1]) for r in conn.execute("SELECT pageno, pagetype FROM dbstat WHERE name=? ORDER BY path",
                                                   (table,))]
    finally:
        conn.close()


def overwrite(db: Path, page: int) -> bytes:
    """Writes garbage over one page (numbered from 1); returns the damaged file's bytes."""
    data = bytearray(db.read_bytes())
    data[(page - 1) * PAGE: page * PAGE] = random.Random(page).randbytes(PAGE)
    db.write_bytes(bytes(data))
    return bytes(data)


def is_damaged(db: Path) -> bool:
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("PRAGMA quick_check").fetchone()[0] != "ok"
    except sqlite3.DatabaseError:
        return True
    finally:
        conn.close()


def integrity(db: Path) -> str:
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def aside(data: Path) -> list[Path]:
    return sorted(p for p in data.glob(f"{DB_FILE}.damaged-*") if not p.name.endswith(("-wal", "-shm")))


def test_a_damaged_search_index_record_is_rebuilt_when_a_search_finds_it(tmp_path):
    # Whole pages, damaged records: the check at start-up passes and only an FTS query fails.
    chats = filled(tmp_path)
    conn = sqlite3.connect(str(tmp_path / DB_FILE))
    conn.execute("UPDATE messages_fts_data SET block = x'0102030405060708090a0b0c0d0e0f' WHERE id = 10")
    conn.commit()
    conn.close()
    store = Store.open(tmp_path)
    assert store.salvage is None  # not seen yet
    hits = store.search("uniq3x4")
    assert [(h.title, h.seq) for h in hits] == [("Chat number 3", 4)]
    assert content(store) == chats and aside(tmp_path) == []
    store.append_message(store.conversations()[0].id, MESSAGES, "user", "still writable quokka")
    assert len(store.search("quokka")) == 1
    store.close()


@pytest.mark.parametrize("table", ["messages", "turns"])
def test_a_damaged_page_elsewhere_keeps_every_readable_chat(tmp_path, table):
    chats = filled(tmp_path)
    db = tmp_path / DB_FILE
    leaves = [p for p, kind in pages_of(db, table) if kind == "leaf"]
    if table == "messages":
        assert len(leaves) > 4
        damaged = overwrite(db, leaves[len(leaves) // 2])  # in the middle of the messages
    else:
        damaged = overwrite(db, pages_of(db, table)[0][0])
    assert is_damaged(db)

    store = Store.open(tmp_path)
    kept = content(store)
    # The damaged file is kept exactly as it was found, under the name a moved-aside file always had.
    assert aside(tmp_path) == [store.recovered_from]
    assert store.recovered_from.read_bytes() == damaged
    report = store.salvage
    assert set(kept) == set(chats) and report.chats_kept == CHATS and report.chats_lost == 0
    total = CHATS * MESSAGES
    carried = sum(len(m) for m in kept.values())
    assert report.messages_kept == carried and report.messages_kept + report.messages_lost == total
    if table == "messages":
        assert 0 < report.messages_lost < total // 2  # one page's worth, not the rest with it
        assert f"{report.messages_lost} messages could not be read" in store.salvage.notice()
        for title, messages in kept.items():  # what came across is exactly what was written, in order
            original = chats[title]
            assert [m for m in original if m in messages] == messages
    else:
        assert report.messages_lost == 0 and kept == chats
        assert "could not be read" not in store.salvage.notice()
    assert f"{CHATS} of its {CHATS} chats" in store.salvage.notice() and str(store.recovered_from) in store.salvage.notice()
    assert store.presets() == [("terse", "Answer in one line.")]
    assert integrity(db) == "ok"
    first = store.conversations()[-1]
    assert [h.conversation_id for h in store.search(first.title)] == [first.id]  # the new file is searchable
    store.close()


def test_a_damaged_chat_list_keeps_the_messages_under_a_placeholder_title(tmp_path):
    chats = filled(tmp_path)
    db = tmp_path / DB_FILE
    overwrite(db, pages_of(db, "conversations")[0][0])

    store = Store.open(tmp_path)
    convs = store.conversations()
    assert store.recovered_from is not None and store.salvage.chats_kept == CHATS
    assert {c.title for c in convs} == {"Recovered chat"}
    kept = [[(m.role, m.content) for m in store.messages(c.id)] for c in convs]
    assert sorted(kept) == sorted(chats.values())  # every message, each in its own chat, in order
    store.close()


def test_a_file_with_nothing_readable_says_so(tmp_path):
    (tmp_path / DB_FILE).write_bytes(b"this is not a database" * 400)
    store = Store.open(tmp_path)
    assert store.conversations() == [] and store.salvage.chats_kept == 0
    assert "no chat could be read" in store.salvage.notice()
    store.close()


def test_a_version_0_database_is_not_said_to_be_left_as_it_was(tmp_path):
    # A version 0 file that already has a table of Eddy's name (not Eddy's, or release 1's creation cut short
    # before it wrote the version): step 1 runs and is saved, then step 2 fails on the foreign chat list.
    db = tmp_path / DB_FILE
    conn = sqlite3.connect(str(db))
    conn.execute("CREATE TABLE conversations (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO conversations(name) VALUES ('kept')")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as raised:
        Store.open(tmp_path)
    message = str(raised.value)
    conn = sqlite3.connect(str(db))
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    rows = conn.execute("SELECT name FROM conversations").fetchall()
    conn.close()
    assert version == 1 and "messages" in tables  # step 1 did change the file...
    assert "left as it was" not in message  # ...so the message must not say it did not
    assert "from schema version 1 to 2" in message and "updated from version 0 to 1" in message
    assert rows == [("kept",)] and aside(tmp_path) == []


def test_ask_prints_what_was_salvaged(tmp_path):
    filled(tmp_path)
    db = tmp_path / DB_FILE
    leaves = [p for p, kind in pages_of(db, "messages") if kind == "leaf"]
    overwrite(db, leaves[len(leaves) // 2])
    out = subprocess.run([sys.executable, "-m", "app", "--ask", "hi", "--data-dir", str(tmp_path),
                          "--model", str(tmp_path / "no-such-model.gguf")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "eddy-gui: warning: The chat database was damaged" in out.stderr, out.stderr[-2000:]
    assert f"{CHATS} of its {CHATS} chats" in out.stderr
    assert "Traceback" not in out.stderr
