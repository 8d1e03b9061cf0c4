"""A chat over a StreamingEngine: the template, the token-level turn bookkeeping and the generation loop.

The session owns the conversation that is in the cache: `resume` puts a stored chat back (the recent part
that fits), `answer`, `regenerate` and `edit_last` go on from there, and after every prefill and reply a
context event says where each message sits and which have left the window. Callers keep no cache arithmetic.

The cache already holds every earlier turn, so a new turn feeds only what the template adds after it:
the tokens still owed from closing the last reply (e.g. ChatML's "\\n" after "<|im_end|>") and the new
user message with the generation prompt. The history is never re-tokenised.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import EddyError, PromptTooLongError
from ..events import Context, DecodeProgress, Done, Event, Prefill, PrefillProgress, Reasoning, Token
from .chat_settings import ChatSettings
from .constraint import Constraint
from .reasoning import ThinkSplitter
from .runtime import CacheSnapshot, StreamingEngine
from .sampling import Sampler
from .tokenizer import Tokenizer, common_prefix, valid_text

EventSink = Callable[[Event], None]

# How often a reply in progress reports its speed (DecodeProgress): often enough for a live figure.
RATE_EVERY_S = 0.1


@dataclass(frozen=True)
class SessionState:
    """A ChatSession's whole state (ChatSession.snapshot): the cache and the record of what is in it."""
    cache: CacheSnapshot
    messages: list[dict]
    spans: list[tuple[int, int]]
    dropped: int
    owed: list[int]
    stale: bool


@dataclass
class TurnResult:
    text: str
    tokens: int
    prefill_tokens: int
    prefill_ms: float
    decode_ms: float
    stop_reason: str  # "eos" | "length" | "stopped"
    reasoning: str = ""  # the thinking before the answer, when the model wrote any (text is the answer alone)


def _ignore(_event: Event) -> None:
    pass


