"""Tool calling: how a model is told its tools, how its calls are read back, and the grammar that forces one.

Each family writes its calls its own way, so one table holds the formats (FORMATS) and the template picks one:
a template that renders `tools` itself is given them (transformers' apply_chat_template does the same), and its
own text says which format it teaches (Qwen's and Hermes' `<tool_call>` JSON, Mistral's `[TOOL_CALLS]`, Phi-4's
`<|tool_call|>` list, Llama 3.x's bare JSON with "parameters", Gemma's bare or fenced JSON). A template that knows nothing of tools
(SmolLM2's ChatML) gets them in the system prompt, in the Hermes format, with tool results as user turns.

`tool_choice` "required" or a named function is enforced by a grammar (engine/run/constraint.py): the reply is
then nothing but calls whose arguments follow each function's JSON schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import EddyError
from .constraint import Grammar, styled
from .reasoning import partial_end


class ToolError(EddyError):
    """A tool definition, tool_choice or tool message that cannot be used."""


_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's `tools`, checked: each a function with a usable name and a JSON-schema object for parameters."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools must be a list")
    out, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
                tool.get("function"), dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise ToolError(f"two tools are named {name!r}")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"tools[{i}].function.description must be text")
        out.append({"type": "function", "function": {"name": name, "description": description, "parameters": params}})
    return out


@dataclass(frozen=True)
class Choice:
    """tool_choice, read: "auto", "none", "required", or one function by name."""
    mode: str
    name: str | None = None

    @staticmethod
    def read(value: Any, tools: list[dict]) -> "Choice":
        if value is None:
            return Choice("auto" if tools else "none")
        if value in ("auto", "none", "required"):
            if value == "required" and not tools:
                raise ToolError("tool_choice is \"required\" but no tools were given")
            return Choice(value)
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
            name = value["function"].get("name")
            if name not in {t["function"]["name"] for t in tools}:
                raise ToolError(f"tool_choice names {name!r}, which is not among the tools")
            return Choice("function", name)
        raise ToolError("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}")


# --- formats ----------------------------------------------------------------------------------------------

def _call_object(name_key: str, args_key: str) -> Callable[[dict], dict]:
    def schema(fn: dict) -> dict:
        params = fn["parameters"]
        if params.get("type") == "object" and "additionalProperties" not in params:
            # A forced call takes the parameters the function declares: left open, a small model may go on
            # inventing properties until it runs out of tokens.
            params = {**params, "additionalProperties": False}
        return {"type": "object", "properties": {name_key: {"const": fn["name"]}, args_key: _bounded(params)},
                "required": [name_key, args_key], "additionalProperties": False}
    return schema


# JSON's safe integers: clients (JavaScript's above all) lose precision past them, and a small model held to an
# unbounded integer may write digits until it runs out of tokens.
_SAFE = 2 ** 53 - 1


def _bounded(schema: Any) -> Any:
    """`schema` with every integer lacking bounds held to JSON's safe range."""
    if isinstance(schema, list):
        return [_bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v) for k, v in schema.items()}
    if out.get("type") == "integer":
        out.setdefault("minimum", -_SAFE)
        out.setdefault("maximum", _SAFE)
    return out


@dataclass(frozen=True)
class Format:
    """How one family writes its calls."""
    name: str
    opener: str  # text that starts the calls ("" : a bare JSON reply)
    closer: str  # text after each call ("" : none)
    args_key: str  # "arguments" or "parameters"
    listed: bool  # the calls come as one JSON list after the opener (Mistral)
    marks: tuple[str, ...]  # text in a template that teaches this format

    def call_schema(self, fn: dict) -> dict:
        return _call_object("name", self.args_key)(fn)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("hermes", "<tool_call>", "</tool_call>", "arguments", False, ("<tool_call>",)),
    Format("mistral", "[TOOL_CALLS]", "", "arguments", True, ("[TOOL_CALLS]",)),
    Format("phi4", "<|tool_call|>", "<|/tool_call|>", "arguments", False, ("<|tool_call|>",)),
    Format("llama3", "", "", "parameters", False, ("<|python_tag|>", "ipython")),
    Format("json", "", "", "arguments", False, ()),
)}


