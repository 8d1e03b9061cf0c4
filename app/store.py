"""Chats on disk: one SQLite file (WAL) with conversations, their messages and each turn's statistics.

Every write is its own short transaction, so a crash loses at most the reply being streamed. Failures are
raised as StoreError with a message for the user; the caller keeps the chat in memory and retries later.
Opening brings a database from an older Eddy up to date, one step of MIGRATIONS at a time (store_migrations.py),
refuses one from a newer Eddy without touching it, and salvages a damaged one (store_salvage.py). Search is
store_search.py's.

StoreError and SearchHit are imported from here: what Store's methods raise and return.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from . import store_migrations as migrations
from .branches import ChatTree
from .store_errors import StoreError, explain, rollback
from .store_salvage import Salvage, carry_over, repair_search_index
from .store_search import SearchHit, find

DB_FILE = "eddy.db"

log = logging.getLogger(__name__)

__all__ = ["DB_FILE", "ConversationRow", "MessageRow", "SearchHit", "Store", "StoreError", "TurnRow"]


def _text(value: str) -> str:
    # SQLite needs valid UTF-8: a lone surrogate (text decoded with surrogateescape, a UTF-16 source) would
    # raise UnicodeEncodeError, not a StoreError. Pairs are joined, lone ones become U+FFFD.
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


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
            raise explain(e, "open the chat database") from e
        except sqlite3.DatabaseError as first:
            log.warning("the chat database %s is damaged: %s", path, first)
            if repair_search_index(path):
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
            store.salvage = carry_over(moved, store.conn, store._atomic)
            return store

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(str(path), isolation_level=None)  # autocommit; transactions are explicit
        try:
            conn.row_factory = sqlite3.Row
            # First, before anything that writes (journal_mode=WAL rewrites the header): a newer Eddy's file
            # must stay exactly as it is.
            version = migrations.user_version(conn)
            if version > migrations.SCHEMA_VERSION:
                raise migrations.newer(path, version)
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode loses at most the last transaction on power loss, never corrupts.
            conn.execute("PRAGMA synchronous=NORMAL")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            # A new or old file: writes only then, so opening never waits on a writer.
            if version < migrations.SCHEMA_VERSION:
                migrations.migrate(conn, version)
            conn.execute("PRAGMA foreign_keys=ON")  # after the steps, which need them off (see store_migrations.Step)
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
            raise explain(e, doing) from e

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
                rollback(self.conn)
                raise
        except sqlite3.Error as e:
            raise explain(e, doing) from e

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
        start): titles first, then messages, best match first. Any text is safe to pass (see
        store_search.fts_query)."""
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
        repaired = repair_search_index(self.path)
        try:
            self.conn = self._connect(self.path)
        except sqlite3.Error as e:
            raise explain(e, "open the chat database") from e
        return repaired

    def _search(self, text: str, limit: int) -> list[SearchHit]:
        try:
            return find(self.conn, _text(text), limit)
        except sqlite3.Error as e:
            raise explain(e, "search the chats") from e

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
