"""The controller's turns: a message sent, a reply regenerated or a message edited, and the engine's typed events
(engine/events.py) for the turn in progress or the latest chat switch, which fill in the reply, its statistics and
the cache's state. A failed turn takes out only what it added.

Mixed into ChatController (app/controller.py), whose chat, draft, turns, host, tools and signals it uses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from engine.events import CacheStats, Context, DecodeProgress, Done, Prefill, PrefillProgress, Reasoning, Token

from .documents import Document, as_message
from .models import Message
from .store import TurnRow
from .worker import TURN_ERRORS, Origin


@dataclass
class InFlight:
    """The reply being generated."""
    ticket: int
    conversation_id: int
    user_index: int
    reply_index: int
    user_text: str
    documents: tuple[Document, ...] = ()  # attached to the message: back into the draft if the turn fails
    new_from: int = -1  # the first message the turn added (its user message, or a regenerated reply's index)
    stat_row: int = -1
    prefill: Prefill | None = None
    thinking: tuple[float, float] = (0.0, 0.0)  # monotonic times of its first and last thinking token


class TurnHandling:
    """Starts turns, follows the engine's events for them, and ends them (running what waited for the end)."""

    def send(self, text: str) -> bool:
        """Sends a user message, with the draft's documents before it; False (and nothing changes) if that
        is not possible right now."""
        question = text.strip()
        documents = tuple(self.draft.documents)
        if not (question or documents) or not self.can_send:
            return False
        message = as_message(list(documents), question) if documents else question
        self._ensure_conversation(question or ", ".join(d.name for d in documents))
        user = self.chat.append(Message("user", message, pending=True))
        self._save_message(user)
        self.tools.new_user_turn()
        self._start_turn(self.host.send(message), user, question, documents)
        self.draft.set_documents([])
        return True

    def regenerate(self, index: int | None = None) -> bool:
        """Answers the user message before reply `index` (default: the last reply) again: the new reply is
        shown, the earlier ones stay as its alternatives, each with the branch that went on from it."""
        msgs = self.chat.messages
        index = len(msgs) - 1 if index is None else index
        if (not self.can_send or not 1 <= index < len(msgs) or msgs[index].role != "assistant"
                or msgs[index - 1].role != "user"):
            return False
        user = index - 1
        text = msgs[user].content
        # The last reply is decoded again from the cache as it is; an earlier one first takes the cache back
        # to its user message (a rewind when the cache still holds it, else a rebuild, as a branch switch).
        ticket = self.host.regenerate() if index == len(msgs) - 1 else self.host.answer_from(self.chat.history(user), text)
        self.chat.update(user, pending=True)
        self._start_turn(ticket, user, text, regenerate=True)
        return True

    def last_user_text(self) -> str | None:
        i = self.last_user_index()
        return None if i is None else self.chat.messages[i].content

    def last_user_index(self) -> int | None:
        return next((i for i in range(len(self.chat.messages) - 1, -1, -1) if self.chat.messages[i].role == "user"), None)

    def edit_resend(self, new_text: str) -> bool:
        """Edits the last user message (see edit_message)."""
        user = self.last_user_index()
        return user is not None and self.edit_message(user, new_text)

    def edit_message(self, index: int, new_text: str) -> bool:
        """Sends `new_text` in place of user message `index` and answers it: a new branch from there. The
        branch it replaces stays in the chat, one switch away. False (and nothing changes) if not possible."""
        new_text = new_text.strip()
        msgs = self.chat.messages
        if not new_text or not self.can_send or not 0 <= index < len(msgs) or msgs[index].role != "user":
            return False
        history = self.chat.history(index)
        self._ensure_conversation(new_text)
        user = self.chat.branch(index, Message("user", new_text, pending=True))
        self._save_message(user)
        self._start_turn(self.host.answer_from(history, new_text), user, new_text)
        return True

    def stop(self) -> None:
        if self._turn is not None:
            self.host.stop(self._turn.ticket)

    def _start_turn(self, ticket: int, user_index: int, text: str, documents: tuple[Document, ...] = (),
                    regenerate: bool = False, after_tools: bool = False) -> None:
        """`after_tools`: the reply to tools' results (`user_index` is the last card): a failure takes only it."""
        message = Message("assistant", "", streaming=True, pending=True)
        reply = self.chat.branch(user_index + 1, message) if regenerate else self.chat.append(message)
        self._turn = InFlight(ticket, self.chat.conversation_id, user_index, reply, text, documents,
                              new_from=reply if regenerate or after_tools else user_index)
        self.busy_changed.emit()

    def _end_turn(self) -> None:
        self._turn = None
        self.busy_changed.emit()
        pending, self._after_idle = self._after_idle, []
        for action in pending:
            action()

    def _when_idle(self, action: Callable[[], None], stop: bool = True) -> None:
        """Runs `action` once the reply in progress ends (asking it to stop, unless `stop` is False)."""
        if not self.busy:
            action()
            return
        self._after_idle.append(action)
        if stop:
            self.stop()

    # --- engine events (typed, from engine/events.py; the engine says where everything is) -------------

    def _current(self, origin: Origin) -> bool:
        """Whether an event answers the request in progress, or the latest chat switch (not an older one)."""
        if origin.rebuild:
            return origin.switch == self.host.latest_switch
        return self._turn is not None and origin.ticket == self._turn.ticket

    def _on_prefill(self, ev: Prefill, origin: Origin) -> None:
        if not self._current(origin):
            return
        if origin.rebuild:
            if ev.new_tokens:
                row = TurnRow("rebuild", ev.new_tokens, ev.ms, cache=ev.cache.to_dict())
                self.turns.append(row)
                conv_id = self.chat.conversation_id
                if conv_id is not None:
                    self._write(conv_id, lambda: self.store.add_turn(conv_id, row), stats_only=True)
                self.rebuilt.emit(ev)
            return
        turn = self._turn
        turn.prefill = ev
        turn.stat_row = self.turns.append(TurnRow("turn", ev.new_tokens, ev.ms), live=True)
        self.turn_prefilled.emit(ev)

    def _on_prefill_progress(self, ev: PrefillProgress, origin: Origin) -> None:
        self._on_cache(ev.cache)
        if not origin.rebuild and self._current(origin):
            self.reading.emit(ev.done, ev.total)

    def _on_token(self, ev: Token, origin: Origin) -> None:
        if self._current(origin):
            self.chat.add_text(self._turn.reply_index, ev.text)

    def _on_reasoning(self, ev: Reasoning, origin: Origin) -> None:
        if not self._current(origin):
            return
        turn = self._turn
        now = time.monotonic()
        turn.thinking = (turn.thinking[0] or now, now)
        self.chat.add_reasoning(turn.reply_index, ev.text)

    def _on_decode_progress(self, ev: DecodeProgress, origin: Origin) -> None:
        if not self._current(origin):
            return
        self.live_rate.emit(ev.tok_s, ev.tokens)
        if self._turn.stat_row >= 0:
            self.turns.update(self._turn.stat_row, tokens=ev.tokens, tok_s=ev.tok_s)

    def _on_done(self, ev: Done, origin: Origin) -> None:
        if not self._current(origin):
            return
        turn = self._turn
        prefill = turn.prefill or Prefill(0, 0.0, ev.cache)
        meta = {"tokens": ev.tokens, "tok_s": ev.tok_s, "stop_reason": ev.stop_reason,
                "prefill_tokens": prefill.new_tokens, "prefill_ms": prefill.ms}
        reply = self.chat.messages[turn.reply_index]
        if self.model_info is not None and self.model_info.model:
            reply.extra = {**reply.extra, "model": self.model_info.model}  # which model wrote it (hover, export)
        if turn.thinking[0]:
            # Stored with the message: how long it thought, from its first thinking token to its last.
            reply.extra = {**reply.extra, "thinking_ms": round((turn.thinking[1] - turn.thinking[0]) * 1e3)}
        self.chat.update(turn.reply_index, streaming=False, pending=False, meta=meta)
        if turn.stat_row >= 0:
            self.turns.update(turn.stat_row, tokens=ev.tokens, decode_ms=ev.ms, tok_s=ev.tok_s,
                              stop_reason=ev.stop_reason, live=False)
        conv_id = turn.conversation_id
        saved = self._save_message(turn.reply_index)
        message_id = self.chat.messages[turn.reply_index].id if saved else None
        row = TurnRow("turn", prefill.new_tokens, prefill.ms, ev.tokens, ev.ms, ev.tok_s, ev.stop_reason,
                      ev.cache.to_dict(), message_id)
        self._write(conv_id, lambda: self.store.add_turn(conv_id, row), stats_only=True)
        self.live_rate.emit(ev.tok_s, ev.tokens)
        self.turn_finished.emit(row)
        self._last_reply = turn.reply_index
        self._end_turn()

    def _on_cache(self, cache: CacheStats) -> None:
        self.cache = cache
        self.cache_changed.emit(cache)

    def _on_context(self, ctx: Context, origin: Origin) -> None:
        if self._current(origin):  # not a rebuild for a chat that is no longer open
            self.chat.apply_context(ctx)
            self._on_cache(ctx.cache)

    def _on_error(self, kind: str, message: str) -> None:
        if kind in TURN_ERRORS:
            turn = self._turn
            if turn is None:
                return
            # Nothing of the failed turn stays in the model's session, so what it added leaves the chat too (what
            # was shown before, an earlier alternative, is shown again) and a message it sent goes back to the
            # input box to be edited or sent again.
            if turn.stat_row >= 0:
                self.turns.update(turn.stat_row, live=False, stop_reason="error")
            added = self.chat.messages[turn.new_from]
            self.chat.remove(turn.new_from)
            conv_id = turn.conversation_id
            if added.id is not None:
                self._write(conv_id, lambda: self.store.delete_message(added.id))
            if not self.chat.messages:
                self._forget_empty_chat()
            if turn.documents and not self.draft.documents:
                self.draft.set_documents(list(turn.documents))
            if turn.new_from == turn.user_index:
                self.restore_input.emit(turn.user_text)
            self.notice.emit("error", message, "")
            # The session went back to before the turn; an earlier alternative shown again must be put back.
            shown_again = len(self.chat.messages) > turn.new_from
            self._end_turn()
            if shown_again:
                self._sync_engine()
        elif kind == "load":
            self._set_model_state("failed")
            self.notice.emit("error", f"The model could not be loaded: {message}", "settings")
        elif kind == "cancelled":
            self._set_model_state("failed")
            self.notice.emit("warning", "Building the model was cancelled. Eddy needs the compiled model to chat.",
                             "retry_load")
        else:
            self.notice.emit("warning", message, "")
