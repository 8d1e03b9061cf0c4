"""What a bubble says about its message besides the text: the meta line beside the sender's name, the time,
the tooltip, and the note where the model's view of a long message begins. Plain text from a Message: no widgets.
"""
from __future__ import annotations

import time

from .models import Message

# What a tool card's meta line says in each state (app/tool_cards.py).
CARD_STATES = {"asking": "asks to run", "running": "running…", "done": "done", "failed": "failed",
               "denied": "not allowed", "stopped": "stopped", "skipped": "not run"}


def meta_line(message: Message, forgotten: bool = False, partly: bool = False,
              seen: tuple[int, int] | None = None) -> str:
    """A card's state, or a reply's length, speed, calls and why it ended; then whether the model still sees the
    message (`seen`: for the one its window begins inside, its tokens still seen and all its tokens)."""
    bits = []
    if message.role == "tool":
        bits.append(CARD_STATES.get(message.extra.get("state", ""), "")
                    + (f" in {message.extra['seconds']:.1f} s" if message.extra.get("seconds") is not None else ""))
    elif message.streaming:
        bits.append("writing…")
    elif message.meta:
        m = message.meta
        bits.append(f"{m.get('tokens', 0)} tokens · {m.get('tok_s', 0):.1f} tok/s")
        calls = [c.get("function", {}).get("name", "?") for c in message.extra.get("tool_calls") or []]
        if calls:
            bits.append("calls " + ", ".join(calls))
        if m.get("stop_reason") == "stopped":
            bits.append("stopped")
        elif m.get("stop_reason") == "length":
            bits.append("cut at max length")
    if forgotten:
        bits.append("out of the model's window")
    elif partly and seen:
        bits.append(f"partly out of the model's window: it sees the last {seen[0]:,} of {seen[1]:,} tokens")
    elif partly:
        bits.append("partly out of the model's window")
    return " · ".join(bits)


def short_time(t: float, now: float | None = None) -> str:
    """A message's time as the bubble shows it: the time of day, with the date when it is not today."""
    when, today = time.localtime(t), time.localtime(now if now is not None else time.time())
    if when[:3] == today[:3]:
        return time.strftime("%H:%M", when)
    if when.tm_year == today.tm_year:
        return f"{when.tm_mday} {time.strftime('%b %H:%M', when)}"
    return f"{when.tm_mday} {time.strftime('%b %Y %H:%M', when)}"


def message_tooltip(message: Message) -> str:
    """What hovering a message tells: when it was written and, for a reply, how fast and how long it was."""
    when = time.localtime(message.created)
    lines = [f"{'Sent' if message.role == 'user' else 'Written'} {time.strftime('%H:%M:%S', when)} on "
             f"{when.tm_mday} {time.strftime('%B %Y', when)}"]
    m = message.meta
    if message.streaming:
        lines.append("Being written…")
    elif message.role == "assistant" and m:
        lines.append(f"{m.get('tokens', 0):,} tokens at {m.get('tok_s', 0):.1f} tok/s (decode)")
        if m.get("prefill_tokens"):
            lines.append(f"Read {m['prefill_tokens']:,} new tokens first, in {m.get('prefill_ms', 0):,.0f} ms")
    if message.extra.get("model"):
        lines.append(f"By {message.extra['model']}")
    return "\n".join(lines)


def cut_note(seen: tuple[int, int]) -> str:
    """The note set into a long message where the model's view of it begins (`seen`: its tokens still seen,
    all its tokens)."""
    return (f"▼ The model's view begins about here: it still sees the last {seen[0]:,} of this message's "
            f"{seen[1]:,} tokens. The text above has streamed through its window.")


def cut_offset(text: str, seen: int, total: int) -> int:
    """Roughly where in `text` the model's view begins: the same share of the characters as of the tokens
    (the exact place would need the tokenizer), moved back to its line's start when that is near."""
    if total <= 0:
        return 0
    offset = max(0, min(len(text), len(text) - round(len(text) * seen / total)))
    line = text.rfind("\n", 0, offset) + 1
    if offset - line <= 160:
        return line
    space = text.rfind(" ", 0, offset)
    return space + 1 if space >= 0 and offset - space < 40 else offset
