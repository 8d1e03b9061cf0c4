"""A chat over a StreamingEngine: the template, the token-level turn bookkeeping and the generation loop.

The cache already holds every earlier turn, so a new turn feeds only what the template adds after it:
the tokens still owed from closing the last reply (e.g. ChatML's "\\n" after "<|im_end|>") and the new
user message with the generation prompt. The history is never re-tokenised.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import PromptTooLongError
from ..events import Context, Done, Event, Prefill, PrefillProgress, Token
from .runtime import StreamingEngine
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer, common_prefix, valid_text

EventSink = Callable[[Event], None]


@dataclass
class ChatSettings:
    system_prompt: str | None = None
    max_new_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    pin_system: bool = False  # the system prompt's tokens stay in the cache as sinks (StreamingEngine.pin)


@dataclass
class TurnResult:
    text: str
    tokens: int
    prefill_tokens: int
    prefill_ms: float
    decode_ms: float
    stop_reason: str  # "eos" | "length" | "stopped"


class ChatSession:
    def __init__(self, engine: StreamingEngine, tokenizer: Tokenizer, settings: ChatSettings | None = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.settings = settings or ChatSettings()
        self.messages: list[dict] = []
        self.spans: list[tuple[int, int]] = []  # each message's [start, end) positions in the token stream
        self.dropped = 0  # leading messages let go since the last reset/resume, to fit a rebuild in the window
        self._owed: list[int] = []  # template tokens that close the last turn, fed with the next one
        self._partial = False  # a prefill was stopped part-way: the cache does not hold the last message whole
        self.stop_flag = threading.Event()

    # --- conversation state --------------------------------------------------------------------------------

    def reset(self, messages: list[dict] | None = None) -> None:
        """Starts over (the cache is cleared); `messages` becomes the history to resume from."""
        self.engine.reset()
        self.messages = list(messages or [])
        self.spans = []
        self.dropped = 0
        self._owed = []
        self._partial = False

    def resume(self, messages: list[dict], ids: list[int] | None = None,
               on_event: EventSink | None = None) -> Prefill:
        """Starts over from `messages` (a stored chat's recent part, system message first if any): the cache is
        cleared and refilled with their rendering (`ids` when the caller has it), the system prompt pinned when
        that is set. Returns the prefill event; a context event follows it. Nothing changes if it is refused
        (PromptTooLongError)."""
        messages = list(messages)
        if ids is None:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=False) if messages else []
        pinned = self._pinned_tokens(messages, ids)
        spans = self._rendered_spans(messages) if ids else []
        self.reset(messages)
        self.engine.pin(pinned)
        start = time.perf_counter()
        if ids:
            self.engine.prefill(ids)
        ms = (time.perf_counter() - start) * 1e3
        self.spans = spans
        event = Prefill(len(ids), round(ms, 2), self.engine.stats)
        if on_event:
            on_event(event)
            on_event(self.context())
        return event

    def context(self) -> Context:
        """Where each message sits, and which have left the window: every one of their tokens past the sinks
        evicted (a message wholly inside the sinks, such as a pinned system prompt, never leaves)."""
        stats = self.engine.stats
        horizon = stats.sinks + stats.evicted
        gone = tuple(i for i, (start, end) in enumerate(self.spans)
                     if stats.evicted and stats.sinks < end <= horizon)
        return Context(tuple(self.spans), gone, self.dropped)

    def _fit(self, history: list[dict], user: dict, pinned: int) -> tuple[list[dict], list[int], int]:
        """The most recent part of `history` that fits the window with `user` after it, starting at a user
        message, the system message kept: (messages, their ids with `user`'s turn, messages dropped). A binary
        search over where to start: each try renders the chat once. The new message alone may still not fit."""
        head = 1 if history and history[0].get("role") == "system" else 0
        starts = [i for i in range(head, len(history)) if history[i].get("role") == "user"] + [len(history)]

        def render(i: int) -> list[int]:
            return self.tokenizer.encode_chat([*history[:head], *history[i:], user], add_generation_prompt=True)

        room = self.engine.settings.window + pinned
        lo, hi = 0, len(starts) - 1  # the earliest start that fits lies in starts[lo..hi]
        best = render(starts[hi])
        while lo < hi:
            mid = (lo + hi) // 2
            ids = render(starts[mid])
            if len(ids) <= room:
                hi, best = mid, ids
            else:
                lo = mid + 1
        return [*history[:head], *history[starts[hi]:]], best, starts[hi] - head

    def _rendered_spans(self, messages: list[dict]) -> list[tuple[int, int]]:
        """Each message's span in a fresh rendering of `messages`: from the end of the chat rendered before it
        to the end of the one including it. A rebuild's cost: it renders every prefix once."""
        spans, begin = [], 0
        for j in range(len(messages)):
            end = max(begin, len(self.tokenizer.encode_chat(messages[: j + 1], add_generation_prompt=False)))
            spans.append((begin, end))
            begin = end
        return spans

    def _opening(self) -> list[dict]:
        system = self.settings.system_prompt
        return [{"role": "system", "content": valid_text(system)}] if system else []

    def _turn_tokens(self, history: list[dict], user_text: str) -> tuple[list[int], bool]:
        """The ids this turn feeds, and whether the cache must be cleared first (nothing is changed here)."""
        user = {"role": "user", "content": user_text}
        if self._partial:  # what the cache holds is not a rendering of the history: start again
            return self.tokenizer.encode_chat([*history, user], add_generation_prompt=True), True
        if self.engine.position == 0:
            # A fresh cache (or one rebuilt for a restored chat): render everything so far.
            return self.tokenizer.encode_chat([*history, user], add_generation_prompt=True), False
        delta = self.tokenizer.chat_delta(history, [user], add_generation_prompt=True)
        if delta is None:  # a template whose earlier turns change as the chat grows: rebuild from scratch
            return self.tokenizer.encode_chat([*history, user], add_generation_prompt=True), True
        return self._owed + delta, False

    def _pinned_tokens(self, history: list[dict], ids: list[int]) -> int:
        """How many of a fresh cache's first tokens hold the system prompt, when it is to be pinned: the tokens
        every first turn shares (probed with two different user messages, so a template that writes the system
        prompt inside the first user turn pins just its part), as far as this turn's tokens agree."""
        if not (self.settings.pin_system and history and history[0].get("role") == "system"):
            return 0
        probes = [self.tokenizer.encode_chat([history[0], {"role": "user", "content": text}], add_generation_prompt=True)
                  for text in ("A", "B")]
        n = min(common_prefix(probes[0], probes[1]), common_prefix(probes[0], ids))
        bound = self.engine.settings.sink_slots
        if n > bound:
            raise PromptTooLongError(f"the system prompt takes {n} tokens but the cache pins at most {bound}; "
                                     f"shorten it or rebuild with --max-sinks {n} or more")
        return n

    # --- one turn ------------------------------------------------------------------------------------------

    def send(self, user_text: str, on_event: EventSink | None = None) -> TurnResult:
        """Answers one user turn, streaming events; returns when the reply ends or the stop flag is set."""
        emit = on_event or (lambda event: None)
        user_text = valid_text(user_text)  # what is fed is what is kept in the history (and saved)
        self.stop_flag.clear()
        history = self.messages or self._opening()
        ids, rebuild = self._turn_tokens(history, user_text)
        # A refusal (a pinned system prompt past the sink bound) comes before anything changes.
        fresh = rebuild or self.engine.position == 0
        pinned = self._pinned_tokens(history, ids) if fresh else 0  # a pinned prompt goes to the sinks
        room = self.engine.settings.window
        dropped = 0
        if fresh and len(ids) - pinned > room:
            # A rebuild keeps what fits: the most recent messages (older ones would be evicted again at once).
            history, ids, dropped = self._fit(history, {"role": "user", "content": user_text}, pinned)
        # A message longer than the window still goes in: it streams through (StreamingLLM evicts as it goes)
        # and the reply sees its sinks and its most recent `window` tokens.
        if fresh and self.engine.position:
            self.engine.reset()
        if fresh:
            self._owed = []
            self.engine.pin(pinned)
            self.dropped += dropped
            self.spans = self._rendered_spans(history) if history else []  # everything before is rendered anew
        self.messages = history
        begin = self.spans[-1][1] if fresh and self.spans else self.engine.position
        self._partial = False
        start = time.perf_counter()
        logits = self._prefill(ids, emit)
        prefill_ms = (time.perf_counter() - start) * 1e3
        self.messages.append({"role": "user", "content": user_text})
        self.spans.append((begin, self.engine.position))
        self._owed = []
        emit(Prefill(self.engine.position - begin if logits is None else len(ids), round(prefill_ms, 2),
                     self.engine.stats))
        emit(self.context())
        if logits is None:  # stopped while the message streamed in: no reply, and the next turn rebuilds
            self._partial = True
            self.messages.append({"role": "assistant", "content": ""})
            self.spans.append((self.engine.position, self.engine.position))
            emit(Done(0, 0.0, 0.0, "stopped", self.engine.stats))
            emit(self.context())
            return TurnResult("", 0, self.engine.position - begin, prefill_ms, 0.0, "stopped")

        sampler = Sampler(self.settings.sampling)
        recent: deque[int] = deque(maxlen=max(1, self.settings.sampling.repeat_last_n))
        decoder = self.tokenizer.detokenizer()
        pieces: list[str] = []
        generated, reason = 0, "length"
        start = time.perf_counter()
        while generated < self.settings.max_new_tokens:
            if self.stop_flag.is_set():
                reason = "stopped"
                break
            token = sampler.sample(logits, recent)
            if token in self.tokenizer.stop_ids:
                reason = "eos"
                break
            generated += 1
            recent.append(token)
            text = decoder.push(token)
            if text:
                pieces.append(text)
                emit(Token(text))
            logits = self.engine.decode(token)
        tail = decoder.flush()
        if tail:
            pieces.append(tail)
            emit(Token(tail))
        decode_ms = (time.perf_counter() - start) * 1e3
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        self.spans.append((self.spans[-1][1], self.engine.position))
        # The stop token itself was never fed; the template's closing text (which starts with it) is owed.
        suffix = self.tokenizer.turn_suffix(self.messages[:-1])
        self._owed = self.tokenizer.encode_template(suffix) if suffix else ([token] if reason == "eos" else [])
        tok_s = generated / (decode_ms / 1e3) if decode_ms > 0 else 0.0
        emit(Done(generated, round(decode_ms, 2), round(tok_s, 2), reason, self.engine.stats))
        emit(self.context())
        return TurnResult(reply, generated, len(ids), prefill_ms, decode_ms, reason)

    def _prefill(self, ids: list[int], emit: EventSink) -> np.ndarray | None:
        """Feeds a turn's tokens; the logits after the last, or None if the stop flag ended it part-way. A turn
        longer than the window goes in chunk by chunk, with a progress event and a look at the stop flag after
        each: reading a long document can take minutes, and the user may change their mind."""
        if len(ids) <= self.engine.settings.window:
            return self.engine.prefill(ids)
        step = self.engine.chunk
        logits = None
        for done in range(0, len(ids), step):
            if self.stop_flag.is_set():
                return None
            logits = self.engine.prefill(ids[done : done + step])
            emit(PrefillProgress(min(done + step, len(ids)), len(ids), self.engine.stats))
        return logits

    def stop(self) -> None:
        """Thread-safe: the generation loop sees it before its next token."""
        self.stop_flag.set()
