"""A model on another machine: any OpenAI-compatible server (vLLM, llama.cpp's server, Ollama, `eddy serve`, a
cluster behind one endpoint), chatted with as the local engine is.

`--model http://host:port/v1` opens a RemoteModel; its RemoteSession answers, regenerates, edits and switches
branches as ChatSession does and emits the same events, so `eddy chat` and the window need no second path. What
the server reports is passed on (llama.cpp's `timings`, `usage`); what it cannot say (a cache Eddy does not hold)
is reported as such: sinks 0, nothing reused.

The server's context is finite, so the history is fitted to it before every request: the system prompt and the
newest messages that fit, the rest left out, exactly as the local engine's window leaves messages behind, and the
Context event says which (the window's marker shows it). Tokens are counted by the server's own tokenizer where
it tells (each reply's usage calibrates a characters-per-token estimate), so a long chat never meets a "context
length exceeded" error; if one comes anyway, the request is sent again with half the room.

HTTP is the standard library's http.client: streaming server-sent events take a few dozen lines, and the run side
gains no dependency for it. No torch, no Qt.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from .errors import EddyError, ModelError, PromptTooLongError
from .events import CacheStats, Context, Done, Event, Prefill, Reasoning, Token
from .run.generation import ChatDefaults
from .run.reasoning import ThinkSplitter
from .run.session import ChatSettings, TurnResult, message_for_template

EventSink = Callable[[Event], None]
API_KEY_ENV = "EDDY_API_KEY"
DEFAULT_CONTEXT = 4096  # when the server does not say
CHARS_PER_TOKEN = 3.5  # before the first reply's usage tells the server's own ratio
# Tokens of headroom (at most a sixteenth of the context): the template's text around each message is estimated.
MARGIN = 32
_URL = re.compile(r"^https?://", re.I)


def is_remote(spec: str | None) -> bool:
    return bool(spec) and bool(_URL.match(spec.strip()))


class RemoteError(EddyError):
    """The server could not be reached, refused the request, or answered with something that is not the API."""


@dataclass(frozen=True)
class Endpoint:
    base: str  # ".../v1"
    api_key: str | None
    timeout: float = 600.0

    def request(self, method: str, path: str, body: dict | None = None,
                stop: threading.Event | None = None) -> http.client.HTTPResponse:
        parts = urlsplit(self.base + path)
        conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = conn_type(parts.hostname, parts.port, timeout=self.timeout)
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                         body=json.dumps(body) if body is not None else None, headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise RemoteError(f"cannot reach {self.base}: {_reason(e)}") from None
        if stop is not None:
            # A stop while the reply streams closes the socket: the read in progress ends at once.
            watcher = threading.Thread(target=_close_on, args=(stop, conn, response), daemon=True)
            watcher.start()
        return response

    def json(self, method: str, path: str, body: dict | None = None) -> Any:
        response = self.request(method, path, body)
        data = response.read()
        if response.status >= 400:
            raise RemoteError(_api_error(self.base, response.status, data))
        try:
            return json.loads(data)
        except ValueError:
            raise RemoteError(f"{self.base}{path} did not answer with JSON: is this an OpenAI-compatible server?") from None


def _close_on(stop: threading.Event, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
    # Only the socket is shut here: its read in the other thread then ends (EOF), and that thread closes the
    # response itself (http.client's objects are not for two threads).
    sock = conn.sock
    while not response.isclosed():
        if stop.wait(0.05):
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "the connection was refused (is the server running?)"
    if isinstance(e, socket.timeout):
        return "it did not answer in time"
    if isinstance(e, socket.gaierror):
        return "the host name does not resolve"
    return str(e) or type(e).__name__


def _api_error(base: str, status: int, data: bytes) -> str:
    try:
        err = json.loads(data)
        message = err.get("error", err)
        message = message.get("message", message) if isinstance(message, dict) else message
    except ValueError:
        message = data[:300].decode(errors="replace")
    if status == 401:
        return f"{base} refused the API key (set it in Settings, --api-key or ${API_KEY_ENV}): {message}"
    return f"{base} answered {status}: {message}"


@dataclass(frozen=True)
class RemoteSource:
    """What the status bar and the chat call a remote model."""
    name: str
    url: str


@dataclass(frozen=True)
class RemoteInfo:
    """The server's model: its id and its context, as far as the server says."""
    model: str
    context: int
    context_known: bool


