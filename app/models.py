"""What the views render: the open chat, the list of chats and the per-turn statistics.

The views only read these and listen to their signals; the controller is the only writer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtGui import QFont
from PySide6.QtCore import QAbstractListModel, QAbstractTableModel, QModelIndex, QObject, QPersistentModelIndex, Qt, Signal

from engine.events import Context

from .branches import ChatTree, Node
from .documents import Document
from .store import ConversationRow, SearchHit, TurnRow
from .store_search import MARK_END, MARK_START

Index = QModelIndex | QPersistentModelIndex


@dataclass
class Message:
    role: str  # "user" | "assistant"
    content: str
    id: int | None = None                # row id in the store (None until saved)
    span: tuple[int, int] | None = None  # token positions in the current cache; None: not in it
    meta: dict[str, Any] = field(default_factory=dict)  # a reply's stats: tokens, tok_s, stop_reason
    streaming: bool = False              # a reply still being written
    pending: bool = False                # sent, but the engine has not reported where it went yet
    created: float = field(default_factory=time.time)  # when it was written (seconds since the epoch)
    # What it holds besides its text (app/store.py EXTRA): a reply's "reasoning" and "thinking_ms", the
    # "tool_calls" it made; a tool card's call and state.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reasoning(self) -> str:
        return self.extra.get("reasoning", "")

    def as_dict(self) -> dict[str, Any]:
        """The message as the engine takes it (a tool card is the tool's result; a reply's calls go with it)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.extra.get("tool_calls"):
            out["tool_calls"] = self.extra["tool_calls"]
        if self.role == "tool":
            out["tool_call_id"] = self.extra.get("tool_call_id", "")
        return out


class ChatModel(QObject):
    """The open conversation: all its branches (`tree`), the one shown (`messages`, with their `nodes` in the
    tree) and where each shown message sits in the model's cache."""

    reset = Signal()              # a different chat (or a changed list): render everything again
    appended = Signal(int)        # index of a new message at the end
    changed = Signal(int)         # a message's text or meta changed (streaming)
    truncated = Signal(int)       # messages from this index on were removed
    replaced = Signal(int)        # messages from this index on are another branch's now (one signal for them all)
    window_changed = Signal()     # spans or evictions changed: the "left the window" marker may move

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.conversation_id: int | None = None
        self.title = ""
        self.tree: ChatTree[Message] = ChatTree()
        self.nodes: list[Node[Message]] = []
        self.messages: list[Message] = []
        self.context: Context | None = None  # what the engine last said about the cache (None: nothing yet)

    def load(self, conversation_id: int | None, title: str, messages: ChatTree[Message] | list[Message]) -> None:
        """Shows a chat: its tree, or a list of messages (one branch)."""
        if isinstance(messages, ChatTree):
            tree = messages
        else:
            tree = ChatTree()
            parent = None
            for message in messages:
                parent = tree.add(parent, message)
        self.conversation_id, self.title, self.tree = conversation_id, title, tree
        self.nodes = tree.path()
        self.messages = [n.item for n in self.nodes]
        self.context = None
        self.reset.emit()
        self.window_changed.emit()

    def append(self, message: Message) -> int:
        """Adds a message after the last one shown."""
        self.nodes.append(self.tree.add(self.nodes[-1] if self.nodes else None, message))
        self.messages.append(message)
        self.appended.emit(len(self.messages) - 1)
        return len(self.messages) - 1

    def branch(self, index: int, message: Message) -> int:
        """Adds `message` as a new alternative to message `index` and shows it in place of that message and
        everything after it (which stays in the tree, reachable by switching back)."""
        parent = self.nodes[index].parent
        self._cut(index)
        self.nodes.append(self.tree.add(parent, message))
        self.messages.append(message)
        self.appended.emit(index)
        return index

    def alternatives(self, index: int) -> tuple[int, int]:
        """(which of its alternatives message `index` is, from 1; how many there are)."""
        return self.tree.alternatives(self.nodes[index])

    def switch(self, index: int, step: int) -> Node[Message] | None:
        """Shows the alternative `step` places from message `index` (-1: the one before) and the branch last
        shown under it; None (nothing changes) if there is none there."""
        siblings = self.tree.siblings(self.nodes[index])
        at = siblings.index(self.nodes[index]) + step
        if not 0 <= at < len(siblings):
            return None
        self.tree.choose(siblings[at])
        self._follow_tree(index)
        return siblings[at]

    def show(self, node: Node[Message]) -> list[Node[Message]]:
        """Shows the branch through `node` (a message of another branch); returns the nodes now chosen."""
        changed = self.tree.show(node)
        self._follow_tree(0)
        return changed

    def remove(self, index: int) -> None:
        """Takes message `index` and everything under it out of the chat; what was shown before it came
        (another alternative, or nothing) is shown again."""
        self.tree.remove(self.nodes[index])
        self._follow_tree(index)

    def _follow_tree(self, index: int) -> None:
        """Shows the tree's branch again, from the first message (at `index` or after) that changed."""
        path = self.tree.path()
        same = index
        while same < min(len(path), len(self.nodes)) and path[same] is self.nodes[same]:
            same += 1
        for node in path[same:]:
            # Where it sat in the cache was for the branch shown before; the engine says where it is now.
            node.item.span = None
        self.nodes[same:] = path[same:]
        self.messages[same:] = [n.item for n in path[same:]]
        self.replaced.emit(same)
        self.window_changed.emit()

    def _cut(self, index: int) -> None:
        if index < len(self.messages):
            del self.nodes[index:], self.messages[index:]
            self.truncated.emit(index)
            self.window_changed.emit()

    def add_text(self, index: int, text: str) -> None:
        self.messages[index].content += text
        self.changed.emit(index)

    def add_reasoning(self, index: int, text: str) -> None:
        m = self.messages[index]
        m.extra = {**m.extra, "reasoning": m.extra.get("reasoning", "") + text}
        self.changed.emit(index)

    def update(self, index: int, **changes: Any) -> None:
        message = self.messages[index]
        for name, value in changes.items():
            setattr(message, name, value)
        self.changed.emit(index)
        if "span" in changes:
            self.window_changed.emit()

    def history(self, end: int | None = None) -> list[dict[str, str]]:
        """The messages (up to `end`) as the engine takes them; a reply still being written is left out."""
        return [m.as_dict() for m in self.messages[:end] if not m.streaming]

    # --- the cache window ----------------------------------------------------------------------------------

    def apply_context(self, ctx: Context) -> None:
        """What the engine reports after each prefill and reply: messages before `ctx.first` were left out of the
        cache, the rest sit at `ctx.spans`; a message the engine has placed is no longer pending."""
        for i, message in enumerate(self.messages):
            inside = ctx.first <= i < ctx.first + len(ctx.spans)
            message.span = ctx.spans[i - ctx.first] if inside else None
            if inside:
                message.pending = False
        self.context = ctx
        self.window_changed.emit()

    @property
    def sinks(self) -> int:
        return self.context.cache.sinks if self.context else 0

    @property
    def evicted(self) -> int:
        return self.context.cache.evicted if self.context else 0

    @property
    def left_out(self) -> bool:
        """Whether messages at the start were not put back into the cache at all (a rebuild kept what fits)."""
        return bool(self.context and self.context.first)

    def forgotten(self) -> int:
        """How many leading messages the model no longer sees (the engine's count)."""
        return min(self.context.forgotten, len(self.messages)) if self.context else 0

    def partly_forgotten(self, index: int) -> bool:
        return self.context is not None and self.context.cut == index

    def seen_of(self, index: int) -> tuple[int, int] | None:
        """For the message the window's start falls inside: (its tokens the model still sees, all its tokens)."""
        return self.context.cut_seen if self.partly_forgotten(index) else None


