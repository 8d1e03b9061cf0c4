"""Chats on disk: one SQLite file (WAL) with conversations, their messages and each turn's statistics.

Every write is its own short transaction, so a crash loses at most the reply being streamed. Failures are
raised as StoreError with a message for the user; the caller keeps the chat in memory and retries later.
Opening brings a database from an older Eddy up to date, one step of MIGRATIONS at a time, and refuses one
from a newer Eddy without touching it.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .branches import ChatTree

DB_FILE = "eddy.db"

log = logging.getLogger(__name__)

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
    raise RuntimeError("app.store.MIGRATIONS must be numbered 1, 2, 3, ... in order")


# How search() marks the matched words in a hit's snippet (control characters: they never occur in a chat's
# text as typed, and a view turns them into its own emphasis after escaping the rest).
MARK_START, MARK_END = "\x02", "\x03"
SNIPPET_TOKENS = 14  # words of context around a match


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query that cannot be a syntax error: each word quoted (a '"' doubled), with
    a prefix star, all of them required. Words with no letter or digit are dropped (the index has none)."""
    words = [w for w in text.split() if any(ch.isalnum() for ch in w)]
    return " ".join('"' + w.replace('"', '""') + '"*' for w in words)


def _text(value: str) -> str:
    # SQLite needs valid UTF-8: a lone surrogate (text decoded with surrogateescape, a UTF-16 source) would
    # raise UnicodeEncodeError, not a StoreError. Pairs are joined, lone ones become U+FFFD.
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class StoreError(Exception):
    """A read or write failed; the message is meant for the user."""


@dataclass
class ConversationRow:
    id: int
    title: str
    created: float
    updated: float


@dataclass
class MessageRow:
    id: int
    seq: int                      # its depth: the position it has in any branch through it
    role: str
    content: str
    created: float
    parent_id: int | None = None  # None: a first message
    chosen: int = 0               # among its siblings the highest is shown (app/branches.py)
    extra: dict = field(default_factory=dict)  # thinking, tool calls, a tool card's state (EXTRA above)


@dataclass
class SearchHit:
    conversation_id: int
    title: str
    message_id: int | None  # None: the chat's title matched
    seq: int                # the message's position in its chat (-1 for a title)
    role: str               # "user" | "assistant" ("" for a title)
    snippet: str            # the matched text around the match, matches between MARK_START and MARK_END


@dataclass
class TurnRow:
    kind: str  # "turn" (a reply), "rebuild" (the cache rebuilt from a chat's history) or "server" (never stored)
    prefill_tokens: int
    prefill_ms: float
    tokens: int = 0
    decode_ms: float = 0.0
    tok_s: float = 0.0
    stop_reason: str = ""
    cache: dict[str, int] | None = None
    message_id: int | None = None
    id: int | None = None
    reused: int = 0  # a local-server request's tokens that were already in its conversation's cache


def _explain(e: sqlite3.Error, doing: str) -> StoreError:
    text = str(e).lower()
    if "full" in text:
        why = "the disk is full"
    elif "readonly" in text or "read-only" in text:
        why = "the chat database is read-only"
    elif "locked" in text or "busy" in text:
        why = "the chat database is locked by another program"
    elif "malformed" in text or "not a database" in text:
        why = "the chat database is damaged"
    else:
        why = str(e)
    return StoreError(f"Could not {doing}: {why}.")


# --- schema versions -----------------------------------------------------------------------------------------

def _version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _newer(path: Path, version: int) -> StoreError:
    # Not damage: moving it aside would hide the user's chats from the newer Eddy that wrote them.
    return StoreError(f"The chat database {path} was written by a newer version of Eddy (schema version "
                      f"{version}; this version of Eddy reads schema versions up to {SCHEMA_VERSION}). "
                      f"Update Eddy to open it. The file was not changed.")


def _statements(script: str) -> Iterator[str]:
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


def _run_step(conn: sqlite3.Connection, step: Step) -> None:
    if callable(step):
        step(conn)
    else:
        for statement in _statements(step):
            conn.execute(statement)