def template_format(template_source: str) -> tuple[Format, bool]:
    """(the format this template teaches, whether it renders `tools` itself). A template without tools gets
    the Hermes format through the system prompt (fallback_system)."""
    native = re.search(r"\btools\b", template_source) is not None
    for fmt in FORMATS.values():
        if any(mark in template_source for mark in fmt.marks):
            return fmt, native
    return (FORMATS["json"] if native else FORMATS["hermes"]), native


def fallback_system(tools: list[dict]) -> str:
    """What a template without tools is told, after the system prompt (Hermes' wording, which small
    instruction-tuned models have seen most)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are listed in "
            f"<tools></tools>:\n<tools>\n{lines}\n</tools>\n\nFor each function call, return a JSON object with the "
            "function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def for_template(messages: list[dict], native: bool) -> list[dict]:
    """Messages as the template takes them. A native template gets assistant calls with their arguments as
    objects (transformers' form; Qwen's template writes `arguments | tojson`) and tool results as role "tool";
    a template without tools gets the calls written into the assistant's text and results as user turns."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            if native:
                out.append({**m, "tool_calls": [_as_objects(c) for c in calls]})
            else:
                text = "\n".join(f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in calls)
                out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), text]))})
        elif m["role"] == "tool" and not native:
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    return out


def _as_objects(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = args  # not JSON: the template writes it as it came
    return {**call, "function": {**fn, "arguments": parsed}}


def _call_json(call: dict) -> str:
    fn = _as_objects(call)["function"]
    return json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}, ensure_ascii=False)


# --- the grammar that forces calls ------------------------------------------------------------------------