class ChatSession:
    def __init__(self, engine: StreamingEngine, tokenizer: Tokenizer, settings: ChatSettings | None = None) -> None:
        self.engine, self._tokenizer = engine, tokenizer
        self._variant: tuple[dict | None, Tokenizer] | None = None  # (the extras, the tokenizer rendering with them)
        self.settings = settings or ChatSettings()
        # What the cache was filled from: the system message (if any), then the conversation from `dropped` on.
        self.messages: list[dict] = []
        self.spans: list[tuple[int, int]] = []  # each message's [start, end) positions in the token stream
        self.dropped = 0  # leading conversation messages left out of the cache: a rebuild kept those that fit
        self._owed: list[int] = []  # template tokens that close the last turn, fed with the next one
        # The cache does not hold a rendering of `messages` (a prefill stopped part-way, a turn that failed, a
        # rewind past what the cache still has): the next turn rebuilds it.
        self._stale = False
        self.stop_flag = threading.Event()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, rendering the template with this chat's extras (tools, thinking on or off)."""
        extras = self.settings.template_extras
        # A turn asks a few dozen times; the variant's key is the extras' JSON (tools may be kilobytes of it).
        if self._variant is None or self._variant[0] is not extras:
            self._variant = (extras, self._tokenizer.with_extras(extras))
        return self._variant[1]

    def count_tokens(self, text: str) -> int:
        """How many tokens `text` is as a message's content (a draft's count)."""
        return len(self._tokenizer.encode_text(text))

    @property
    def model_tokenizer(self) -> Tokenizer:
        """The model's tokenizer as loaded, whatever this chat's extras: safe to read from any thread."""
        return self._tokenizer

    # --- the conversation ----------------------------------------------------------------------------------

    def reset(self) -> None:
        """Starts a new, empty conversation (the cache is cleared)."""
        self.engine.reset()
        self.messages, self.spans, self._owed = [], [], []
        self.dropped = 0
        self._stale = False

    def resume(self, history: list[dict], on_event: EventSink | None = None) -> Prefill:
        """Starts over from a stored chat: `history` is its conversation (user and assistant messages; the
        system prompt comes from the settings). The cache is cleared and filled with the most recent messages
        that fit the window, from a user message on, the system prompt first (pinned when that is set); a
        prefill event and a context event follow. Refused (PromptTooLongError) before anything changes."""
        emit = on_event or _ignore
        self.stop_flag.clear()
        conversation = [message_for_template(m) for m in history]
        chat = [*self._opening(), *conversation]
        probe = self._pin_probe(chat)
        messages, ids, dropped = self._fit(chat, None, len(probe)) if chat else ([], [], 0)
        pinned = self._pinned(probe, ids)
        self.reset()
        self.engine.pin(pinned)
        self.messages, self.dropped = messages, dropped
        self.spans = self._rendered_spans(messages) if ids else []
        return self._feed_reported(ids, emit, whole_cache=True)

    def follow(self, history: list[dict], on_event: EventSink | None = None) -> Prefill:
        """Goes over to another branch of the conversation (`history`, as resume takes it). When the conversation
        in the cache begins with the same messages up to a user message of `history`, and the cache still holds
        them, it goes back there and prefills only the rest (messages already left out of the cache stay out);
        otherwise this is resume(history). A prefill and a context event follow, as after resume."""
        emit = on_event or _ignore
        conversation = [message_for_template(m) for m in history]
        kept = self.conversation
        shared = self.dropped
        while (shared - self.dropped < len(kept) and shared < len(conversation)
               and kept[shared - self.dropped] == conversation[shared]):
            shared += 1

        def starts_a_turn(i: int) -> bool:
            # Cut only where a user message begins (or a conversation ends) on both sides: the cache then ends
            # after a closed turn, as a full render of the shared messages does, which chat_delta continues from.
            # (Right after a user message it also holds the generation prompt that was fed with it.)
            mine = i - self.dropped
            return ((mine >= len(kept) or kept[mine]["role"] == "user")
                    and (i >= len(conversation) or conversation[i]["role"] == "user"))

        while shared > self.dropped and not starts_a_turn(shared):
            shared -= 1
        if self._stale or shared <= self.dropped or not self._same_opening():
            return self.resume(history, on_event)
        self.stop_flag.clear()
        self.rewind(shared)
        rest = conversation[shared:]
        delta = self.tokenizer.chat_delta(self.messages, rest, add_generation_prompt=False) if rest else []
        ids = [*self._owed, *delta] if delta is not None else None
        if self._stale or ids is None or self.engine.position + len(ids) > self.engine.capacity:
            return self.resume(history, on_event)  # evicted since, or the rest would evict: a rebuild fits it
        if self._owed and self.spans:  # the tokens that close the last reply belong to it
            first, end = self.spans[-1]
            self.spans[-1] = (first, end + len(self._owed))
        begin = self.engine.position + len(self._owed)
        for j in range(len(rest)):  # each message's own span, from the template's deltas
            part = self.tokenizer.chat_delta(self.messages, rest[: j + 1], add_generation_prompt=False) or []
            end = max(begin, self.engine.position + len(self._owed) + len(part))
            self.spans.append((begin, end))
            begin = end
        self.messages, self._owed = [*self.messages, *rest], []
        return self._feed_reported(ids, emit)

    def _feed_reported(self, ids: list[int], emit: EventSink, whole_cache: bool = False) -> Prefill:
        """Feeds a rebuild's or a branch's tokens, then reports them: a Prefill of the tokens fed (a rebuild's, with
        `whole_cache`: of everything the cache then holds) and the context. A stop or failure part-way marks the cache
        stale, so the next turn starts again."""
        start = time.perf_counter()
        try:
            if ids and self.feed(ids, emit) is None:
                self._stale = True
        except BaseException:
            self._stale = True
            raise
        event = Prefill(self.engine.position if whole_cache else len(ids), round((time.perf_counter() - start) * 1e3, 2),
                        self.engine.stats)
        emit(event)
        emit(self.context())
        return event

    def _same_opening(self) -> bool:
        """Whether the cache begins as the settings now want: the same system prompt, pinned or not alike."""
        opening = self._opening()
        if self.messages[: self._head()] != opening:
            return False
        return (self.engine.pinned > 0) == bool(self._pin_probe(opening))

    def context(self) -> Context:
        """Where each message sits, and which have left the window: every one of their tokens past the sinks
        evicted (a message wholly inside the sinks, such as a pinned system prompt, never leaves)."""
        stats = self.engine.stats
        horizon = stats.sinks + stats.evicted
        head = self._head()
        spans = tuple(self.spans[head:])
        left = tuple(self.dropped + i for i, (_, end) in enumerate(spans)
                     if stats.evicted and stats.sinks < end <= horizon)
        cut = next((self.dropped + i for i, (begin, end) in enumerate(spans)
                    if stats.evicted and begin < horizon < end), -1)
        system = self.spans[0] if head and self.spans else (0, 0)
        return Context(self.dropped, spans, left, cut, tuple(system), stats)

    def _head(self) -> int:
        return 1 if self.messages and self.messages[0].get("role") == "system" else 0

    def _fit(self, chat: list[dict], user: dict | None, pinned: int) -> tuple[list[dict], list[int], int]:
        """The most recent part of `chat` that fits the window (with `user`'s turn after it, if given),
        starting at a user message, the system message kept: (messages, their ids, messages dropped). A binary
        search over where to start: each try renders the chat once. When not even the last user message fits,
        it is kept anyway and streams through the window."""
        head = 1 if chat and chat[0].get("role") == "system" else 0
        starts = [i for i in range(head, len(chat)) if chat[i].get("role") == "user"]
        if user is not None or not starts:
            starts.append(len(chat))
        tail = [user] if user is not None else []

        def render(i: int) -> list[int]:
            return self.tokenizer.encode_chat([*chat[:head], *chat[i:], *tail], add_generation_prompt=user is not None)

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
        return [*chat[:head], *chat[starts[hi]:]], best, starts[hi] - head

    def _rendered_spans(self, messages: list[dict]) -> list[tuple[int, int]]:
        """Each message's span in a fresh rendering of `messages`: from the end of the chat rendered before it
        to the end of the one including it. It renders every prefix once, but only of what fits the window."""
        spans, begin = [], 0
        for j in range(len(messages)):
            end = max(begin, len(self.tokenizer.encode_chat(messages[: j + 1], add_generation_prompt=False)))
            spans.append((begin, end))
            begin = end
        return spans

    def _opening(self) -> list[dict]:
        system = self.settings.system_prompt
        return [{"role": "system", "content": valid_text(system)}] if system else []

    def _reusable(self, ids: list[int], pinned: int) -> int:
        """How many of a rebuild's first tokens the cache holds already, left there (0: none, start afresh). A
        template that renders an earlier turn anew as the chat grows (Qwen3's drops the last reply's thinking)
        then costs only the tokens from the first that changed, not the whole chat."""
        engine = self.engine
        if self._stale or not engine.position or engine.evicted or engine.pinned != pinned:
            return 0
        keep = min(common_prefix(engine.mirror(), ids), len(ids) - 1)
        if keep <= pinned or not engine.truncate(keep):
            return 0
        return keep

    def _turn_tokens(self, history: list[dict], new: list[dict]) -> tuple[list[int], bool]:
        """The ids this turn feeds (the `new` messages, the user's last), and whether they start a fresh cache
        (nothing is changed here)."""
        if self._stale or self.engine.position == 0:
            return self.tokenizer.encode_chat([*history, *new], add_generation_prompt=True), True
        delta = self.tokenizer.chat_delta(history, new, add_generation_prompt=True)
        if delta is None:  # a template whose earlier turns change as the chat grows: rebuild from scratch
            return self.tokenizer.encode_chat([*history, *new], add_generation_prompt=True), True
        return self._owed + delta, False

    def _pin_probe(self, chat: list[dict]) -> list[int]:
        """The tokens every first turn of `chat` begins with, when its system prompt is to be pinned ([] when
        not): probed with two different user messages, so a template that writes the system prompt inside the
        first user turn pins just its part."""
        if not (self.settings.pin_system and chat and chat[0].get("role") == "system"):
            return []
        probes = [self.tokenizer.encode_chat([chat[0], {"role": "user", "content": text}], add_generation_prompt=True)
                  for text in ("A", "B")]
        return probes[0][: common_prefix(probes[0], probes[1])]

    def _pinned(self, probe: list[int], ids: list[int]) -> int:
        """How many of a fresh cache's first tokens (`ids`) hold the pinned system prompt."""
        n = common_prefix(probe, ids)
        bound = self.engine.settings.sink_slots
        if n > bound:
            raise PromptTooLongError(f"the system prompt takes {n} tokens but the cache pins at most {bound}; "
                                     f"shorten it or rebuild with --max-sinks {n} or more")
        return n

    # --- turns ---------------------------------------------------------------------------------------------

    def answer(self, message: str | dict, on_event: EventSink | None = None, before: Sequence[dict] = ()) -> TurnResult:
        """Answers one turn, streaming events; returns when the reply ends or the stop flag is set. `message` is
        the user's text, or a whole message (a tool's result: {"role": "tool", "content", "tool_call_id"}).
        `before`: messages to add to the conversation first, fed with the turn (say, a client's own version of
        the last reply)."""
        # What is fed is what is kept in the history (and saved).
        last = message_for_template(message if isinstance(message, dict) else {"role": "user", "content": message})
        before = [message_for_template(m) for m in before]
        self.stop_flag.clear()
        kept = (list(self.messages), list(self.spans), self.dropped, list(self._owed), self._stale)
        try:
            return self._answer(last, on_event or _ignore, before)
        except PromptTooLongError:
            raise  # refused before anything changed
        except BaseException:
            # Half a turn may be in the cache: the conversation stays as it was and the next turn rebuilds it.
            self.messages, self.spans, self.dropped, self._owed, _ = kept
            self._stale = True
            raise

    def regenerate(self, on_event: EventSink | None = None) -> TurnResult:
        """Answers the last user message again, in place of its reply."""
        m = self.messages
        if len(m) - self._head() < 2 or m[-1]["role"] != "assistant" or m[-2]["role"] != "user":
            raise EddyError("there is no reply to regenerate")
        return self._redo(len(m) - 2, m[-2]["content"], on_event)

    def edit_last(self, text: str, on_event: EventSink | None = None) -> TurnResult:
        """Replaces the last user message, and everything after it, with `text`, and answers it."""
        last = next((i for i in range(len(self.messages) - 1, self._head() - 1, -1)
                     if self.messages[i]["role"] == "user"), None)
        if last is None:
            raise EddyError("there is no message to edit")
        return self._redo(last, text, on_event)

    def _redo(self, i: int, text: str, on_event: EventSink | None) -> TurnResult:
        """Forgets messages[i:] and answers `text` in their place."""
        self.rewind(self.dropped + i - self._head())
        return self.answer(text, on_event)

    @property
    def conversation(self) -> list[dict]:
        """The conversation's messages the cache was filled from: those from `dropped` on, system prompt apart."""
        return self.messages[self._head():]

    def rewind(self, n: int) -> None:
        """Keeps the conversation's first n messages (numbered as the conversation, n >= dropped) and forgets
        the rest. The cache goes back to where message n began when nothing it held since has left it (the kept
        turns are not fed again); otherwise the next turn rebuilds from the messages kept."""
        if n < self.dropped:
            raise ValueError(f"message {n} is not in the cache (it begins at message {self.dropped}): resume instead")
        i = n - self.dropped + self._head()
        if i >= len(self.messages):
            return
        start = self.spans[i][0]
        self.messages, self.spans, self._owed = self.messages[:i], self.spans[:i], []
        if self._stale or start < self.engine.pinned or not self.engine.truncate(start):
            self._stale = True

    def snapshot(self) -> "SessionState":
        """The whole conversation state, the cache's included, to switch conversations without a prefill."""
        return SessionState(self.engine.snapshot(), list(self.messages), list(self.spans), self.dropped,
                            list(self._owed), self._stale)

    def restore(self, state: "SessionState") -> None:
        self.engine.restore(state.cache)
        self.messages, self.spans, self._owed = list(state.messages), list(state.spans), list(state.owed)
        self.dropped, self._stale = state.dropped, state.stale

    def _answer(self, user: dict, emit: EventSink, before: list[dict]) -> TurnResult:
        history = list(self.messages or self._opening())
        ids, fresh = self._turn_tokens(history, [*before, user])
        if fresh:
            history += before
            # A refusal (a pinned system prompt past the sink bound) comes before anything changes.
            probe = self._pin_probe(history)
            pinned = self._pinned(probe, ids)
            dropped = 0
            if len(ids) - pinned > self.engine.settings.window:
                # A rebuild keeps what fits: the most recent messages (older ones would be evicted again at once).
                history, ids, dropped = self._fit(history, user, len(probe))
                pinned = self._pinned(probe, ids)
            # A message longer than the window still goes in: it streams through (StreamingLLM evicts as it goes)
            # and the reply sees its sinks and its most recent `window` tokens.
            keep = self._reusable(ids, pinned)
            if keep:
                ids = ids[keep:]
            else:
                if self.engine.position:
                    self.engine.reset()
                self.engine.pin(pinned)
            self.dropped += dropped
            self.spans = self._rendered_spans(history) if history else []  # everything before is rendered anew
            begin = self.spans[-1][1] if self.spans else 0
        else:
            if self._owed and self.spans:  # the tokens that close the last reply belong to it
                first, end = self.spans[-1]
                self.spans[-1] = (first, end + len(self._owed))
            begin = self.engine.position + len(self._owed)
            for j, message in enumerate(before):  # each added message's own span, from the template's deltas
                delta = self.tokenizer.chat_delta(history, before[: j + 1], add_generation_prompt=False)
                end = max(begin, self.engine.position + len(self._owed) + len(delta or []))
                self.spans.append((begin, end))
                begin = end
            history += before
        self.messages, self._owed, self._stale = history, [], False
        fed_from = self.engine.position
        start = time.perf_counter()
        logits = self.feed(ids, emit)
        prefill_ms = (time.perf_counter() - start) * 1e3
        self.messages.append(user)
        self.spans.append((begin, self.engine.position))
        prefilled = self.engine.position - fed_from
        emit(Prefill(prefilled, round(prefill_ms, 2), self.engine.stats))
        emit(self.context())
        if logits is None:  # stopped while the message streamed in: no reply, and the next turn rebuilds
            self._stale = True
            self.messages.append({"role": "assistant", "content": ""})
            self.spans.append((self.engine.position, self.engine.position))
            emit(self.context())
            emit(Done(0, 0.0, 0.0, "stopped", self.engine.stats))
            return TurnResult("", 0, prefilled, prefill_ms, 0.0, "stopped")

        reply = decode_reply(self.engine, self.tokenizer, logits, self.settings, self.stop_flag, emit)
        generated, reason, decode_ms = reply.tokens, reply.stop_reason, reply.ms
        # Kept as generated, thinking included: that is what the cache holds. A template that drops an earlier
        # turn's thinking makes the next turn's render differ from here on, and only the rest is fed again.
        self.messages.append({"role": "assistant", "content": reply.text})
        self.spans.append((self.spans[-1][1], self.engine.position))
        # The stop token itself was never fed; the template's closing text (which starts with it) is owed.
        suffix = self.tokenizer.turn_suffix(self.messages[:-1])
        self._owed = self.tokenizer.encode_template(suffix) if suffix else (
            [reply.last_token] if reason == "eos" else [])
        tok_s = generated / (decode_ms / 1e3) if decode_ms > 0 else 0.0
        emit(self.context())  # before done, which ends the turn for whoever listens
        emit(Done(generated, round(decode_ms, 2), round(tok_s, 2), reason, self.engine.stats))
        return TurnResult(reply.answer, generated, prefilled, prefill_ms, decode_ms, reason, reply.reasoning)

    def feed(self, ids: list[int], emit: EventSink) -> np.ndarray | None:
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


