"""Which part of a stored chat to put back into the cache.

Rebuilding the cache for a chat (opening it, regenerating, editing) costs a prefill of everything kept, so
only the most recent messages that fit the cache are kept: older ones would be evicted again at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Template tokens around one message's content (ChatML: "<|im_start|>role\n" ... "<|im_end|>\n"); only used
# to guess where to start, the chosen messages are then measured exactly.
_PER_MESSAGE_GUESS = 6


class ChatTokenizer(Protocol):
    def encode_text(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]: ...


@dataclass
class FittedHistory:
    messages: list[dict]  # what the session resumes from: the system message (if any), then history[first:]
    first: int            # index in `history` of the first message kept
    ids: list[int] = field(default_factory=list)  # the rendered tokens of `messages` ([] if nothing is kept)
    # Where each message lands in the cache is the session's to say (ChatSession.resume, its context event).


def _starts(history: list[dict], start: int) -> int:
    # A kept part begins with a user turn: chat templates expect one after the system message.
    while start < len(history) and history[start]["role"] != "user":
        start += 1
    return start


def fit_history(tokenizer: ChatTokenizer, system: str | None, history: list[dict], budget: int) -> FittedHistory:
    """The longest recent part of `history` that renders (with the system prompt) to at most `budget` tokens."""
    opening = [{"role": "system", "content": system}] if system else []
    used, start = 0, len(history)
    for i in range(len(history) - 1, -1, -1):
        used += len(tokenizer.encode_text(history[i]["content"])) + _PER_MESSAGE_GUESS
        if used > budget:
            break
        start = i
    start = _starts(history, start)
    while start < len(history):
        ids = tokenizer.encode_chat([*opening, *history[start:]], add_generation_prompt=False)
        if len(ids) <= budget:
            break
        start = _starts(history, start + 1)
    kept = history[start:]
    if not kept:
        return FittedHistory(list(opening), len(history))
    return FittedHistory([*opening, *kept], start, ids)
