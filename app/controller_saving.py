"""The controller's saving: each message and turn written to the store as it happens, a chat created on its
first message, and a write that fails kept for the SaveQueue (app/saving.py) to retry.

Mixed into ChatController (app/controller.py), whose chat, store, saves and signals it uses.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

from .store import ConversationRow, StoreError

NEW_CHAT_TITLE = "New chat"


def title_from(text: str) -> str:
    """A chat's title from its first message (or a fork's from the chat's): its first words, on one line."""
    line = " ".join(text.split())
    return line if len(line) <= 48 else line[:47].rstrip() + "…"


class ChatSaving:
    """Writes the open chat as it changes; a chat the store cannot take yet is kept under a temporary id."""

    def _read(self, fn: Callable[[], Any], fallback: Any) -> Any:
        try:
            return fn()
        except StoreError as e:
            self.notice.emit("error", str(e), "")
            return fallback

    def _ensure_conversation(self, first_text: str) -> None:
        if self.chat.conversation_id is not None:
            row = self.conversations.rows[self.conversations.row_of(self.chat.conversation_id)] \
                if self.conversations.row_of(self.chat.conversation_id) >= 0 else None
            if row is not None:
                self.conversations.upsert(replace(row, updated=time.time()))
            return
        title = title_from(first_text)
        self.chat.title = title
        try:
            conv_id = self.store.create_conversation(title)
        except StoreError as e:
            conv_id = self._next_temp_id  # not on disk yet: saved under a real id once the store works
            self._next_temp_id -= 1
            self.saves.mark(conv_id, e)
        self.chat.conversation_id = conv_id
        now = time.time()
        self.conversations.upsert(ConversationRow(conv_id, title, now, now))
        self.current_changed.emit()

    def _save_message(self, index: int) -> bool:
        conv_id = self.chat.conversation_id
        node = self.chat.nodes[index]
        message = node.item

        def write() -> None:
            parent = node.parent.item.id if node.parent is not None else None
            if node.parent is not None and parent is None:
                # Its parent never reached the disk: the whole chat is written, in order, once it can be.
                raise StoreError("Could not save the message: the one before it is not saved yet.")
            message.id = self.store.add_message(conv_id, parent, index, message.role, message.content, node.rank,
                                                message.extra)

        return self._write(conv_id, write)

    def _write(self, conv_id: int, fn: Callable[[], object], stats_only: bool = False) -> bool:
        """One store write for a chat; if the chat is already behind on disk, writes it whole instead."""
        if conv_id in self.saves:
            return False if stats_only else self.saves.flush(conv_id)
        try:
            fn()
            return True
        except StoreError as e:
            # Statistics are not worth a retry, and a chat that is not open has nothing unsaved in memory
            # (a failed rename just keeps the old title); the open conversation is kept and retried.
            if stats_only or conv_id != self.chat.conversation_id:
                self.notice.emit("warning", str(e), "")
            else:
                self.saves.mark(conv_id, e)
            return False

    def _on_saved_under(self, temp_id: int, real_id: int) -> None:
        """A chat first kept under a temporary id is on disk now: everything that names it follows."""
        if self._turn is not None and self._turn.conversation_id == temp_id:
            self._turn.conversation_id = real_id
        i = self.conversations.row_of(temp_id)
        if i >= 0:
            self.conversations.upsert(replace(self.conversations.rows[i], id=real_id), to_top=False)
        if self.chat.conversation_id == temp_id:
            self.chat.conversation_id = real_id
            self.current_changed.emit()

    def retry_saves(self) -> bool:
        """Tries to write every unsaved chat now; True if none is left."""
        return self.saves.retry()

    def _forget_empty_chat(self) -> None:
        """A new chat whose first message failed is not kept as an empty chat in the list."""
        conv_id = self.chat.conversation_id
        if conv_id is None:
            return
        try:
            if conv_id >= 0:
                self.store.delete_conversation(conv_id)
        except StoreError:
            return  # it stays in the list, empty: harmless
        self.saves.forget(conv_id)
        self.conversations.remove(conv_id)
        self.chat.conversation_id, self.chat.title = None, NEW_CHAT_TITLE
        self.current_changed.emit()