class DraftModel(QObject):
    """The message being written: its attached documents and its size in tokens (the engine counts them)."""

    changed = Signal()            # anything shown changed
    documents_changed = Signal()  # a document was attached or removed: the draft needs counting again

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.documents: list[Document] = []
        self.tokens: int | None = None  # None: not counted yet (or no model to count with)
        self.window = 0                 # the loaded model's window, in tokens (0: no model)

    def add(self, document: Document) -> None:
        self.documents.append(document)
        self._documents_changed()

    def remove(self, index: int) -> None:
        if 0 <= index < len(self.documents):
            del self.documents[index]
            self._documents_changed()

    def set_documents(self, documents: list[Document]) -> None:
        self.documents = list(documents)
        self._documents_changed()

    def _documents_changed(self) -> None:
        self.tokens = None
        self.changed.emit()
        self.documents_changed.emit()

    def set_tokens(self, tokens: int | None) -> None:
        self.tokens = tokens
        self.changed.emit()

    def set_window(self, window: int) -> None:
        self.window = window
        self.changed.emit()


class ConversationListModel(QAbstractListModel):
    """The sidebar's chats, newest first. Editing a title emits rename_requested (the controller saves it)."""

    rename_requested = Signal(int, str)
    IdRole = Qt.ItemDataRole.UserRole + 1

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.rows: list[ConversationRow] = []

    def set_rows(self, rows: list[ConversationRow]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.endResetModel()

    def row_of(self, conv_id: int) -> int:
        return next((i for i, r in enumerate(self.rows) if r.id == conv_id), -1)

    def upsert(self, row: ConversationRow, to_top: bool = True) -> None:
        i = self.row_of(row.id)
        if i >= 0 and not to_top:
            self.rows[i] = row
            self.dataChanged.emit(self.index(i), self.index(i))
            return
        if i >= 0:
            self.rows[i] = row
            if i == 0:
                self.dataChanged.emit(self.index(0), self.index(0))
                return
            # A move, not a removal and an insertion: the list's current item (the open chat) moves with its
            # row. Removing it would make the view pick a neighbour as current, and the window open that chat.
            self.beginMoveRows(QModelIndex(), i, i, QModelIndex(), 0)
            self.rows.insert(0, self.rows.pop(i))
            self.endMoveRows()
            return
        self.beginInsertRows(QModelIndex(), 0, 0)
        self.rows.insert(0, row)
        self.endInsertRows()

    def remove(self, conv_id: int) -> None:
        i = self.row_of(conv_id)
        if i >= 0:
            self.beginRemoveRows(QModelIndex(), i, i)
            del self.rows[i]
            self.endRemoveRows()

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802 (Qt API)
        return 0 if parent.isValid() else len(self.rows)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole, Qt.ItemDataRole.AccessibleTextRole):
            return row.title
        if role == Qt.ItemDataRole.ToolTipRole:
            return f"{row.title}\nlast used {time.strftime('%Y-%m-%d %H:%M', time.localtime(row.updated))}"
        if role == self.IdRole:
            return row.id
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        base = super().flags(index)
        return base | Qt.ItemFlag.ItemIsEditable if index.isValid() else base

    def setData(self, index: Index, value: Any, role: int = Qt.ItemDataRole.EditRole) -> bool:  # noqa: N802
        title = str(value).strip()
        if role != Qt.ItemDataRole.EditRole or not index.isValid() or not title:
            return False
        self.rename_requested.emit(self.rows[index.row()].id, title)
        return True


