"""Chats whose copy on disk is behind memory, written again until the store takes them.

Memory is the truth: a failed save leaves the chat in memory, marked unsaved, and a timer writes it whole
again until it works, every branch of it. The open chat is read live (through `open_chat`); a chat left while
unsaved is kept as a snapshot until then.
"""
from __future__ import annotations

import logging
from typing import Callable

from PySide6.QtCore import QObject, QTimer, Signal

from .branches import ChatTree
from .models import Message
from .store import Store, StoreError

log = logging.getLogger(__name__)

RETRY_SAVE_MS = 15_000

OpenChat = Callable[[], tuple[int | None, str, ChatTree[Message]]]  # (id, title, tree) of the open chat


class SaveQueue(QObject):
    failed = Signal(str)        # a chat could not be saved and is kept in memory: the message for the user
    all_saved = Signal()        # a retry wrote every unsaved chat
    moved = Signal(int, int)    # a chat kept under a temporary id (< 0) is on disk now, under its real id

    def __init__(self, store: Store, open_chat: OpenChat, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self._open_chat = open_chat
        # id -> None (the open chat, read live) or a (title, tree) snapshot of a chat no longer open (the chat
        # model takes a new tree when it opens another chat, so the one kept is no longer changed).
        self._unsaved: dict[int, tuple[str, ChatTree[Message]] | None] = {}
        self._timer = QTimer(self)
        self._timer.setInterval(RETRY_SAVE_MS)
        self._timer.timeout.connect(self.retry)

    def __contains__(self, conv_id: object) -> bool:
        return conv_id in self._unsaved

    @property
    def pending(self) -> int:
        """How many chats are behind on disk."""
        return len(self._unsaved)

    def mark(self, conv_id: int, error: StoreError) -> None:
        """The open chat is behind on disk: it is read live from memory until a retry writes it."""
        log.warning("saving failed: %s", error)
        self._unsaved[conv_id] = None
        self.failed.emit(f"{error} Your chat is kept in memory and Eddy will keep trying to save it.")
        if not self._timer.isActive():
            self._timer.start()

    def leave(self, conv_id: int | None, title: str, tree: ChatTree[Message]) -> None:
        """The open chat is being left: if it is unsaved, its messages are kept as they are now."""
        if conv_id is not None and conv_id in self._unsaved:
            self._unsaved[conv_id] = (title, tree)

    def reopen(self, conv_id: int) -> tuple[str, ChatTree[Message]] | None:
        """A chat is opened again: its unsaved snapshot (None if it has none), read live from now on."""
        snapshot = self._unsaved.get(conv_id)
        if snapshot is not None:
            self._unsaved[conv_id] = None
        return snapshot

    def forget(self, conv_id: int) -> None:
        """A deleted chat is not written again."""
        self._unsaved.pop(conv_id, None)

    def flush(self, conv_id: int) -> bool:
        """Writes a whole unsaved chat; True if it is now on disk."""
        snapshot = self._unsaved.get(conv_id)
        if snapshot is None:
            _, title, tree = self._open_chat()
        else:
            title, tree = snapshot
        done = [n for n in tree.nodes() if not n.item.streaming]  # a reply being written is a leaf
        where = {node: i for i, node in enumerate(done)}
        rows = [(n.item.role, n.item.content, where[n.parent] if n.parent is not None else None, n.rank, n.item.extra)
                for n in done]
        try:
            real_id = self.store.create_conversation(title) if conv_id < 0 else conv_id
            ids = self.store.replace_tree(real_id, title, rows)
        except StoreError:
            return False
        for node, mid in zip(done, ids):
            node.item.id = mid
        del self._unsaved[conv_id]
        if real_id != conv_id:
            self.moved.emit(conv_id, real_id)
        return True

    def retry(self) -> bool:
        """Tries to write every unsaved chat; True if none is left."""
        for conv_id in list(self._unsaved):
            self.flush(conv_id)
        if self._unsaved:
            return False
        self._timer.stop()
        self.all_saved.emit()
        return True

    def close(self) -> None:
        """A last try for every unsaved chat (the app is closing): what still fails is logged."""
        self._timer.stop()
        for conv_id in list(self._unsaved):
            self.flush(conv_id)
        if self._unsaved:
            log.error("%d chat(s) could not be saved before closing", len(self._unsaved))
