"""The controller's alternatives and branches: switching to another alternative, deleting one, forking the chat
at a message. The tree is the ChatModel's (app/branches.py); each change is saved and the branch shown is put
into the model's cache.

Mixed into ChatController (app/controller.py), whose chat, store, prompts and signals it uses.
"""
from __future__ import annotations

from .branches import Node
from .controller_saving import title_from
from .models import Message


class BranchHandling:
    """Switches, deletes and forks alternatives; refused while a reply is being written."""

    def switch_alternative(self, index: int, step: int) -> bool:
        """Shows the alternative `step` places from message `index` (-1: the previous one) and the branch
        under it, and puts that branch into the model's cache. Refused while a reply is being written."""
        if self.busy or self._closing:
            self.notice.emit("info", "Wait for the reply to finish, or stop it, before switching to another "
                             "alternative.", "")
            return False
        if not 0 <= index < len(self.chat.messages):
            return False
        node = self.chat.switch(index, step)
        if node is None:
            return False
        self._save_choice(node)
        self._sync_engine()
        return True

    def delete_alternative(self, index: int) -> bool:
        """Deletes message `index`, one of several alternatives, and the branch that went on from it; the
        alternative chosen before it is shown and put into the model's cache. Refused while a reply is being
        written, and for a message without alternatives (nothing would be left to show in its place)."""
        if self.busy or self._closing:
            self.notice.emit("info", "Wait for the reply to finish, or stop it, before deleting an alternative.", "")
            return False
        if not 0 <= index < len(self.chat.messages) or self.chat.alternatives(index)[1] < 2:
            return False
        conv_id, message = self.chat.conversation_id, self.chat.messages[index]
        self.chat.remove(index)
        if conv_id is not None and message.id is not None:
            # The rows under it go with it (parent_id ON DELETE CASCADE), and so do their search entries.
            self._write(conv_id, lambda: self.store.delete_message(message.id))
        self._sync_engine()
        return True

    def fork_chat(self, index: int) -> bool:
        """Copies the chat as shown, up to and with message `index`, into a new chat, and opens it."""
        if self.busy or self._closing:
            self.notice.emit("info", "Wait for the reply to finish, or stop it, before forking the chat.", "")
            return False
        if not 0 <= index < len(self.chat.messages):
            return False
        copies = [Message(m.role, m.content, meta=dict(m.meta), extra=dict(m.extra))
                  for m in self.chat.messages[: index + 1]]
        title = title_from(f"{self.chat.title} (fork)")
        prompt = self.prompts.chat_prompt  # the fork keeps the chat's own system prompt (None: the default)
        self._leave_current()
        self.chat.load(None, title, copies)
        self.turns.set_rows([])
        self._ensure_conversation(title)
        conv_id = self.chat.conversation_id

        def write() -> None:
            rows = [(m.role, m.content, i - 1 if i else None, 0, m.extra) for i, m in enumerate(copies)]
            for message, mid in zip(copies, self.store.replace_tree(conv_id, title, rows)):
                message.id = mid

        self._write(conv_id, write)
        self.conversation_opened.emit()
        before = self.prompts.effective
        if prompt is not None:
            self.prompts.set_chat_prompt(prompt)
        if self.prompts.effective == before:  # else the prompt's change has put the chat into the cache already
            self._sync_engine()
        return True

    def _save_choice(self, node: Node[Message]) -> None:
        conv_id, message = self.chat.conversation_id, node.item
        if conv_id is not None and message.id is not None:
            self._write(conv_id, lambda: self.store.choose_message(message.id, node.rank))