@dataclass
class Reply:
    text: str  # as generated: what the cache holds
    tokens: int
    stop_reason: str  # "eos" | "length" | "stopped"
    ms: float
    last_token: int  # the token that ended it (the stop token when "eos"; -1 if none was sampled)
    answer: str = ""  # the text without its thinking
    reasoning: str = ""


def decode_reply(engine: StreamingEngine, tokenizer: Tokenizer, logits: np.ndarray, settings: ChatSettings,
                 stop_flag: threading.Event, emit: EventSink) -> Reply:
    """Samples a reply token by token from `logits` (the prompt's last), feeding each token back, until a stop
    token, the token limit or the stop flag; Token events as text arrives (Reasoning ones for thinking),
    DecodeProgress a few times a second. A grammar in the settings holds every token to it."""
    sampler = Sampler(settings.sampling)
    constraint: Constraint | None = tokenizer.grammars.follow(settings.grammar) if settings.grammar else None
    splitter = ThinkSplitter(tokenizer.opens_thinking) if settings.split_thinking else None
    recent: deque[int] = deque(maxlen=max(1, settings.sampling.repeat_last_n))
    decoder = tokenizer.detokenizer()
    pieces: list[str] = []

    def show(text: str, end: bool = False) -> None:
        if text:
            pieces.append(text)
        if splitter is None:
            if text:
                emit(Token(text))
            return
        for kind, part in [*splitter.push(text), *(splitter.flush() if end else [])]:
            emit(Reasoning(part) if kind == "reasoning" else Token(part))

    generated, reason, token = 0, "length", -1
    start = reported = time.perf_counter()
    while generated < settings.max_new_tokens:
        if stop_flag.is_set():
            reason = "stopped"
            break
        token = sampler.sample(logits, recent)
        if constraint is not None:
            constraint.compute()
            if not constraint.allows(token):
                token = sampler.sample(constraint.mask(logits), recent)
        if token in tokenizer.stop_ids:
            reason = "eos"
            break
        if constraint is not None:
            constraint.accept(token)
        generated += 1
        recent.append(token)
        text = decoder.push(token)
        if text:
            show(text)
        logits = engine.decode(token)
        now = time.perf_counter()
        if now - reported >= RATE_EVERY_S:
            reported = now
            emit(DecodeProgress(generated, round(generated / (now - start), 2)))
    show(decoder.flush(), end=True)
    raw = "".join(pieces)
    answer, reasoning = (("".join(splitter.content), "".join(splitter.reasoning)) if splitter else (raw, ""))
    return Reply(raw, generated, reason, (time.perf_counter() - start) * 1e3, token, answer, reasoning)


_TEMPLATE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def message_for_template(m: dict) -> dict:
    """A message as the session keeps and renders it: its role, its content as valid text (None stays None: an
    assistant message that only calls tools), and the keys templates read for tools and thinking."""
    content = m.get("content")
    out = {"role": m["role"], "content": valid_text(content) if isinstance(content, str) else content}
    if out["content"] is None and not m.get("tool_calls"):
        out["content"] = ""
    out.update((k, m[k]) for k in _TEMPLATE_KEYS if m.get(k) is not None)
    return out