def _rollback(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back by itself (it does on SQLITE_FULL): keep the real error.
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _step_failed(e: Exception, version: int, started: int) -> StoreError:
    doing = f"update the chat database from schema version {version - 1} to {version}"
    explained = str(_explain(e, doing)) if isinstance(e, sqlite3.Error) else f"Could not {doing}: {e}."
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
        if _version(conn) < version:
            _run_step(conn, step)
            conn.execute(f"PRAGMA user_version={version}")
        conn.execute("COMMIT")
    except BaseException as e:
        _rollback(conn)
        # Step 1 only creates tables in a new file: its errors take open()'s usual path, explained or, for
        # damage, moved aside. A later step fails on an intact older database, which is never damage.
        if version > 1 and isinstance(e, Exception):
            raise _step_failed(e, version, started) from e
        raise


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    for target, step in MIGRATIONS:
        if target > version:
            _apply(conn, target, step, version)


# --- recovering from damage ----------------------------------------------------------------------------------

# The full-text tables of step 2 (SEARCH). Every row in them is derived from messages and conversations, so
# damage confined to them (or to their shadow tables, <name>_data and the like) loses nothing: they are dropped
# and built again. Their triggers share the prefix and go with them.
SEARCH_TABLES = ("messages_fts", "titles_fts")
SEARCH_VERSION = 2


@dataclass
class Salvage:
    """What opening did about a damaged database; the app shows notice() in the window and on --ask."""
    moved_to: Path | None      # the damaged file, kept as it was found (None: repaired in place)
    chats_kept: int = 0
    chats_lost: int = 0
    messages_kept: int = 0
    messages_lost: int = 0

    @property
    def level(self) -> str:
        """How loudly to tell it: a repaired index lost nothing."""
        return "info" if self.moved_to is None else "warning"

    def notice(self) -> str:
        if self.moved_to is None:
            return ("The chat database's search index was damaged and has been rebuilt from the chats; "
                    "no chat was lost.")
        head = f"The chat database was damaged. The damaged file was kept as {self.moved_to}"
        if not self.chats_kept:
            return f"{head}; no chat could be read from it, so Eddy started with an empty one."
        chats = self.chats_kept + self.chats_lost
        text = (f"{head}, and {self.chats_kept} of its {chats} chat{'s' if chats != 1 else ''} "
                f"({self.messages_kept} message{'s' if self.messages_kept != 1 else ''}) were carried into a new one")
        if self.chats_lost:
            text += f"; {self.chats_lost} chat{'s' if self.chats_lost != 1 else ''} could not be read"
        if self.messages_lost:
            text += f"; {self.messages_lost} message{'s' if self.messages_lost != 1 else ''} could not be read"
        return text + "."


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _is_search_object(name: str) -> bool:
    return any(name == t or name.startswith(t + "_") for t in SEARCH_TABLES)


def _repair_search_index(path: Path) -> bool:
    """Rebuilds the search index in place if the damage is confined to it; True if the file is whole again.
    False (damage elsewhere, or the repair failed): the caller salvages the chats into a new file instead.
    It does not ask whether the index is damaged: the caller knows (a failed check, or an FTS query)."""
    try:
        conn = sqlite3.connect(str(path), isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        version = _version(conn)
        if not SEARCH_VERSION <= version <= SCHEMA_VERSION:
            return False
        names = [(r[0], r[1]) for r in conn.execute("SELECT name, type FROM sqlite_master")]
        search = [n for n, _ in names if _is_search_object(n)]
        # quick_check(table) checks only that table and its indexes: every one outside the index whole means
        # every chat is readable, whatever the index's own pages hold.
        for table in ["sqlite_master"] + [n for n, t in names if t == "table" and not _is_search_object(n)
                                          and not n.startswith("sqlite_")]:
            if conn.execute(f"PRAGMA quick_check({_quoted(table)})").fetchone()[0] != "ok":
                return False
        # DROP TABLE would walk the damaged b-trees to free their pages, and fail on them: the index's entries
        # are taken out of the schema instead, and VACUUM (which copies only what the schema reaches) leaves
        # the damaged pages behind. The schema cookie changes so other connections reload the schema.
        conn.execute("PRAGMA writable_schema=ON")
        conn.execute("BEGIN IMMEDIATE")
        try:
            cookie = int(conn.execute("PRAGMA schema_version").fetchone()[0])
            conn.executemany("DELETE FROM sqlite_master WHERE name=?", [(n,) for n in search])
            conn.execute(f"PRAGMA schema_version={cookie + 1}")
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        conn.execute("PRAGMA writable_schema=OFF")
        conn.close()
        conn = sqlite3.connect(str(path), isolation_level=None)
        conn.execute("VACUUM")
        # The index as step 2 defines it (no later step changed it), filled from the messages and titles.
        conn.execute("BEGIN IMMEDIATE")
        try:
            _run_step(conn, SEARCH)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        return conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    except sqlite3.Error as e:
        log.warning("could not rebuild the search index of %s: %s", path, e)
        return False
    finally:
        conn.close()


def _rows_until_damage(conn: sqlite3.Connection, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
    """The rows a query yields before it reaches a damaged page (or none, if it cannot even start)."""
    out: list[sqlite3.Row] = []
    try:
        for row in conn.execute(sql, args):
            out.append(row)
    except sqlite3.Error:
        pass
    return out


def _both_ways(conn: sqlite3.Connection, sql: str) -> list[sqlite3.Row]:
    # A scan stops at the first damaged leaf; the same scan run backwards reaches the rows beyond it.
    return _rows_until_damage(conn, sql.format(order="ASC")) + _rows_until_damage(conn, sql.format(order="DESC"))


def _row(conn: sqlite3.Connection, table: str, row_id: int) -> dict[str, Any] | None:
    """One row by its id, found through the table's interior pages: only rows on a damaged page are lost."""
    try:
        r = conn.execute(f"SELECT * FROM {table} WHERE rowid=?", (row_id,)).fetchone()
        return dict(r) if r is not None else None
    except sqlite3.Error:
        return None


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]


class Store:
    """The chat database. Use Store.open(): it recovers from a damaged file and updates an old one."""

    def __init__(self, path: Path, conn: sqlite3.Connection, recovered_from: Path | None = None,
                 salvage: Salvage | None = None) -> None:
        self.path = path
        self.conn = conn
        # Where a damaged database was moved to at start-up (None if it was fine): the app tells the user.
        self.recovered_from = recovered_from
        # What opening did about damage (None: there was none); its notice() is for the user.
        self.salvage = salvage

    # --- opening -------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, data_dir: Path) -> "Store":
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / DB_FILE
        try:
            return cls(path, cls._connect(path))
        except sqlite3.OperationalError as e:
            # Locked or busy (another Eddy holding a long write), unreadable, out of space: not damage. Moving
            # the file aside here would take a healthy database, and its WAL, away from the other instance.
            raise _explain(e, "open the chat database") from e
        except sqlite3.DatabaseError as first:
            log.warning("the chat database %s is damaged: %s", path, first)
            if _repair_search_index(path):
                try:
                    return cls(path, cls._connect(path), salvage=Salvage(moved_to=None))
                except sqlite3.Error as e:
                    log.warning("the repaired chat database %s still fails: %s", path, e)
            # The damaged file is kept as it is, for the user (or a tool such as sqlite3's .recover); the
            # chats that can still be read are carried into a new one.
            moved = cls._move_aside(path)
            try:
                store = cls(path, cls._connect(path), recovered_from=moved)
            except sqlite3.Error as e:
                raise StoreError(f"Could not open the chat database {path}: {e} (first attempt: {first})") from e
            store.salvage = store._carry_over(moved)
            return store

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(str(path), isolation_level=None)  # autocommit; transactions are explicit
        try:
            conn.row_factory = sqlite3.Row
            # First, before anything that writes (journal_mode=WAL rewrites the header): a newer Eddy's file
            # must stay exactly as it is.
            version = _version(conn)
            if version > SCHEMA_VERSION:
                raise _newer(path, version)
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode loses at most the last transaction on power loss, never corrupts.
            conn.execute("PRAGMA synchronous=NORMAL")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            if version < SCHEMA_VERSION:  # a new or old file: writes only then, so opening never waits on a writer
                _migrate(conn, version)
            conn.execute("PRAGMA foreign_keys=ON")  # after the steps, which need them off (see Step)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _move_aside(path: Path) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = path.with_name(f"{path.name}.damaged-{stamp}")
        n = 1
        while target.exists():
            target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
            n += 1
        # The WAL and shared-memory files belong to the damaged database: keep them with it.
        for suffix in ("", "-wal", "-shm"):
            part = Path(f"{path}{suffix}")
            if part.exists():
                part.rename(Path(f"{target}{suffix}"))
        return target

    def _carry_over(self, source: Path) -> Salvage:
        """Copies every chat, message, turn and preset that can still be read from the damaged `source` into
        this (new, empty) database, row by row. Python's sqlite3 has no .recover (that is the sqlite3 shell's),
        so rows are found every way the file still allows: the table scanned from both ends, and through its
        indexes, which know a message's id and chat even when the page holding the message is lost."""
        report = Salvage(moved_to=source)
        try:
            old = sqlite3.connect(f"{source.as_uri()}?mode=ro", uri=True)
        except sqlite3.Error:
            return report
        try:
            old.row_factory = sqlite3.Row
            try:
                old.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.Error:
                return report  # not even the schema can be read: nothing to carry
            self._copy_readable(old, report)
        finally:
            old.close()
        log.warning("salvaged %s: %s", source, report)
        return report

    def _copy_readable(self, old: sqlite3.Connection, report: Salvage) -> None:
        def ids(sqls: list[str]) -> dict[int, int | None]:
            found: dict[int, int | None] = {}
            for sql in sqls:
                for r in _both_ways(old, sql):
                    found.setdefault(r[0], r[1])
            return found

        # id -> its chat's id (as far as an index knows it)
        message_ids = ids(["SELECT id, conversation_id FROM messages ORDER BY id {order}",
                           "SELECT id, conversation_id FROM messages INDEXED BY messages_by_conversation "
                           "ORDER BY conversation_id {order}, seq {order}"])
        chat_ids = set(ids(["SELECT id, NULL FROM conversations ORDER BY id {order}"]))
        chat_ids |= {c for c in message_ids.values() if c is not None}
        messages = [m for m in (_row(old, "messages", i) for i in sorted(message_ids)) if m is not None]
        by_chat: dict[int, list[dict[str, Any]]] = {}
        for m in messages:
            by_chat.setdefault(m["conversation_id"], []).append(m)
        chats = {}
        for cid in sorted(chat_ids):
            row = _row(old, "conversations", cid)
            mine = by_chat.get(cid, [])
            if row is None and mine:  # its messages outlived its title
                created = min(m["created"] for m in mine)
                row = {"id": cid, "title": "Recovered chat", "created": created,
                       "updated": max(m["created"] for m in mine)}
            if row is not None:
                chats[cid] = row
        messages = [m for m in messages if m["conversation_id"] in chats]
        turns = [t for t in (_row(old, "turns", i) for i in sorted(ids(
            ["SELECT id, NULL FROM turns ORDER BY id {order}",
             "SELECT id, NULL FROM turns INDEXED BY turns_by_conversation ORDER BY conversation_id {order}"])))
            if t is not None and t["conversation_id"] in chats]
        presets = _both_ways(old, "SELECT * FROM presets ORDER BY id {order}")

        kept = {m["id"] for m in messages}
        has_parents = "parent_id" in _columns(old, "messages")
        for cid in chats:
            # A message whose parent was lost (or a file from before branches) follows the nearest earlier
            # message of its chat, as step 3 links an older Eddy's chats, rather than starting a new branch.
            previous = None
            for m in sorted(by_chat.get(cid, []), key=lambda m: (m["seq"], m["id"])):
                if not has_parents or (m["parent_id"] is not None and m["parent_id"] not in kept):
                    m["parent_id"] = previous
                previous = m["id"]
        for t in turns:
            if t["message_id"] not in kept:
                t["message_id"] = None

        def insert(conn: sqlite3.Connection, table: str, rows: Iterable[dict[str, Any]]) -> None:
            wanted = _columns(conn, table)
            for r in rows:
                cols = [c for c in wanted if c in r]
                conn.execute(f"INSERT OR IGNORE INTO {table}({', '.join(cols)}) VALUES "
                             f"({', '.join('?' * len(cols))})", [r[c] for c in cols])

        # The rows are inserted in id order, a message's parent possibly after it: foreign keys are checked
        # per statement, so they are off for the copy (every reference was made to point at a kept row above).
        self.conn.execute("PRAGMA foreign_keys=OFF")
        try:
            self._atomic("carry the chats into a new database", lambda conn: (
                insert(conn, "conversations", chats.values()), insert(conn, "messages", messages),
                insert(conn, "turns", turns), insert(conn, "presets", (dict(p) for p in presets))))
        finally:
            self.conn.execute("PRAGMA foreign_keys=ON")
        report.chats_kept, report.chats_lost = len(chats), len(chat_ids) - len(chats)
        report.messages_kept, report.messages_lost = len(messages), len(message_ids) - len(kept)

    def close(self) -> None:
        try:
            self.conn.close()
        except sqlite3.Error:
            pass

    # --- helpers -------------------------------------------------------------------------------------------

    def _run(self, doing: str, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        try:
            return self.conn.execute(sql, tuple(args))
        except sqlite3.Error as e:
            raise _explain(e, doing) from e

    def _transaction(self, doing: str, steps: list[tuple[str, tuple]]) -> list[sqlite3.Cursor]:
        out: list[sqlite3.Cursor] = []
        self._atomic(doing, lambda conn: out.extend(conn.execute(sql, args) for sql, args in steps))
        return out

    def _atomic(self, doing: str, write: Callable[[sqlite3.Connection], None]) -> None:
        """Runs `write` in one transaction: all of it is saved, or (an error, a crash) none of it."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                write(self.conn)
                self.conn.execute("COMMIT")
            except BaseException:
                _rollback(self.conn)
                raise
        except sqlite3.Error as e:
            raise _explain(e, doing) from e

    # --- conversations -------------------------------------------------------------------------------------

    def conversations(self) -> list[ConversationRow]:
        rows = self._run("read the chat list",
                         "SELECT id, title, created, updated FROM conversations ORDER BY updated DESC, id DESC")
        return [ConversationRow(r["id"], r["title"], r["created"], r["updated"]) for r in rows]

    def create_conversation(self, title: str) -> int:
        now = time.time()
        cur = self._run("create a chat", "INSERT INTO conversations(title, created, updated) VALUES (?, ?, ?)",
                        (_text(title), now, now))
        return int(cur.lastrowid)

    def rename_conversation(self, conv_id: int, title: str) -> None:
        self._run("rename the chat", "UPDATE conversations SET title=? WHERE id=?", (_text(title), conv_id))

    def delete_conversation(self, conv_id: int) -> None:
        self._run("delete the chat", "DELETE FROM conversations WHERE id=?", (conv_id,))

    def conversation(self, conv_id: int) -> ConversationRow | None:
        r = self._run("read the chat", "SELECT id, title, created, updated FROM conversations WHERE id=?",
                      (conv_id,)).fetchone()
        return ConversationRow(r["id"], r["title"], r["created"], r["updated"]) if r else None

    def system_prompt(self, conv_id: int) -> str | None:
        """The chat's own system prompt; None: it follows the app's default (Settings)."""
        r = self._run("read the chat's system prompt", "SELECT system_prompt FROM conversations WHERE id=?",
                      (conv_id,)).fetchone()
        return r["system_prompt"] if r else None

    def set_system_prompt(self, conv_id: int, text: str | None) -> None:
        self._run("save the chat's system prompt", "UPDATE conversations SET system_prompt=? WHERE id=?",
                  (None if text is None else _text(text), conv_id))

    # --- system prompt presets -----------------------------------------------------------------------------

    def presets(self) -> list[tuple[str, str]]:
        """Every preset as (name, text), by name."""
        rows = self._run("read the system prompt presets", "SELECT name, text FROM presets ORDER BY name COLLATE NOCASE")
        return [(r["name"], r["text"]) for r in rows]

    def save_preset(self, name: str, text: str) -> None:
        """Adds a preset, or replaces the text of the one with that name."""
        self._run("save the preset", "INSERT INTO presets(name, text) VALUES (?, ?) "
                  "ON CONFLICT(name) DO UPDATE SET text=excluded.text", (_text(name), _text(text)))

    def rename_preset(self, old: str, new: str) -> None:
        """Raises StoreError if another preset already has the new name (names are unique)."""
        self._run("rename the preset", "UPDATE presets SET name=? WHERE name=?", (_text(new), old))

    def delete_preset(self, name: str) -> None:
        self._run("delete the preset", "DELETE FROM presets WHERE name=?", (name,))

    # --- messages ------------------------------------------------------------------------------------------

    def tree(self, conv_id: int) -> list[MessageRow]:
        """Every message of the chat, every branch, each after its parent."""
        rows = self._run("read the chat", "SELECT id, seq, role, content, created, parent_id, chosen, extra FROM messages "
                         "WHERE conversation_id=? ORDER BY seq, id", (conv_id,))
        return [MessageRow(r["id"], r["seq"], r["role"], r["content"], r["created"], r["parent_id"], r["chosen"],
                           _extra_of(r["extra"]))
                for r in rows]

    def messages(self, conv_id: int) -> list[MessageRow]:
        """The chat's messages in order: the branch shown."""
        tree = ChatTree.of(self.tree(conv_id), lambda r: r.id, lambda r: r.parent_id, lambda r: r.chosen,
                           lambda r: r)
        return [node.item for node in tree.path()]

    def add_message(self, conv_id: int, parent_id: int | None, seq: int, role: str, content: str,
                    chosen: int, extra: dict | None = None) -> int:
        """Saves a message under `parent_id` (None: a first message) at depth `seq`, with its rank."""
        now = time.time()
        cur, _ = self._transaction("save the message", [
            ("INSERT INTO messages(conversation_id, seq, role, content, created, parent_id, chosen, extra) "
             "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
             (conv_id, seq, role, _text(content), now, parent_id, chosen, _extra_text(extra))),
            ("UPDATE conversations SET updated=? WHERE id=?", (now, conv_id)),
        ])
        return int(cur.lastrowid)

    def append_message(self, conv_id: int, seq: int, role: str, content: str, extra: dict | None = None) -> int:
        """Saves a message at position `seq` of a chat without alternatives: after the one at seq - 1."""
        now = time.time()
        cur, _ = self._transaction("save the message", [
            ("INSERT INTO messages(conversation_id, seq, role, content, created, parent_id, chosen, extra) VALUES "
             "(?, ?, ?, ?, ?, (SELECT id FROM messages WHERE conversation_id=? AND seq=? "
             "ORDER BY chosen DESC, id DESC LIMIT 1), "
             "(SELECT COALESCE(MAX(chosen), 0) + 1 FROM messages WHERE conversation_id=?), ?)",
             (conv_id, seq, role, _text(content), now, conv_id, seq - 1, conv_id, _extra_text(extra))),
            ("UPDATE conversations SET updated=? WHERE id=?", (now, conv_id)),
        ])
        return int(cur.lastrowid)

    def update_message(self, message_id: int, content: str, extra: dict | None) -> None:
        """Rewrites a message's text and extra (a tool card whose call has run)."""
        self._run("save the message", "UPDATE messages SET content=?, extra=? WHERE id=?",
                  (_text(content), _extra_text(extra), message_id))

    def choose_message(self, message_id: int, chosen: int) -> None:
        """Records that a message was chosen (its branch is the one shown), with its new rank."""
        self._run("save which branch is shown", "UPDATE messages SET chosen=? WHERE id=?", (chosen, message_id))

    def delete_message(self, message_id: int) -> None:
        """Deletes a message and every message under it."""
        self._run("update the chat", "DELETE FROM messages WHERE id=?", (message_id,))

    def truncate_messages(self, conv_id: int, seq: int) -> None:
        """Deletes the messages from depth `seq` on, in every branch."""
        self._run("update the chat", "DELETE FROM messages WHERE conversation_id=? AND seq>=?", (conv_id, seq))

    def replace_messages(self, conv_id: int, title: str, messages: list[tuple[str, str]]) -> list[int]:
        """Writes a whole chat without alternatives at once; returns the new message ids."""
        return self.replace_tree(conv_id, title, [(role, content, i - 1 if i else None, 0)
                                                  for i, (role, content) in enumerate(messages)])

    def replace_tree(self, conv_id: int, title: str, messages: list[tuple]) -> list[int]:
        """Writes a whole chat at once (used to catch up after a failed save): each message as (role, content,
        the index of its parent in `messages`, earlier in the list, or None, its rank[, its extra]); returns the
        new ids."""
        now = time.time()
        ids: list[int] = []
        depth: list[int] = []

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT OR IGNORE INTO conversations(id, title, created, updated) VALUES (?, ?, ?, ?)",
                         (conv_id, _text(title), now, now))
            conn.execute("UPDATE conversations SET title=?, updated=? WHERE id=?", (_text(title), now, conv_id))
            conn.execute("DELETE FROM messages WHERE conversation_id=?", (conv_id,))
            for role, content, parent, chosen, *extra in messages:
                if parent is not None and not 0 <= parent < len(ids):
                    raise ValueError(f"message {len(ids)}'s parent {parent} does not come before it")
                seq = depth[parent] + 1 if parent is not None else 0
                cur = conn.execute("INSERT INTO messages(conversation_id, seq, role, content, created, parent_id, "
                                   "chosen, extra) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                   (conv_id, seq, role, _text(content), now,
                                    ids[parent] if parent is not None else None, chosen,
                                    _extra_text(extra[0] if extra else None)))
                ids.append(int(cur.lastrowid))
                depth.append(seq)

        self._atomic("save the chat", write)
        return ids

    # --- search --------------------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Chats whose title, and messages whose text, contain every word of `text` (as a word or a word's
        start): titles first, then messages, best match first. Any text is safe to pass (see fts_query)."""
        try:
            return self._search(text, limit)
        except StoreError as e:
            # An index whose pages are whole but whose own records are not ("vtable constructor failed",
            # SQLITE_CORRUPT_VTAB) passes the check at start-up and shows only here: rebuilt, then asked again.
            # OperationalError (locked, busy, disk full) is not damage.
            cause = e.__cause__
            if not isinstance(cause, sqlite3.DatabaseError) or isinstance(cause, sqlite3.OperationalError):
                raise
            if not self._rebuild_search_index():
                raise
            return self._search(text, limit)

    def _rebuild_search_index(self) -> bool:
        log.warning("the search index of %s is damaged; rebuilding it", self.path)
        self.close()
        repaired = _repair_search_index(self.path)
        try:
            self.conn = self._connect(self.path)
        except sqlite3.Error as e:
            raise _explain(e, "open the chat database") from e
        return repaired

    def _search(self, text: str, limit: int) -> list[SearchHit]:
        query = fts_query(_text(text))
        if not query:
            return []
        m0, m1 = MARK_START, MARK_END
        titles = self._run("search the chats",
                           "SELECT c.id, c.title, highlight(titles_fts, 0, ?, ?) AS snip FROM titles_fts "
                           "JOIN conversations c ON c.id = titles_fts.rowid WHERE titles_fts MATCH ? "
                           "ORDER BY rank LIMIT ?", (m0, m1, query, limit)).fetchall()
        messages = self._run("search the chats",
                             "SELECT m.conversation_id, c.title, m.id, m.seq, m.role, "
                             "snippet(messages_fts, 0, ?, ?, '…', ?) AS snip FROM messages_fts "
                             "JOIN messages m ON m.id = messages_fts.rowid "
                             "JOIN conversations c ON c.id = m.conversation_id "
                             "WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
                             (m0, m1, SNIPPET_TOKENS, query, limit)).fetchall()
        hits = [SearchHit(r["id"], r["title"], None, -1, "", r["snip"]) for r in titles]
        hits += [SearchHit(r["conversation_id"], r["title"], r["id"], r["seq"], r["role"], r["snip"]) for r in messages]
        return hits[:limit]

    # --- turn statistics -----------------------------------------------------------------------------------

    def add_turn(self, conv_id: int, turn: TurnRow) -> int:
        cur = self._run("save the turn statistics",
                        "INSERT INTO turns(conversation_id, message_id, kind, prefill_tokens, prefill_ms, tokens, "
                        "decode_ms, tok_s, stop_reason, cache, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (conv_id, turn.message_id, turn.kind, turn.prefill_tokens, turn.prefill_ms, turn.tokens,
                         turn.decode_ms, turn.tok_s, turn.stop_reason, json.dumps(turn.cache or {}), time.time()))
        return int(cur.lastrowid)

    def turns(self, conv_id: int) -> list[TurnRow]:
        rows = self._run("read the turn statistics",
                         "SELECT * FROM turns WHERE conversation_id=? ORDER BY id", (conv_id,))
        out = []
        for r in rows:
            try:
                cache = json.loads(r["cache"]) or None
            except ValueError:
                cache = None
            out.append(TurnRow(r["kind"], r["prefill_tokens"], r["prefill_ms"], r["tokens"], r["decode_ms"],
                               r["tok_s"], r["stop_reason"], cache, r["message_id"], r["id"]))
        return out


def _extra_text(extra: dict | None) -> str:
    return json.dumps(extra, ensure_ascii=False) if extra else ""


def _extra_of(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}  # a damaged value costs the message its extras, never the chat
    return value if isinstance(value, dict) else {}
