"""The HTTP side of `eddy serve`: a Starlette application (run by uvicorn) over one JobRunner (the engine thread).

Every error a client can cause is an OpenAI-shaped JSON error, never a traceback: a body that is not JSON or
not UTF-8, or nested too deeply (400), a wrong key (401), a Host or Origin of a web page (403, engine/serve/guard.py),
an unknown model or path (404), a body over the limit (413), a body that is not application/json (415), a field of
the wrong type or range (422), a request that waited too long for the engine (503 with Retry-After). A client
that disconnects, streaming or not, stops its generation within one token, and one that leaves while its request
waits is dropped from the queue.

The event loop answers every client, so nothing on it costs what a client chooses: bodies are parsed and prompts
tokenised off it, stop sequences are few and short, and max_tokens has a ceiling.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import PromptTooLongError
from ..events import Done, Prefill, Reasoning, Token
from ..run.constraint import Grammar, GrammarError
from ..run.generation import ChatDefaults
from ..run.reasoning import partial_end
from ..run.session import ChatSettings, TurnResult
from ..run.tokenizer import Tokenizer
from ..run.tools import Choice, ToolError, ToolPlan, check_tools
from .conversations import Reuse
from .guard import LOOPBACK_NAMES, BrowserGuard, cors_options
from .protocol import (FINISH, NO_THINKING, APIError, ChatRequest, CompletionRequest, Sampling, completion_id, now,
                       parse)
from .worker import Job, JobRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    model_id: str
    api_key: str | None = None
    defaults: ChatDefaults = ChatDefaults()
    pin_system: bool = False
    max_tokens: int = 512  # a reply's length when the request names none
    queue_timeout: float = 60.0  # seconds a request may wait for the engine before a 503
    body_limit: int = 8 * 1024 * 1024
    read_timeout: float = 30.0  # seconds a client may take to send its body
    # The longest reply a request may ask for: a stream goes on as long as it is read, but an abandoned
    # non-streaming one of 10^12 tokens would be nobody's to stop.
    max_tokens_limit: int = 32768
    hosts: frozenset[str] | None = LOOPBACK_NAMES  # Host names answered; None: any (every interface, with a key)
    origins: tuple[str, ...] = ()  # web pages allowed to call (their Origin); "*" for any


class StopWatcher:
    """Turns a reply's token events into the text to send, cut at the first stop sequence: text that could be
    the start of one is held back until it is clear.

    Its work per token is bounded by the stop sequences alone (at most 4 of at most STOP_CHARS characters,
    protocol.py): what it holds back is shorter than the longest of them."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.pending, self.hit = stops, "", False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending, self.hit = self.pending[: min(found)], "", True
            return out
        hold = max((partial_end(self.pending, s) for s in self.stops), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out


def create_app(engine: JobRunner, settings: ServerSettings) -> Starlette:
    s = settings

    def authorise(request: Request) -> None:
        if s.api_key is None:
            return
        # The scheme is case-insensitive (RFC 9110); the key is compared in constant time.
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), s.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", kind="authentication_error")

    async def body(request: Request, model: type) -> Any:
        """The request body as `model`, read within the size and time limits and parsed off the event loop."""
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json":
            # A web page can POST text/plain or a form across sites with no preflight: JSON only.
            raise APIError(415, f"the request body must be application/json (Content-Type was {kind or 'none'!r})")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > s.body_limit:
            raise APIError(413, f"the request body is over {s.body_limit // (1024 * 1024)} MB")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > s.body_limit:
                    raise APIError(413, f"the request body is over {s.body_limit // (1024 * 1024)} MB")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), s.read_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, "the request body did not arrive in time") from None
        return await asyncio.to_thread(_parse_body, b"".join(chunks), model)

    def check(req: Sampling) -> None:
        if req.model and req.model != s.model_id:
            raise APIError(404, f"the model {req.model!r} does not exist; this server runs {s.model_id!r}", "model",
                           kind="not_found_error")
        req.refuse_what_cannot_be_honoured()
        if (req.limit() or 0) > s.max_tokens_limit:
            raise APIError(400, f"max_tokens is over this server's limit of {s.max_tokens_limit}", "max_tokens")

    def chat_settings(req: Sampling, system: str | None, limit: int | None, **more: Any) -> ChatSettings:
        try:
            return ChatSettings.make(s.defaults, req.overrides(), req.seed, system_prompt=system,
                                     max_new_tokens=limit or s.max_tokens, pin_system=s.pin_system, **more)
        except ValueError as e:
            raise APIError(422, str(e)) from None

    async def start(request: Request, work) -> Job:
        """The job, submitted and started; a client that goes away meanwhile drops it from the queue."""
        job = engine.submit(Job(asyncio.get_running_loop(), work))
        job.watcher = asyncio.ensure_future(watch(request, job))
        started = asyncio.ensure_future(job.started.wait())
        try:
            await asyncio.wait({started, job.result}, timeout=s.queue_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not job.started.is_set():
            engine.stop(job)
            job.watcher.cancel()
            raise APIError(503, "the engine is busy with other requests; try again shortly", kind="server_error",
                           headers={"Retry-After": "5"})
        return job

    async def watch(request: Request, job: Job) -> None:
        """Stops the job as soon as its client disconnects. The body has been read, so the next message the
        server has for this request is its disconnect (a streaming response listens for its own, and this
        watcher is cancelled when one starts)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                engine.stop(job)
                return

    def timings(prefill: Prefill | None, done: Done | None, reuse: Reuse | None) -> dict[str, Any]:
        if prefill is None:
            return {}
        cache = (done or prefill).cache
        before = prefill.cache.position - prefill.new_tokens
        out = {
            "prompt_n": prefill.new_tokens, "prompt_ms": prefill.ms,
            "prompt_per_second": round(prefill.new_tokens / (prefill.ms / 1e3), 2) if prefill.ms else 0.0,
            "cache_n": before,
            "predicted_n": done.tokens if done else 0, "predicted_ms": done.ms if done else 0.0,
            "predicted_per_second": done.tok_s if done else 0.0,
            # Eddy's own: the cache after the reply, how this request reused it, and how many of its
            # prompt's tokens streamed out of the window (a prompt longer than the window is never refused).
            "cache": cache.to_dict(),
            "reuse": reuse.kind if reuse else None,
            "prompt_evicted": max(0, prefill.cache.evicted - max(0, before - prefill.cache.capacity)),
        }
        return out

    def usage(prefill: Prefill | None, done: Done | None) -> dict[str, int]:
        prompt = prefill.cache.position if prefill else 0
        completion = done.tokens if done else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def run(request: Request, job: Job, stops: list[str],
                  plan: ToolPlan | None = None) -> AsyncIterator[tuple[str, dict]]:
        """Yields ("text", piece) and ("reasoning", piece) as the reply grows, ("calls", [ToolCall]) once its
        tool calls are read, then ("end", details); stops the job on a stop sequence or when the client has gone."""
        stops_ = StopWatcher(stops)
        calls = plan.stream() if plan else None
        prefill = done = None
        try:
            while True:
                getter = asyncio.ensure_future(job.events.get())
                finished, _ = await asyncio.wait({getter, job.result}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                if getter not in finished:
                    getter.cancel()
                    if job.result.done() and job.events.empty():
                        break
                    if await request.is_disconnected():
                        engine.stop(job)
                    continue
                event = getter.result()
                if isinstance(event, Prefill) and prefill is None:
                    prefill = event
                elif isinstance(event, Token):
                    piece = stops_.push(event.text)
                    if stops_.hit:
                        engine.stop(job)
                    if calls is not None:
                        piece = calls.push(piece)
                    if piece:
                        yield "text", {"text": piece}
                elif isinstance(event, Reasoning):
                    yield "reasoning", {"text": event.text}
                elif isinstance(event, Done):
                    done = event
            error = job.result.exception()
            if isinstance(error, APIError):
                raise error
            if isinstance(error, PromptTooLongError):  # a system prompt too long to pin: nothing was changed
                raise APIError(400, str(error), "messages")
            if error is not None:
                log.error("a request failed: %r", error)
                raise APIError(500, f"generation failed: {error}", kind="server_error")
            result: TurnResult
            result, reuse = job.result.result()
            tail = stops_.flush()
            found = []
            if calls is not None:
                tail = calls.push(tail)
                rest, found = calls.finish()
                tail += rest
            if tail:
                yield "text", {"text": tail}
            reason = "stop" if stops_.hit else FINISH.get(result.stop_reason, "stop")
            if found and plan is not None:
                yield "calls", {"calls": plan.named(found)}
                # A reply that ran out of tokens says so, with the calls it did finish.
                reason = "length" if reason == "length" else "tool_calls"
            yield "end", {"finish_reason": reason, "timings": timings(prefill, done, reuse),
                          "usage": usage(prefill, done)}
        finally:
            if not job.result.done():
                engine.stop(job)  # the client went away (the response was cancelled): free the engine
            if job.watcher is not None:
                job.watcher.cancel()

    async def collect(request: Request, job: Job, stops: list[str],
                      plan: ToolPlan | None = None) -> tuple[str, dict]:
        """A whole reply, for a request that does not stream: its text and how it ended (with its "reasoning"
        and "calls" when it has them)."""
        text, thinking, calls, end = [], [], [], {}
        async for kind, data in run(request, job, stops, plan):
            if kind == "text":
                text.append(data["text"])
            elif kind == "reasoning":
                thinking.append(data["text"])
            elif kind == "calls":
                calls = data["calls"]
            else:
                end = data
        return "".join(text), {**end, "reasoning": "".join(thinking), "calls": calls}

    def sse(job: Job, chunks: AsyncIterator[str]) -> StreamingResponse:
        """Server-sent events: an error after the stream began goes out as its own event, then [DONE]. The
        response listens for the client's disconnect itself, so the job's watcher gives way to it."""
        if job.watcher is not None:
            job.watcher.cancel()

        async def framed() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(framed(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": s.model_id, "waiting": engine.waiting})

    async def models(request: Request) -> Response:
        authorise(request)
        # context_length: what the model sees at once (sinks + window), so a client that sends whole histories
        # (Eddy's own remote engine, engine/remote.py) fits them to it; longer ones still slide here, never refused.
        return JSONResponse({"object": "list", "data": [
            {"id": s.model_id, "object": "model", "created": 0, "owned_by": "eddy",
             "context_length": engine.session.engine.capacity}]})

    async def chat(request: Request) -> Response:
        authorise(request)
        req = await body(request, ChatRequest)
        check(req)
        system, history, last = req.split()
        stops = req.stops()
        tokenizer: Tokenizer = engine.session.model_tokenizer
        plan, grammar, extras = await asyncio.to_thread(_agent_side, req, tokenizer, [*history, last])
        system = plan.system(system)  # a template without tools is told of them here
        settings_ = chat_settings(req, system, req.limit(), template_extras=extras or None, grammar=grammar)
        job = await start(request, lambda eng, emit: eng.pool.chat(system, history, last, settings_, emit,
                                                                    shape=plan.messages, reply=plan.message))
        ident, created = completion_id("chatcmpl"), now()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
                body_ = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": s.model_id,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
                return f"data: {json.dumps(body_, ensure_ascii=False)}\n\n"

            async def events() -> AsyncIterator[str]:
                yield chunk({"role": "assistant", "content": ""})
                async for kind, data in run(request, job, stops, plan):
                    if kind == "text":
                        yield chunk({"content": data["text"]})
                    elif kind == "reasoning":
                        yield chunk({"reasoning_content": data["text"]})
                    elif kind == "calls":
                        for i, call in enumerate(data["calls"]):
                            # The name first, then the arguments: how OpenAI streams a call (clients join them).
                            yield chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                         "function": {"name": call.name, "arguments": ""}}]})
                            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
                    else:
                        extra = {"timings": data["timings"]}
                        if include_usage:
                            extra["usage"] = data["usage"]
                        yield chunk({}, data["finish_reason"], **extra)

            return sse(job, events())
        text, end = await collect(request, job, stops, plan)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if end["reasoning"]:
            message["reasoning_content"] = end["reasoning"]
        if end["calls"]:
            message["content"] = text or None
            message["tool_calls"] = [c.to_openai() for c in end["calls"]]
        return JSONResponse({
            "id": ident, "object": "chat.completion", "created": created, "model": s.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": end["finish_reason"], "logprobs": None}],
            "usage": end["usage"], "timings": end["timings"]})

    async def completions(request: Request) -> Response:
        authorise(request)
        req = await body(request, CompletionRequest)
        check(req)
        prompt = req.text()
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        stops = req.stops()
        settings_ = chat_settings(req, None, req.limit(), split_thinking=False)  # a raw prompt has no template
        # Tokenised on the engine thread: a prompt of megabytes takes seconds, which the event loop must not.
        job = await start(request, lambda eng, emit: eng.pool.complete(eng.session.tokenizer.encode_prompt(prompt),
                                                                         settings_, emit))
        ident, created = completion_id("cmpl"), now()
        if req.stream:
            def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
                body_ = {"id": ident, "object": "text_completion", "created": created, "model": s.model_id,
                         "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], **extra}
                return f"data: {json.dumps(body_, ensure_ascii=False)}\n\n"

            async def events() -> AsyncIterator[str]:
                async for kind, data in run(request, job, stops):
                    if kind == "text":
                        yield chunk(data["text"])
                    else:
                        yield chunk("", data["finish_reason"], timings=data["timings"], usage=data["usage"])

            return sse(job, events())
        text, end = await collect(request, job, stops)
        return JSONResponse({
            "id": ident, "object": "text_completion", "created": created, "model": s.model_id,
            "choices": [{"index": 0, "text": text, "finish_reason": end["finish_reason"], "logprobs": None}],
            "usage": end["usage"], "timings": end["timings"]})

    async def api_error(request: Request, e: APIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def http_error(request: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind=kind).body(), status_code=e.status_code)

    async def server_error(request: Request, e: Exception) -> Response:
        log.exception("unexpected error")
        return JSONResponse(APIError(500, "internal error", kind="server_error").body(), status_code=500)

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    # The guard outermost, so a refused page never reaches CORS or a route; CORS only for origins allowed.
    middleware = [Middleware(BrowserGuard, hosts=s.hosts, origins=s.origins)]
    if s.origins:
        middleware.append(Middleware(CORSMiddleware, **cors_options(s.origins)))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})


def _agent_side(req: ChatRequest, tokenizer: Tokenizer, messages: list[dict]) -> tuple[ToolPlan, Grammar | None, dict]:
    """(the request's tools, the grammar its reply is held to, what the template is given besides the messages),
    every part checked: a 400 naming the field for what cannot be used. In a worker thread: a schema's grammar
    takes milliseconds to compile, and the first one builds the vocabulary's view (a fraction of a second)."""
    try:
        tools = check_tools(req.tools)
        plan = ToolPlan.make(tokenizer.template_source, tools, Choice.read(req.tool_choice, tools),
                             req.parallel_tool_calls)
    except ToolError as e:
        raise APIError(400, str(e), "tools" if "tool_choice" not in str(e) else "tool_choice") from None
    # A template writes tool definitions and call arguments as its own text, where special tokens are live.
    for where, value in (("tools", tools), ("messages", [m.get("tool_calls") for m in messages])):
        found = tokenizer.control_text_in(json.dumps(value, ensure_ascii=False))
        if found:
            raise APIError(400, f"{where} may not contain the model's control token {found!r}", where)
    grammars = [(name, g) for name, g in (("tool_choice", plan.grammar(tokenizer.special_id) if plan.active else None),
                                          ("response_format", _response_grammar(req)),
                                          ("grammar", _grammar_field(req.grammar)),
                                          ("guided_regex", _regex_field(req.guided_regex))) if g is not None]
    if len(grammars) > 1:
        raise APIError(400, f"{grammars[0][0]} and {grammars[1][0]} each constrain the reply: send one", grammars[1][0])
    grammar = grammars[0][1] if grammars else None
    if grammar is not None:
        try:
            tokenizer.grammars.check(grammar)
        except GrammarError as e:
            raise APIError(400, str(e), grammars[0][0]) from None
    extras: dict[str, Any] = dict(plan.extras())
    for key, value in (req.chat_template_kwargs or {}).items():
        if not (isinstance(key, str) and key.isidentifier()) or key in ("messages", "tools", "add_generation_prompt"):
            raise APIError(400, f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
        extras[key] = value
    if req.reasoning_effort is not None:
        extras.setdefault("enable_thinking", req.reasoning_effort not in NO_THINKING)
    elif grammar is not None and "enable_thinking" in tokenizer.template_source:
        # A grammar holds the reply from its first token, where a thinking block would have to start.
        extras.setdefault("enable_thinking", False)
    return plan, grammar, extras


def _response_grammar(req: ChatRequest) -> Grammar | None:
    fmt = req.response_format
    if fmt is None or fmt.get("type") in (None, "text"):
        return None
    try:
        if fmt.get("type") == "json_object":
            return Grammar.json_object()
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema must be {\"name\": ..., \"schema\": {...}}",
                               "response_format")
            return Grammar.json_schema(spec.get("schema") or {"type": "object"})
    except GrammarError as e:
        raise APIError(400, str(e), "response_format") from None
    raise APIError(400, f"response_format type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                   "response_format")


def _grammar_field(text: str | None) -> Grammar | None:
    if not text:
        return None
    try:
        return Grammar.gbnf(text)
    except GrammarError as e:
        raise APIError(400, str(e), "grammar") from None


def _regex_field(pattern: str | None) -> Grammar | None:
    if not pattern:
        return None
    try:
        return Grammar.regex(pattern)
    except GrammarError as e:
        raise APIError(400, str(e), "guided_regex") from None


def _parse_body(data: bytes, model: type) -> Any:
    """The body as the request `model` (in a worker thread: 8 MB of JSON is a noticeable pause)."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    try:
        return parse(model, value)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
