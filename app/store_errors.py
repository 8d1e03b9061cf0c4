"""What a failed read or write of the chat database says (StoreError, a sentence for the user), and the
transaction it leaves rolled back. Shared by the store, its migrations and its salvage.
"""
from __future__ import annotations

import sqlite3


class StoreError(Exception):
    """A read or write failed; the message is meant for the user."""


def explain(e: sqlite3.Error, doing: str) -> StoreError:
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


def rollback(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back by itself (it does on SQLITE_FULL): keep the real error.
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
