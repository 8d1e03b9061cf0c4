"""What the engine tells its callers, as typed events.

The session emits them; `eddy chat --json` prints each as one JSON line (DESIGN.md's contract: the fields and
their order are kept, new ones only added at the end); the app's worker forwards them, one signal per kind.
Torch-free, Qt-free.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class CacheStats:
    sinks: int  # sink slots in force in this conversation (a pinned system prompt's tokens among them)
    window: int
    capacity: int  # sinks + window
    used: int
    evicted: int  # tokens dropped so far in this conversation
    position: int  # tokens seen so far
    pinned: int = 0  # tokens of the system prompt held as sinks

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class _Event:
    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"event": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, CacheStats) else value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


@dataclass(frozen=True)
class Prefill(_Event):
    """New tokens were written to the cache (a turn's prompt, or a rebuild when `rebuild`)."""
    kind: ClassVar[str] = "prefill"
    new_tokens: int
    ms: float
    cache: CacheStats


@dataclass(frozen=True)
class PrefillProgress(_Event):
    """A message longer than the window streams through it: `done` of its `total` tokens are in so far."""
    kind: ClassVar[str] = "prefill_progress"
    done: int
    total: int
    cache: CacheStats


@dataclass(frozen=True)
class Token(_Event):
    kind: ClassVar[str] = "token"
    text: str


@dataclass(frozen=True)
class Done(_Event):
    kind: ClassVar[str] = "done"
    tokens: int
    ms: float
    tok_s: float
    stop_reason: str  # "eos" | "length" | "stopped"
    cache: CacheStats


@dataclass(frozen=True)
class Context(_Event):
    """Where each of the session's messages sits in the token stream, after a prefill.

    `spans[i]` is message i's [start, end) position (the session's messages, system message first if any);
    `left` lists those that have left the window (every one of their tokens past the sinks was evicted);
    `dropped` counts the leading messages a rebuild let go since the session was reset or resumed (the
    session's message i is the conversation's message dropped + i, after the system message).
    """
    kind: ClassVar[str] = "context"
    spans: tuple[tuple[int, int], ...]
    left: tuple[int, ...]
    dropped: int = 0


@dataclass(frozen=True)
class Error(_Event):
    kind: ClassVar[str] = "error"
    message: str


Event = Prefill | PrefillProgress | Token | Done | Context | Error
