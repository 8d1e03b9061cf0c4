"""The OpenAI wire format: request bodies checked with pydantic, OpenAI-shaped errors, response pieces.

Fields Eddy's sampler has map to it (llama.cpp's top_k, min_p and repeat_penalty too); tools, tool_choice,
response_format, reasoning_effort and chat_template_kwargs are read here and carried out by engine/run/tools.py
and engine/run/constraint.py; fields that would change what a client gets back and that Eddy cannot honour
(n > 1, logprobs, the old `functions`) are a 400 naming the field; anything else unknown is ignored, as the
OpenAI API itself does with extra fields.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Roles a chat may hold; "developer" is OpenAI's newer name for a system message.
ROLES = ("system", "developer", "user", "assistant", "tool")
# Stop sequences: as many as OpenAI takes, each as long as any real one needs. Their length bounds the work the
# server does on every token of a reply.
MAX_STOPS, STOP_CHARS = 4, 256


class APIError(Exception):
    """An error the client is told about, in the OpenAI shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class ContentPart(BaseModel):
    """One part of a message's content. Only text is read; any other type (image_url, input_audio, file) is
    taken here so that it can be refused by name rather than as a shape the validator did not expect."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(BaseModel):
    """A call an assistant message made, as a client sends it back."""
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall

    def normal(self) -> dict:
        args = self.function.arguments
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": text}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def normal(self) -> dict:
        """The message as the engine keeps it (and as Eddy's own replies are recorded, so a conversation sent
        back compares equal): the system role for "developer", calls in one shape, no empty extras."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.normal() for c in self.tool_calls]
            out["content"] = out["content"] or None
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id or ""
        return out

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (Eddy takes {', '.join(ROLES)})")
        return role

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise APIError(400, f"content parts of type {part.type!r} are not supported: this model reads text "
                                    "only", "messages")
            if part.text is None:
                raise APIError(400, "a text content part has no text", "messages")
        return "".join(part.text or "" for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both endpoints share."""
    model_config = ConfigDict(extra="allow")
    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=5)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, lt=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    logprobs: bool | int | None = None

    def overrides(self) -> dict[str, Any]:
        """The sampler values this request sets; the rest follow the model's chat defaults."""
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"at most {MAX_STOPS} stop sequences", "stop")
        if any(len(s) > STOP_CHARS for s in stops):
            raise APIError(400, f"a stop sequence may be at most {STOP_CHARS} characters", "stop")
        return [s for s in stops if s]

    def refuse_what_cannot_be_honoured(self) -> None:
        if self.n != 1:
            raise APIError(400, "Eddy generates one choice per request: n must be 1", "n")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if (self.model_extra or {}).get("functions"):
            raise APIError(400, "the old `functions` field is not supported: send `tools`", "functions")


class ChatRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None
    reasoning_effort: str | None = None
    # llama-server's and vLLM's way to set the template's switches (enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    grammar: str | None = None  # llama-server's GBNF (or a Lark grammar)
    guided_regex: str | None = None  # vLLM's: the reply matches this regular expression

    def split(self) -> tuple[str | None, list[dict], dict]:
        """(system prompt, the conversation before the last message, the last message: the user's or a tool's)."""
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        msgs = [m.normal() for m in self.messages]
        lead = 0
        while lead < len(msgs) and msgs[lead]["role"] == "system":
            lead += 1
        system = "\n\n".join(m["content"] for m in msgs[:lead]) or None
        rest = msgs[lead:]
        if any(m["role"] == "system" for m in rest):
            raise APIError(400, "system messages are only taken at the start of the conversation", "messages")
        if not rest or rest[-1]["role"] not in ("user", "tool"):
            raise APIError(400, "the last message must be the user's (or a tool's result)", "messages")
        return system, rest[:-1], rest[-1]

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, "Eddy takes one prompt per request", "prompt")
            return self.prompt[0]
        return self.prompt

    def limit(self) -> int | None:
        return self.max_tokens


def parse(model: type[BaseModel], data: Any) -> Any:
    """The request, checked; a 422 naming the first bad field otherwise."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(422, f"{where}: {first['msg']}", where) from None


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "stopped": "stop"}

# reasoning_effort values that turn thinking off (OpenAI's "none"; llama-server and Ollama take the same).
NO_THINKING = ("none",)