def call_grammar(tools: list[dict], choice: Choice, parallel: bool, fmt: Format,
                 token_text: Callable[[str], str]) -> Grammar:
    """The grammar of a reply that is only calls: one (or, parallel, one or more) of the chosen functions.
    `token_text(text)` writes an opener or closer as the grammar must match it (a special token by id)."""
    fns = [t["function"] for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    schemas = [fmt.call_schema(fn) for fn in fns]
    one = styled(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    if fmt.listed:
        body = styled({"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})})
        return Grammar.lark(f"start: {token_text(fmt.opener)} calls\ncalls: %json {json.dumps(body)}\n")
    opener = f'{token_text(fmt.opener)} "\\n" ' if fmt.opener else ""
    closer = f' "\\n" {token_text(fmt.closer)}' if fmt.closer else ""
    # A named function is one call, as OpenAI gives it.
    repeat = f'(call "\\n")* call' if parallel and choice.mode != "function" else "call"
    return Grammar.lark(f"start: {repeat}\ncall: {opener}obj{closer}\nobj: %json {json.dumps(one)}\n")


# --- reading calls back -----------------------------------------------------------------------------------

def parse_calls(text: str, fmt: Format, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(the reply's text outside its calls, the calls) from a finished reply. Text that only looks like a call
    (not JSON, or naming no known tool) stays text."""
    if fmt.opener and fmt.opener in text and not fmt.listed:
        calls, kept, pos = [], [], 0
        for m in re.finditer(re.escape(fmt.opener) + r"(.*?)(?:" + re.escape(fmt.closer) + r"|$)", text, re.S):
            found = _calls_in(m.group(1), names)
            if found:
                kept.append(text[pos:m.start()])
                calls += found
                pos = m.end()
        if calls:
            return "".join(kept + [text[pos:]]).strip(), calls
        return text, []
    if fmt.listed and fmt.opener in text:
        head, _, rest = text.partition(fmt.opener)
        calls = _calls_in(rest, names) or _mistral_v11(rest, names)
        return (head.strip(), calls) if calls else (text, [])
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    calls = _calls_in(fence.group(1) if fence else body, names)
    return ("", calls) if calls else (text, [])


def _calls_in(text: str, names: set[str]) -> list[ToolCall]:
    """Calls in `text`: one JSON object, a list of them, or objects one after another (";" or lines apart)."""
    text = text.strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        for item in value if isinstance(value, list) else [value]:
            call = _call_from(item, names)
            if call is None:
                return []
            calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
    return calls


def _call_from(item: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):  # OpenAI's own shape, which some models copy
        item = item["function"]
    name = item.get("name")
    args = item.get("arguments", item.get("parameters", {}))
    if name not in names:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _mistral_v11(text: str, names: set[str]) -> list[ToolCall]:
    """Mistral's newer form: [TOOL_CALLS]name[ARGS]{...} (each call its own [TOOL_CALLS])."""
    calls = []
    for part in text.split("[TOOL_CALLS]"):
        name, sep, args = part.partition("[ARGS]")
        if not sep:
            return []
        call = _call_from({"name": name.strip(), "arguments": args.strip()}, names)
        if call is None:
            return []
        calls.append(call)
    return calls


class CallStream:
    """Streams a reply's text while holding back what may be calls, so a client never sees a call as text.

    push(text) -> text safe to show now; finish() -> (the rest of the text, the calls)."""

    def __init__(self, fmt: Format, names: set[str]) -> None:
        self.fmt, self.names = fmt, names
        self.shown, self.held = "", ""
        self.holding = False

    def push(self, text: str) -> str:
        if self.holding:
            self.held += text
            return ""
        pending = self.held + text
        if not self.fmt.opener:
            # A bare-JSON format: a reply that starts like JSON (or a fence) may be a call, held to the end.
            lead = (self.shown + pending).lstrip()
            if not self.shown.strip() and (not lead or lead[0] in "{[`<"):
                self.held, self.holding = pending, bool(lead)
                return ""
            self.held = ""
            self.shown += pending
            return pending
        at = pending.find(self.fmt.opener)
        if at >= 0:
            self.held, self.holding = pending[at:], True
            self.shown += pending[:at]
            return pending[:at]
        hold = partial_end(pending, self.fmt.opener)
        out, self.held = pending[: len(pending) - hold], pending[len(pending) - hold:]
        self.shown += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text not shown yet, the calls): held text that holds no call is text after all."""
        held, self.held = self.held, ""
        if not held:
            return "", []
        text, calls = parse_calls(held, self.fmt, self.names)
        if not calls:
            return held, []
        return (text if text.strip() else ""), calls


# --- one request's tools ----------------------------------------------------------------------------------

@dataclass
class ToolPlan:
    """What one chat request's tools mean for the template, the sampler and the reply."""
    fmt: Format
    native: bool  # the template renders `tools` itself
    tools: list[dict]
    choice: Choice
    parallel: bool = True
    call_ids: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    @staticmethod
    def make(template_source: str, tools: list[dict], choice: Choice, parallel: bool = True) -> "ToolPlan":
        fmt, native = template_format(template_source)
        return ToolPlan(fmt, native, tools, choice, parallel)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def extras(self) -> dict:
        return {"tools": self.tools} if self.active and self.native else {}

    def system(self, system: str | None) -> str | None:
        if not self.active or self.native:
            return system
        return "\n\n".join(filter(None, [system, fallback_system(self.tools)]))

    def messages(self, messages: list[dict]) -> list[dict]:
        return for_template(messages, self.native)

    def grammar(self, special_id: Callable[[str], int | None]) -> Grammar | None:
        if self.choice.mode not in ("required", "function"):
            return None

        def token_text(text: str) -> str:
            tid = special_id(text)
            return f"<[{tid}]>" if tid is not None else json.dumps(text)
        return call_grammar(self.tools, self.choice, self.parallel, self.fmt, token_text)

    def stream(self) -> CallStream | None:
        return CallStream(self.fmt, self.names) if self.active else None

    def named(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls with ids this request gives them (the same whoever parses the reply)."""
        return [ToolCall(c.name, c.arguments, f"call_{self.call_ids}_{i}") for i, c in enumerate(calls)]

    def message(self, text: str) -> dict:
        """The reply as an assistant message, as a client sends it back next time."""
        if not self.active:
            return {"role": "assistant", "content": text}
        content, calls = parse_calls(text, self.fmt, self.names)
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": content or None,
                "tool_calls": [c.to_openai() for c in self.named(calls)]}
