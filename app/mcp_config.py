"""The MCP servers' configuration: the `mcpServers` JSON that Claude Desktop, LM Studio and Cursor use, parsed
and checked into `ServerSpec`s (`parse_servers`), with one plain sentence (`McpConfigError`) for anything wrong,
so a config pasted from another client's docs works as-is and a broken one says what to fix. No Qt here.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit


class McpConfigError(ValueError):
    """The MCP server configuration is unusable; the message is one sentence saying what to fix."""


@dataclass(frozen=True)
class ServerSpec:
    """One MCP server, as one entry of the standard `mcpServers` object.

    Exactly one of `command` (a local program spoken to over stdin/stdout) and `url` (a Streamable HTTP
    endpoint) is set. `env` is added to a small safe environment (PATH, HOME, ...), as other clients do.
    """

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    disabled: bool = False

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command is not None else "http"

    def __hash__(self) -> int:  # the dict fields would make the generated hash raise
        return hash(json.dumps([self.name, self.to_dict()], sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        """The entry in the standard form (without the name, which is its key in `mcpServers`)."""
        out: dict[str, Any] = {}
        if self.command is not None:
            out["command"] = self.command
            out["args"] = list(self.args)
            if self.env:
                out["env"] = dict(self.env)
            if self.cwd is not None:
                out["cwd"] = self.cwd
        else:
            out["url"] = self.url
            if self.headers:
                out["headers"] = dict(self.headers)
        if self.disabled:
            out["disabled"] = True
        return out

    @classmethod
    def from_dict(cls, name: str, entry: Any) -> ServerSpec:
        """Check one `mcpServers` entry; raises McpConfigError."""
        return _parse_entry(name, entry)


# The `type` values other clients write: VS Code "stdio"/"http", Cline "streamableHttp", others "streamable-http".
_STDIO_TYPES = {"stdio"}
_HTTP_TYPES = {"http", "streamable-http", "streamable_http", "streamablehttp"}


def parse_servers(text: str) -> list[ServerSpec]:
    """Parse `{"mcpServers": {name: entry, ...}}` (or the bare `{name: entry, ...}`) into specs, in order.

    Raises McpConfigError with one sentence on anything unusable. Keys other clients add ("autoApprove",
    "timeout", ...) are ignored, so their configs paste in unchanged; "disabled": true is kept.
    """
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except McpConfigError:
        raise
    except json.JSONDecodeError as e:
        raise McpConfigError(
            f"The MCP configuration is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}."
        ) from None
    if not isinstance(data, dict):
        raise McpConfigError(
            'The MCP configuration must be a JSON object, like {"mcpServers": {"name": {"command": "..."}}}.'
        )
    if "mcpServers" in data:
        servers = data["mcpServers"]
        if not isinstance(servers, dict):
            raise McpConfigError('"mcpServers" must be a JSON object mapping each server\'s name to its settings.')
    else:
        if "command" in data or "url" in data:
            raise McpConfigError(
                'This looks like one server\'s settings; give it a name, as in {"mcpServers": {"name": {...}}}.'
            )
        servers = data
    specs = [_parse_entry(name, entry) for name, entry in servers.items()]
    seen: set[str] = set()
    for spec in specs:  # names are trimmed, so "a" and " a " would be the same server twice
        if spec.name in seen:
            raise McpConfigError(f'The MCP configuration names "{spec.name}" twice.')
        seen.add(spec.name)
    return specs


def dump_servers(specs: Iterable[ServerSpec]) -> str:
    """The standard `{"mcpServers": {...}}` JSON text for specs; `parse_servers` reads it back equal."""
    return json.dumps({"mcpServers": {s.name: s.to_dict() for s in specs}}, indent=2, ensure_ascii=False)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys silently; two servers with one name is a mistake to report.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise McpConfigError(f'The MCP configuration names "{key}" twice in one object.')
        out[key] = value
    return out


def _parse_entry(name: Any, entry: Any) -> ServerSpec:
    if not isinstance(name, str) or not name.strip():
        raise McpConfigError("Every MCP server needs a non-empty name.")
    name = name.strip()
    if not isinstance(entry, dict):
        raise McpConfigError(f'The settings of MCP server "{name}" must be a JSON object.')
    has_command, has_url = "command" in entry, "url" in entry
    if has_command and has_url:
        raise McpConfigError(f'MCP server "{name}" has both a "command" and a "url"; give only one.')
    if not has_command and not has_url:
        raise McpConfigError(
            f'MCP server "{name}" needs a "command" (a program to run) or a "url" (a server to connect to).'
        )
    kind = entry.get("type", entry.get("transport"))
    if kind is not None:
        if not isinstance(kind, str):
            raise McpConfigError(f'The "type" of MCP server "{name}" must be a string.')
        k = kind.lower()
        if k == "sse":
            raise McpConfigError(
                f'MCP server "{name}" uses the old SSE transport, which is not supported; use its Streamable '
                "HTTP endpoint (usually ending in /mcp) instead."
            )
        if k not in _STDIO_TYPES | _HTTP_TYPES:
            raise McpConfigError(f'MCP server "{name}" has an unknown "type" "{kind}"; use "stdio" or "http".')
        if (k in _STDIO_TYPES) != has_command:
            raise McpConfigError(
                f'MCP server "{name}" has "type" "{kind}" but a "{"url" if has_url else "command"}"; they disagree.'
            )
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        raise McpConfigError(f'"disabled" of MCP server "{name}" must be true or false.')

    if has_command:
        for key in ("headers",):
            if key in entry:
                raise McpConfigError(f'MCP server "{name}" runs a command, so "{key}" does not apply to it.')
        command = entry["command"]
        if not isinstance(command, str) or not command.strip():
            raise McpConfigError(f'The "command" of MCP server "{name}" must be a non-empty string.')
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpConfigError(f'The "args" of MCP server "{name}" must be a list of strings.')
        env = _string_map(entry.get("env", {}), name, "env")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise McpConfigError(f'The "cwd" of MCP server "{name}" must be a string.')
        return ServerSpec(name=name, command=command, args=tuple(args), env=env, cwd=cwd or None, disabled=disabled)

    for key in ("args", "env", "cwd"):
        if key in entry:
            raise McpConfigError(f'MCP server "{name}" connects to a url, so "{key}" does not apply to it.')
    url = entry["url"]
    if not isinstance(url, str) or not url.strip():
        raise McpConfigError(f'The "url" of MCP server "{name}" must be a non-empty string.')
    url = url.strip()
    try:
        parts = urlsplit(url)
        ok = parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise McpConfigError(f'The "url" of MCP server "{name}" must be an http:// or https:// address, not "{url}".')
    headers = _string_map(entry.get("headers", {}), name, "headers")
    return ServerSpec(name=name, url=url, headers=headers, disabled=disabled)


def _string_map(value: Any, name: str, key: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise McpConfigError(f'The "{key}" of MCP server "{name}" must be an object of string values.')
    return dict(value)