class SearchResultsModel(QAbstractListModel):
    """The hits of one search (the controller's search() fills it); each row's HitRole is its SearchHit."""

    HitRole = Qt.ItemDataRole.UserRole + 1

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hits: list[SearchHit] = []

    def set_hits(self, hits: list[SearchHit]) -> None:
        self.beginResetModel()
        self.hits = list(hits)
        self.endResetModel()

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.hits)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        hit = self.hits[index.row()]
        if role == self.HitRole:
            return hit
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.AccessibleTextRole):
            plain = hit.snippet.replace(MARK_START, "").replace(MARK_END, "")
            return f"{hit.title}: {plain}" if hit.message_id is not None else hit.title
        return None


class TurnStatsModel(QAbstractTableModel):
    """One row per prefill of the open chat: its replies and its cache rebuilds; and the local server's
    requests made while it is open (kind "server": the same engine, another conversation's cache)."""

    HEADERS = ("#", "Prefill tok", "TTFT ms", "Reply tok", "tok/s")
    TOOLTIPS = ("Turn number (↻ marks a cache rebuild from the stored chat, \"server\" a local-server request)",
                "New tokens the model had to read before answering",
                "Time to first token: how long that prefill took",
                "Tokens in the reply", "Reply speed (decode tokens per second)")

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.rows: list[TurnRow] = []
        self.live_row = -1  # the row of the reply still streaming, shown in italics

    def set_rows(self, rows: list[TurnRow]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.live_row = -1
        self.endResetModel()

    def append(self, stat: TurnRow, live: bool = False) -> int:
        n = len(self.rows)
        self.beginInsertRows(QModelIndex(), n, n)
        self.rows.append(stat)
        self.endInsertRows()
        if live:
            self.live_row = n
        return n

    def update(self, row: int, live: bool | None = None, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(self.rows[row], name, value)
        if live is not None:
            self.live_row = row if live else -1
        self.dataChanged.emit(self.index(row, 0), self.index(row, len(self.HEADERS) - 1))

    def turn_number(self, row: int) -> int:
        return sum(1 for r in self.rows[: row + 1] if r.kind == "turn")

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.HEADERS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.ItemDataRole.DisplayRole) -> Any:  # noqa: N802
        if orientation != Qt.Orientation.Horizontal:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return self.HEADERS[section]
        if role == Qt.ItemDataRole.ToolTipRole:
            return self.TOOLTIPS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r, col = self.rows[index.row()], index.column()
        if role == Qt.ItemDataRole.TextAlignmentRole:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role == Qt.ItemDataRole.ToolTipRole and r.kind == "rebuild":
            return ("The cache was rebuilt from this chat's recent messages (opening it, regenerating or editing), "
                    "or moved to another branch of it")
        if role == Qt.ItemDataRole.ToolTipRole and r.kind == "server":
            return (f"A request to the local server: {r.prefill_tokens:,} new tokens read, {r.reused:,} reused from "
                    "its conversation's cache. This chat's cache was set aside and put back as it was.")
        if role == Qt.ItemDataRole.FontRole and index.row() == self.live_row:
            font = QFont()
            font.setItalic(True)  # still streaming
            return font
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if col == 0:
            return {"rebuild": "↻", "server": "server"}.get(r.kind) or str(self.turn_number(index.row()))
        if col == 1:
            return f"{r.prefill_tokens:,}"
        if col == 2:
            return f"{r.prefill_ms:,.1f}"
        if r.kind == "rebuild":
            return ""
        if col == 3:
            return f"{r.tokens:,}"
        return f"{r.tok_s:,.1f}" if r.tok_s else ""
