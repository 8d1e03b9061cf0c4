"""What the engine tells its callers, as typed events.

The session emits them; `eddy chat --json` prints each as one JSON line (docs/CONTRACT.md: the fields and
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
    """New tokens were written to the cache: a turn's prompt, or a whole chat put back (ChatSession.resume)."""
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
class Reasoning(_Event):
    """A piece of a reasoning model's thinking (between <think> and </think>), which is not the reply."""
    kind: ClassVar[str] = "reasoning"
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
class DecodeProgress(_Event):
    """A reply is being written: `tokens` so far at `tok_s` (sent a few times a second, for live displays)."""
    kind: ClassVar[str] = "decode_progress"
    tokens: int
    tok_s: float


@dataclass(frozen=True)
class Context(_Event):
    """Where the conversation sits in the cache, after every prefill and reply.

    Messages are numbered in the conversation, the system prompt apart (it is `system`, a span; (0, 0) when
    there is none). `first` is the first message the cache was filled from: a rebuild keeps the recent ones
    that fit, and those before `first` are not in it. `spans[i]` is message first + i's [start, end) position
    in the token stream; `left` lists the messages that have left the window (every one of their tokens past
    the sinks evicted); `cut` is the one the eviction horizon falls inside (-1: none).
    """
    kind: ClassVar[str] = "context"
    first: int
    spans: tuple[tuple[int, int], ...]
    left: tuple[int, ...]
    cut: int
    system: tuple[int, int]
    cache: CacheStats

    @property
    def forgotten(self) -> int:
        """How many leading messages the model no longer sees: left out of the cache, or left the window."""
        return max([self.first, *(i + 1 for i in self.left)])

    @property
    def cut_seen(self) -> tuple[int, int]:
        """Of the cut message's tokens: (those still in the window, all of them); (0, 0) when none is cut.
        The window begins at the eviction horizon, the sinks plus the tokens evicted (as the session says)."""
        if self.cut < self.first or self.cut - self.first >= len(self.spans):
            return (0, 0)
        begin, end = self.spans[self.cut - self.first]
        horizon = self.cache.sinks + self.cache.evicted
        return (max(0, end - max(begin, horizon)), end - begin)


@dataclass(frozen=True)
class Error(_Event):
    kind: ClassVar[str] = "error"
    message: str


Event = Prefill | PrefillProgress | Token | Reasoning | DecodeProgress | Done | Context | Error
