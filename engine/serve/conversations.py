"""Which cache a request continues. Runs on the engine thread.

A client resends the whole conversation with every request. The pool keeps a few conversations' whole cache
states (ChatSession.snapshot: the module's cache globals copied on the device, and the record of what is in
them), finds the one sharing the longest run of leading messages with the request (and its system prompt),
switches the engine to it, rewinds what diverges and feeds only the rest with the new user message. Two
clients taking turns therefore keep their own caches instead of evicting each other every request.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

from ..events import Done, Prefill
from ..run.session import ChatSession, ChatSettings, EventSink, SessionState, TurnResult, decode_reply
from ..run.tokenizer import common_prefix

@dataclass
class Kept:
    system: str | None
    record: list = field(default_factory=list)  # the messages (or, raw, the tokens) the cache was filled from
    state: SessionState | None = None  # None while it is the conversation in the engine
    used: float = field(default_factory=time.monotonic)
    # A raw completion's cache (its record is tokens), which no chat request may continue, whatever it sends.
    raw: bool = False
    extras: str = ""  # what the template was given besides the messages (tools, thinking), as JSON


@dataclass(frozen=True)
class Reuse:
    """How a request used what was cached: "extend" (all of it), "rewind" (up to where it diverged),
    "rebuild" (nothing: it diverged before what the cache still holds) or "new" (a conversation not kept)."""
    kind: str
    messages: int  # leading messages (raw: tokens) shared with the conversation continued


class ConversationPool:
    def __init__(self, session: ChatSession, size: int = 4) -> None:
        self.session = session
        self.size = max(1, size)
        self.kept: list[Kept] = []
        self.active: Kept | None = None
        self.last: TurnResult | None = None  # the latest reply, however it ended (for /health and tests)

    def chat(self, system: str | None, history: list[dict], user: str | dict, settings: ChatSettings,
             emit: EventSink, shape: Callable[[list[dict]], list[dict]] | None = None,
             reply: Callable[[str], dict] | None = None) -> tuple[TurnResult, Reuse]:
        """Answers `user` (the user's text, or the last message: a tool's result) after `history` (the
        conversation before it, system prompt apart), all as the client sends them. `shape` turns messages
        into what the template is given, one for one (tool calls as text for a template without tools);
        `reply(text)` is the reply as the client will send it back (its calls parsed out)."""
        last = user if isinstance(user, dict) else {"role": "user", "content": user}
        shape = shape or (lambda messages: messages)
        extras = json.dumps(settings.template_extras or {}, sort_keys=True)
        shared, kept = max(((self._shared(k, history), k) for k in self.kept
                            if not k.raw and k.system == system and k.extras == extras),
                           key=lambda pair: (pair[0], pair[1].used), default=(0, None))
        if kept is not None and shared == len(kept.record):
            kind = "extend"
        elif kept is not None and (shared or system):
            # It diverges (an edit, a regenerated reply, another client with the same start): a copy goes on from
            # the shared part, the system prompt at least, and the original stays for whoever comes back to it.
            kept, kind = self._fork(kept, shared), "rewind"
        else:
            kept, shared, kind = self._add(Kept(system, extras=extras)), 0, "new"
        self._activate(kept)
        session = self.session
        session.settings = settings
        if kind == "new" or shared < session.dropped:
            kind = "rebuild" if kind != "new" else kind
            session.reset()
            result = session.answer(*shape([last]), emit, before=shape(history))
        else:
            session.rewind(shared)
            result = session.answer(*shape([last]), emit, before=shape(history[shared:]))
        # What the session holds, as the client will send it back: its reply in full (a client that was sent
        # less, say cut at a stop sequence, resends less, and that message alone is fed again).
        answer = reply(result.text) if reply else {"role": "assistant", "content": result.text}
        kept.record = [*history, last, answer]
        kept.used = time.monotonic()
        self.last = result
        return result, Reuse(kind, shared)

    def complete(self, ids: list[int], settings: ChatSettings, emit: EventSink) -> tuple[TurnResult, Reuse]:
        """A raw completion of the prompt `ids` (no chat template): the cached tokens it starts with are kept."""
        kept = next((k for k in self.kept if k.raw), None) or self._add(Kept(None, raw=True))
        self._activate(kept)
        session, engine = self.session, self.session.engine
        session.settings = settings
        session.stop_flag.clear()
        shared = min(common_prefix(kept.record, ids), len(ids) - 1)  # the last token is evaluated for its logits
        if shared > 0 and engine.truncate(shared):
            kind = "extend" if shared == len(kept.record) else "rewind"
        else:
            kind, shared = ("rebuild" if kept.record else "new"), 0
            session.reset()
        start = time.perf_counter()
        logits = session.feed(ids[shared:], emit)
        prefill_ms = (time.perf_counter() - start) * 1e3
        emit(Prefill(len(ids) - shared, round(prefill_ms, 2), engine.stats))
        if logits is None:
            kept.record = []
            return TurnResult("", 0, len(ids) - shared, prefill_ms, 0.0, "stopped"), Reuse(kind, shared)
        reply = decode_reply(engine, session.tokenizer, logits, settings, session.stop_flag, emit)
        emit(Done(reply.tokens, round(reply.ms, 2), round(reply.tokens / (reply.ms / 1e3), 2) if reply.ms else 0.0,
                  reply.stop_reason, engine.stats))
        kept.record = engine.mirror() if engine.evicted == 0 else []  # after an eviction the mirror is not a prefix
        kept.used = time.monotonic()
        self.last = TurnResult(reply.text, reply.tokens, len(ids) - shared, prefill_ms, reply.ms, reply.stop_reason)
        return self.last, Reuse(kind, shared)

    def park(self) -> None:
        """Keeps the conversation in the engine as a snapshot, because someone else is about to use the engine
        (the desktop app's window, between server requests): the next request restores it from there."""
        if self.active is not None:
            self.active.state = self.session.snapshot()
            self.active = None

    @staticmethod
    def _shared(kept: Kept, history: list[dict]) -> int:
        n = 0
        for a, b in zip(kept.record, history):
            if a != b:
                break
            n += 1
        return n

    def _add(self, kept: Kept) -> Kept:
        if len(self.kept) >= self.size:
            oldest = min(self.kept, key=lambda k: k.used)
            self.kept.remove(oldest)
            if oldest is self.active:
                self.active = None
        self.kept.append(kept)
        return kept

    def _fork(self, kept: Kept, shared: int) -> Kept:
        """A copy of `kept` holding its first `shared` messages' record, to go on from there (the states are
        values: two conversations may start from one snapshot)."""
        if kept is self.active:
            kept.state = self.session.snapshot()
            fork = self._add(Kept(kept.system, kept.record[:shared], raw=kept.raw, extras=kept.extras))
            self.active = fork  # the engine holds that very state already
            return fork
        return self._add(Kept(kept.system, kept.record[:shared], kept.state, raw=kept.raw, extras=kept.extras))

    def _activate(self, kept: Kept) -> None:
        if kept is self.active:
            return
        if self.active is not None:
            self.active.state = self.session.snapshot()
        if kept.state is not None:
            self.session.restore(kept.state)
            kept.state = None
        else:
            self.session.reset()
        self.active = kept

