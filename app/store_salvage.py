"""A damaged chat database: the search index rebuilt in place when the damage is confined to it, else every
chat, message, turn and preset that can still be read carried into a new file (the damaged one kept aside), and
what was done told to the user (Salvage).
"""
from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from . import store_migrations as migrations
from .store_errors import rollback

log = logging.getLogger(__name__)

# A store's one-transaction write (Store._atomic): what it is doing, for the error, and the write.
Atomic = Callable[[str, Callable[[sqlite3.Connection], None]], None]

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


def repair_search_index(path: Path) -> bool:
    """Rebuilds the search index in place if the damage is confined to it; True if the file is whole again.
    False (damage elsewhere, or the repair failed): the caller salvages the chats into a new file instead.
    It does not ask whether the index is damaged: the caller knows (a failed check, or an FTS query)."""
    try:
        conn = sqlite3.connect(str(path), isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        version = migrations.user_version(conn)
        if not SEARCH_VERSION <= version <= migrations.SCHEMA_VERSION:
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
            rollback(conn)
            raise
        conn.execute("PRAGMA writable_schema=OFF")
        conn.close()
        conn = sqlite3.connect(str(path), isolation_level=None)
        conn.execute("VACUUM")
        # The index as step 2 defines it (no later step changed it), filled from the messages and titles.
        conn.execute("BEGIN IMMEDIATE")
        try:
            migrations.run_step(conn, migrations.SEARCH)
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
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


def carry_over(source: Path, conn: sqlite3.Connection, atomic: Atomic) -> Salvage:
    """Copies every chat, message, turn and preset that can still be read from the damaged `source` into
    `conn`, a new, empty database (`atomic`: its store's one-transaction write), row by row. Python's sqlite3
    has no .recover (that is the sqlite3 shell's), so rows are found every way the file still allows: the table
    scanned from both ends, and through its indexes, which know a message's id and chat even when the page
    holding the message is lost."""
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
        _copy_readable(old, conn, atomic, report)
    finally:
        old.close()
    log.warning("salvaged %s: %s", source, report)
    return report


def _copy_readable(old: sqlite3.Connection, conn: sqlite3.Connection, atomic: Atomic, report: Salvage) -> None:
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

    def insert(into: sqlite3.Connection, table: str, rows: Iterable[dict[str, Any]]) -> None:
        wanted = _columns(into, table)
        for r in rows:
            cols = [c for c in wanted if c in r]
            into.execute(f"INSERT OR IGNORE INTO {table}({', '.join(cols)}) VALUES "
                         f"({', '.join('?' * len(cols))})", [r[c] for c in cols])

    # The rows are inserted in id order, a message's parent possibly after it: foreign keys are checked
    # per statement, so they are off for the copy (every reference was made to point at a kept row above).
    conn.execute("PRAGMA foreign_keys=OFF")
    try:
        atomic("carry the chats into a new database", lambda into: (
            insert(into, "conversations", chats.values()), insert(into, "messages", messages),
            insert(into, "turns", turns), insert(into, "presets", (dict(p) for p in presets))))
    finally:
        conn.execute("PRAGMA foreign_keys=ON")
    report.chats_kept, report.chats_lost = len(chats), len(chat_ids) - len(chats)
    report.messages_kept, report.messages_lost = len(messages), len(message_ids) - len(kept)
