"""Search over the chats: the user's words as an FTS5 query that can't be a syntax error, and the titles and
messages that match (SearchHit), their matches marked. The index itself is schema step 2 (store_migrations.py).
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass

# How search() marks the matched words in a hit's snippet (control characters: they never occur in a chat's
# text as typed, and a view turns them into its own emphasis after escaping the rest).
MARK_START, MARK_END = "\x02", "\x03"
SNIPPET_TOKENS = 14  # words of context around a match


def fts_query(text: str) -> str:
    """The user's words as an FTS5 query that cannot be a syntax error: each word quoted (a '"' doubled), with
    a prefix star, all of them required. Words with no letter or digit are dropped (the index has none)."""
    words = [w for w in text.split() if any(ch.isalnum() for ch in w)]
    return " ".join('"' + w.replace('"', '""') + '"*' for w in words)


@dataclass
class SearchHit:
    conversation_id: int
    title: str
    message_id: int | None  # None: the chat's title matched
    seq: int                # the message's position in its chat (-1 for a title)
    role: str               # "user" | "assistant" ("" for a title)
    snippet: str            # the matched text around the match, matches between MARK_START and MARK_END


def find(conn: sqlite3.Connection, text: str, limit: int) -> list[SearchHit]:
    """Titles first, then messages, best match first, at most `limit`; `text` is valid UTF-8 already. Raises
    sqlite3.Error (a damaged index among them: the store rebuilds it)."""
    query = fts_query(text)
    if not query:
        return []
    m0, m1 = MARK_START, MARK_END
    titles = conn.execute("SELECT c.id, c.title, highlight(titles_fts, 0, ?, ?) AS snip FROM titles_fts "
                          "JOIN conversations c ON c.id = titles_fts.rowid WHERE titles_fts MATCH ? "
                          "ORDER BY rank LIMIT ?", (m0, m1, query, limit)).fetchall()
    messages = conn.execute("SELECT m.conversation_id, c.title, m.id, m.seq, m.role, "
                            "snippet(messages_fts, 0, ?, ?, '…', ?) AS snip FROM messages_fts "
                            "JOIN messages m ON m.id = messages_fts.rowid "
                            "JOIN conversations c ON c.id = m.conversation_id "
                            "WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?",
                            (m0, m1, SNIPPET_TOKENS, query, limit)).fetchall()
    hits = [SearchHit(r["id"], r["title"], None, -1, "", r["snip"]) for r in titles]
    hits += [SearchHit(r["conversation_id"], r["title"], r["id"], r["seq"], r["role"], r["snip"]) for r in messages]
    return hits[:limit]
