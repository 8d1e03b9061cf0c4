"""The chat database's schema, as the steps that build it (MIGRATIONS): opening runs the steps a file has not
had yet, each in its own transaction with the version it reaches, and refuses a file from a newer Eddy.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable, Iterator

from .store_errors import StoreError, explain, rollback

# Version 1: the schema as first released. Its IF NOT EXISTS lets step 1 finish a file whose creation was cut
# short (release 1 created the tables and then set the version in separate transactions).
SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, seq);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    message_id INTEGER REFERENCES messages(id) ON DELETE SET NULL,
    kind TEXT NOT NULL,
    prefill_tokens INTEGER NOT NULL,
    prefill_ms REAL NOT NULL,
    tokens INTEGER NOT NULL,
    decode_ms REAL NOT NULL,
    tok_s REAL NOT NULL,
    stop_reason TEXT NOT NULL,
    cache TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_by_conversation ON turns(conversation_id, id);
"""

# Version 2: full-text search over messages and chat titles. External-content FTS5 tables (the text is kept
# once, in messages and conversations) that triggers keep in step with every insert, update and delete; the
# 'rebuild' at the end indexes the chats an older Eddy wrote, so they are searchable from the first start.
# unicode61 with remove_diacritics 2: "cafe" finds "café"; search() adds a prefix star, so "appl" finds "apples".
SEARCH = """
CREATE VIRTUAL TABLE messages_fts USING fts5(
    content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
END;
CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
END;
CREATE VIRTUAL TABLE titles_fts USING fts5(
    title, content='conversations', content_rowid='id', tokenize='unicode61 remove_diacritics 2');
CREATE TRIGGER titles_fts_insert AFTER INSERT ON conversations BEGIN
    INSERT INTO titles_fts(rowid, title) VALUES (new.id, new.title);
END;
CREATE TRIGGER titles_fts_delete AFTER DELETE ON conversations BEGIN
    INSERT INTO titles_fts(titles_fts, rowid, title) VALUES ('delete', old.id, old.title);
END;
CREATE TRIGGER titles_fts_update AFTER UPDATE OF title ON conversations BEGIN
    INSERT INTO titles_fts(titles_fts, rowid, title) VALUES ('delete', old.id, old.title);
    INSERT INTO titles_fts(rowid, title) VALUES (new.id, new.title);
END;
INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
INSERT INTO titles_fts(titles_fts) VALUES ('rebuild');
"""

# Version 3: alternatives and branches. Each message gets its parent (NULL for a chat's first message, or an
# alternative to it) and `chosen`, the order in which messages were last chosen: among siblings the highest is
# shown (app/branches.py). A chat an older Eddy wrote is one chain, each message the child of the one before
# it (by seq, then id, so even two messages at one seq stay in order); its ranks are all 0, so it has nothing
# to choose between. Deleting a message deletes the branch under it.
BRANCHES = """
ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE;
ALTER TABLE messages ADD COLUMN chosen INTEGER NOT NULL DEFAULT 0;
UPDATE messages SET parent_id = (
    SELECT p.id FROM messages p WHERE p.conversation_id = messages.conversation_id
    AND (p.seq < messages.seq OR (p.seq = messages.seq AND p.id < messages.id))
    ORDER BY p.seq DESC, p.id DESC LIMIT 1);
CREATE INDEX messages_by_parent ON messages(parent_id);
"""

# Version 4: system prompts. Each chat may have its own (NULL: the app's default from Settings, so every chat an
# older Eddy wrote keeps following Settings as it did; '' is a chosen "none"), and named presets to pick one from.
SYSTEM_PROMPTS = """
ALTER TABLE conversations ADD COLUMN system_prompt TEXT;
CREATE TABLE presets (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL
);
"""

# A step is an SQL script or a function given the connection; either runs inside the step's transaction, so
# it must not BEGIN or COMMIT itself. Steps run with foreign keys off: rebuilding a table (SQLite's way to
# change a column) drops the old one, and with them on that drop would first cascade-delete every message.
Step = str | Callable[[sqlite3.Connection], None]