def open_remote(url: str, api_key: str | None = None, context: int | None = None) -> "RemoteModel":
    """Connects to an OpenAI-compatible server at `url` (its /v1 base; a trailing /chat/completions is cut) and
    asks its model and context. ModelError in one sentence if it cannot be used."""
    base = url.strip().rstrip("/")
    base = re.sub(r"/chat/completions$", "", base)
    if not base.endswith("/v1"):
        base += "/v1"
    endpoint = Endpoint(base, api_key or os.environ.get(API_KEY_ENV) or None)
    try:
        listed = endpoint.json("GET", "/models")
    except RemoteError as e:
        raise ModelError(str(e)) from None
    models = listed.get("data") if isinstance(listed, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ModelError(f"{base}/models lists no model: is this an OpenAI-compatible server?")
    first = models[0]
    told = _context_of(first) or _context_from_props(endpoint)
    info = RemoteInfo(str(first["id"]), context or told or DEFAULT_CONTEXT, bool(context or told))
    return RemoteModel(RemoteSource(info.model, base), endpoint, info)


def _context_of(model: dict) -> int | None:
    # vLLM: max_model_len; LM Studio: max_context_length; Eddy: context_length; llama.cpp: meta.n_ctx_train.
    for key in ("max_model_len", "context_length", "max_context_length"):
        if isinstance(model.get(key), int) and model[key] > 0:
            return model[key]
    return None


def _context_from_props(endpoint: Endpoint) -> int | None:
    """llama.cpp's server says its n_ctx at /props (beside /v1)."""
    try:
        props = Endpoint(endpoint.base[: -len("/v1")], endpoint.api_key, 5.0).json("GET", "/props")
        n = props.get("default_generation_settings", {}).get("n_ctx")
        return n if isinstance(n, int) and n > 0 else None
    except (RemoteError, AttributeError):
        return None


@dataclass
class RemoteModel:
    source: RemoteSource
    endpoint: Endpoint
    info: RemoteInfo
    chat_defaults: ChatDefaults = field(default_factory=ChatDefaults)

    def chat(self, settings: ChatSettings | None = None) -> "RemoteSession":
        return RemoteSession(self.endpoint, self.info, settings)


class RemoteSession:
    """ChatSession's surface over a remote server: the conversation is kept here and sent whole (fitted) each turn."""

    def __init__(self, endpoint: Endpoint, info: RemoteInfo, settings: ChatSettings | None = None) -> None:
        self.endpoint, self.info = endpoint, info
        self.settings = settings or ChatSettings()
        self.messages: list[dict] = []  # the conversation, system prompt apart
        self.dropped = 0  # leading messages the last request left out (they did not fit)
        self.stop_flag = threading.Event()
        self.chars_per_token = CHARS_PER_TOKEN
        self._sent_tokens = 0  # the last request's prompt, as the server counted it (estimated until it says)
        self._reply_tokens = 0  # the last reply's (in the server's context too, after its prompt)
        self._total = 0  # the tokens of the whole conversation (estimated): "seen in this chat"
        self.model_tokenizer = None  # the server's own: tools and templates are its business

    # --- what ChatSession offers ---------------------------------------------------------------------------

    @property
    def conversation(self) -> list[dict]:
        return list(self.messages)

    def reset(self) -> None:
        self.messages, self.dropped = [], 0

    def stop(self) -> None:
        self.stop_flag.set()

    def count_tokens(self, text: str) -> int:
        return self._estimate(text)

    def resume(self, history: list[dict], on_event: EventSink | None = None) -> Prefill:
        """Takes a stored chat as the conversation: nothing is sent until the next message."""
        self.messages = [message_for_template(m) for m in history]
        emit = on_event or (lambda _e: None)
        self._fit(self._opening(), self.messages, with_reply=False)
        event = Prefill(0, 0.0, self.stats)
        emit(event)
        emit(self.context())
        return event

    follow = resume

    def answer(self, message: str | dict, on_event: EventSink | None = None, before: list[dict] | tuple = ()) -> TurnResult:
        last = message_for_template(message if isinstance(message, dict) else {"role": "user", "content": message})
        kept = list(self.messages)
        self.messages += [message_for_template(m) for m in before] + [last]
        try:
            return self._reply(on_event or (lambda _e: None))
        except BaseException:
            self.messages = kept
            raise

    def regenerate(self, on_event: EventSink | None = None) -> TurnResult:
        if len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            raise EddyError("there is no reply to regenerate")
        self.messages = self.messages[:-1]
        return self._reply(on_event or (lambda _e: None))

    def edit_last(self, text: str, on_event: EventSink | None = None) -> TurnResult:
        last = next((i for i in range(len(self.messages) - 1, -1, -1) if self.messages[i]["role"] == "user"), None)
        if last is None:
            raise EddyError("there is no message to edit")
        self.messages = self.messages[:last]
        return self.answer(text, on_event)

    @property
    def stats(self) -> CacheStats:
        # Nothing is cached here: the server's window is its context, what was sent is "used", what did not fit
        # has "left" it.
        used = min(self._sent_tokens + self._reply_tokens, self.info.context)
        return CacheStats(0, self.info.context, self.info.context, used, max(0, self._total - used), self._total, 0)

    def context(self) -> Context:
        spans, pos = [], 0
        for m in self.messages:
            n = self._estimate(m.get("content") or "")
            spans.append((pos, pos + n))
            pos += n
        return Context(self.dropped, tuple(spans[self.dropped:]), (), -1, (0, 0), self.stats)

    # --- internals ---------------------------------------------------------------------------------------------

    def _opening(self) -> list[dict]:
        system = self.settings.system_prompt
        return [{"role": "system", "content": system}] if system else []

    @property
    def reply_room(self) -> int:
        """The reply's length: the settings' unless that would take more than a quarter of the context."""
        return max(1, min(self.settings.max_new_tokens, self.info.context // 4))

    def _estimate(self, text: str) -> int:
        return max(1, int(len(text) / self.chars_per_token) + 4)  # + the template's few tokens per message

    def _fit(self, opening: list[dict], messages: list[dict], with_reply: bool = True,
             room: int | None = None) -> list[dict]:
        """The newest messages that fit the context after the system prompt (and the reply's room), from a user
        message on; the last message always goes, its text cut from the front if it alone is too long."""
        context = room or self.info.context
        budget = context - min(MARGIN, context // 16) - (self.reply_room if with_reply else 0)
        budget -= sum(self._estimate(m["content"]) for m in opening)
        if budget <= 0:
            raise PromptTooLongError(f"the system prompt does not fit the server's context of {self.info.context} "
                                     f"tokens with room for a reply")
        sizes = [self._estimate(m.get("content") or "") for m in messages]
        start, used = len(messages), 0
        while start > 0 and used + sizes[start - 1] <= budget:
            start -= 1
            used += sizes[start]
        while start < len(messages) - 1 and messages[start]["role"] != "user":
            start += 1  # a chat sent to a model begins with the user's turn
        if start == len(messages) and messages:
            start = len(messages) - 1
            last = dict(messages[-1])
            keep = int(budget * self.chars_per_token * 0.9)
            last["content"] = (last.get("content") or "")[-keep:]
            fitted = [last]
        else:
            fitted = messages[start:]
        self.dropped, self._reply_tokens = start, 0
        self._total = sum(sizes) + sum(self._estimate(m["content"]) for m in opening)
        self._sent_tokens = sum(self._estimate(m.get("content") or "") for m in fitted) + sum(
            self._estimate(m["content"]) for m in opening)
        return [*opening, *fitted]

    def _body(self, messages: list[dict]) -> dict:
        p = self.settings.sampling
        body: dict[str, Any] = {"model": self.info.model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}, "max_tokens": self.reply_room,
                                "temperature": p.temperature, "top_p": p.top_p, "presence_penalty": p.presence_penalty,
                                "frequency_penalty": p.frequency_penalty}
        # llama.cpp's, vLLM's and Ollama's own fields; a server that does not know them ignores them.
        if p.top_k:
            body["top_k"] = p.top_k
        if p.min_p:
            body["min_p"] = p.min_p
        if p.repeat_penalty != 1:
            body["repeat_penalty"] = p.repeat_penalty
        if p.seed is not None:
            body["seed"] = p.seed
        extras = self.settings.template_extras or {}
        if extras.get("tools"):
            body["tools"] = extras["tools"]
        return body

    def _reply(self, emit: EventSink) -> TurnResult:
        self.stop_flag.clear()
        room = None
        for attempt in range(2):
            messages = self._fit(self._opening(), self.messages, room=room)
            try:
                return self._stream(messages, emit)
            except _ContextExceeded:
                if attempt:
                    raise RemoteError("the server still finds the chat too long for its context after fitting it "
                                      "into half of it") from None
                room = self.info.context // 2  # the estimate ran short of the server's count: half the room
        raise AssertionError("unreachable")

    def _stream(self, messages: list[dict], emit: EventSink) -> TurnResult:
        start = time.perf_counter()
        response = self.endpoint.request("POST", "/chat/completions", self._body(messages), self.stop_flag)
        if response.status >= 400:
            data = response.read()
            text = _api_error(self.endpoint.base, response.status, data)
            if response.status == 400 and re.search(r"context|too long|maximum.*tokens", text, re.I):
                raise _ContextExceeded(text)
            raise RemoteError(text)
        splitter = ThinkSplitter()
        content, thinking, chunks = [], [], 0
        first_at: float | None = None
        usage: dict = {}
        timings: dict = {}
        reason = "length"
        try:
            for event in _events(response):
                if "error" in event:
                    raise RemoteError(_api_error(self.endpoint.base, 500, json.dumps(event).encode()))
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    pieces = [("reasoning", delta.get("reasoning_content") or delta.get("reasoning") or "")]
                    pieces += splitter.push(delta.get("content") or "")
                    for kind, text in pieces:
                        if not text:
                            continue
                        if first_at is None:
                            first_at = time.perf_counter()
                            emit(Prefill(self._sent_tokens, round((first_at - start) * 1e3, 2), self.stats))
                            emit(self.context())
                        chunks += 1
                        (thinking if kind == "reasoning" else content).append(text)
                        emit(Reasoning(text) if kind == "reasoning" else Token(text))
                    if choice.get("finish_reason"):
                        reason = {"stop": "eos", "length": "length", "tool_calls": "eos"}.get(choice["finish_reason"],
                                                                                            "eos")
        except (OSError, ValueError, AttributeError, http.client.HTTPException) as e:
            # (ValueError, AttributeError: http.client reading a socket that a stop has shut.)
            if not self.stop_flag.is_set():
                raise RemoteError(f"the connection to {self.endpoint.base} broke mid-reply: {_reason(e)}") from None
        finally:
            response.close()
        for kind, text in splitter.flush():
            (thinking if kind == "reasoning" else content).append(text)
            emit(Reasoning(text) if kind == "reasoning" else Token(text))
        if self.stop_flag.is_set():
            reason = "stopped"
        end = time.perf_counter()
        if first_at is None:
            first_at = end
            emit(Prefill(self._sent_tokens, round((end - start) * 1e3, 2), self.stats))
            emit(self.context())
        prompt_tokens = usage.get("prompt_tokens") or timings.get("prompt_n")
        if isinstance(prompt_tokens, int) and prompt_tokens > 0:
            # The server's own count: the next fit estimates with its ratio.
            sent_chars = sum(len(m.get("content") or "") for m in messages)
            self.chars_per_token = max(1.0, min(8.0, sent_chars / prompt_tokens))
            self._sent_tokens = prompt_tokens
        tokens = usage.get("completion_tokens") or timings.get("predicted_n") or chunks
        decode_ms = (end - first_at) * 1e3
        answer = "".join(content)
        self.messages.append({"role": "assistant", "content": answer})
        self._reply_tokens = int(tokens)
        self._total += int(tokens)
        emit(self.context())
        tok_s = timings.get("predicted_per_second") or (tokens / (decode_ms / 1e3) if decode_ms > 0 else 0.0)
        emit(Done(int(tokens), round(decode_ms, 2), round(float(tok_s), 2), reason, self.stats))
        return TurnResult(answer, int(tokens), self._sent_tokens, round((first_at - start) * 1e3, 2), decode_ms, reason,
                          "".join(thinking))


class _ContextExceeded(RemoteError):
    pass


def _events(response: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream (a non-streaming JSON answer is one event too)."""
    kind = response.getheader("Content-Type", "")
    if "text/event-stream" not in kind:
        data = json.loads(response.read() or b"{}")
        for choice in data.get("choices") or []:
            choice["delta"] = choice.get("message") or {}
        yield data
        return
    for raw in response:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except ValueError:
            continue  # a keep-alive or a comment: not ours