# Version 5: what a message holds besides its text, as JSON ('' for none): a reply's thinking ("reasoning",
# "thinking_ms"), the tool calls it made ("tool_calls") and, for a tool's result (role "tool"), the call it
# answers and how it ran ("tool_call_id", "tool", "arguments", "state", "seconds"). Only the text is searched,
# so a tool's result is found like any message.
EXTRA = """
ALTER TABLE messages ADD COLUMN extra TEXT NOT NULL DEFAULT '';
"""

# (N, step): step N brings a version N-1 database to version N. Append only, never edit a released step:
# users' databases have already run it. Version 0 is an empty file.
MIGRATIONS: list[tuple[int, Step]] = [
    (1, SCHEMA),
    (2, SEARCH),
    (3, BRANCHES),
    (4, SYSTEM_PROMPTS),
    (5, EXTRA),
]

# The version is SQLite's PRAGMA user_version, not a table of our own: release 1 already writes 1 there, it
# needs no table that would itself have to exist before the version can be read, and it lives in the
# database header, which changes in the same transaction as the step it records: a step is either applied
# and counted or neither.
SCHEMA_VERSION = MIGRATIONS[-1][0]
if [n for n, _ in MIGRATIONS] != list(range(1, SCHEMA_VERSION + 1)):
    raise RuntimeError("app.store_migrations.MIGRATIONS must be numbered 1, 2, 3, ... in order")


def user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def newer(path: Path, version: int) -> StoreError:
    # Not damage: moving it aside would hide the user's chats from the newer Eddy that wrote them.
    return StoreError(f"The chat database {path} was written by a newer version of Eddy (schema version "
                      f"{version}; this version of Eddy reads schema versions up to {SCHEMA_VERSION}). "
                      f"Update Eddy to open it. The file was not changed.")


def statements(script: str) -> Iterator[str]:
    # executescript() would commit the step's open transaction first, so a script runs one statement at a
    # time. complete_statement() is SQLite's own tokenizer: a ';' inside a string or a trigger does not split.
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                yield pending
            pending = ""
    if pending.strip(" \t\r\n;"):
        yield pending  # incomplete: executing it raises SQLite's own syntax error


def run_step(conn: sqlite3.Connection, step: Step) -> None:
    if callable(step):
        step(conn)
    else:
        for statement in statements(step):
            conn.execute(statement)


def _step_failed(e: Exception, version: int, started: int) -> StoreError:
    doing = f"update the chat database from schema version {version - 1} to {version}"
    explained = str(explain(e, doing)) if isinstance(e, sqlite3.Error) else f"Could not {doing}: {e}."
    if started == version - 1:
        return StoreError(f"{explained} It was left as it was, at version {version - 1}, with all its chats.")
    # Earlier steps of this same start did commit (each is its own transaction): "left as it was" would be
    # untrue for a file that began at `started` (0: release 1's creation cut short, or a foreign file).
    return StoreError(f"{explained} The steps before it were saved: it was updated from version {started} to "
                      f"{version - 1} and kept there, with all its chats.")


def _apply(conn: sqlite3.Connection, version: int, step: Step, started: int) -> None:
    """Runs step `version` and records it, in one transaction: a crash or an error leaves version - 1 intact.
    `started` is the version the file had when this start began updating it (for the error's message)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        # Another Eddy opening the same old file may have run this step while we waited for the write lock.
        if user_version(conn) < version:
            run_step(conn, step)
            conn.execute(f"PRAGMA user_version={version}")
        conn.execute("COMMIT")
    except BaseException as e:
        rollback(conn)
        # Step 1 only creates tables in a new file: its errors take open()'s usual path, explained or, for
        # damage, moved aside. A later step fails on an intact older database, which is never damage.
        if version > 1 and isinstance(e, Exception):
            raise _step_failed(e, version, started) from e
        raise


def migrate(conn: sqlite3.Connection, version: int) -> None:
    for target, step in MIGRATIONS:
        if target > version:
            _apply(conn, target, step, version)
