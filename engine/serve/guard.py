"""What keeps a web page from driving the local server: a Host allow-list (DNS rebinding) and an Origin check
(cross-site requests), as llama.cpp's server and Ollama do it.

A page in the user's browser can send a "simple" POST to 127.0.0.1 with no preflight, and after rebinding a name
it controls to 127.0.0.1 it can read the replies too. Browsers always send Origin on such requests and the Host
they think they reach; programs (the openai client, curl) send no Origin and the address they dialled. So a request
naming a Host this server does not answer to, or an Origin the user has not allowed, is refused before any route
runs. Written as a small ASGI middleware rather than Starlette's TrustedHostMiddleware so that the refusal is an
OpenAI-shaped JSON error like every other one.
"""
from __future__ import annotations

import ipaddress
import json
from typing import Any, Awaitable, Callable, Iterable

from starlette.datastructures import Headers

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY = "*"

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def is_wildcard(host: str) -> bool:
    """Whether `--host` listens on every interface: the server is then reached by names it cannot list."""
    return host in ("", "0.0.0.0", "::")


def allowed_hosts(listen: str) -> frozenset[str] | None:
    """The Host names a server listening on `listen` answers to; None for any (every interface: its API key,
    which such a server must have, is what keeps pages out)."""
    if is_wildcard(listen):
        return None
    return LOOPBACK_NAMES | {listen.strip("[]").lower()}


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8080" -> "::1", "Localhost:80" -> "localhost"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        return header.split(":")[0]
    try:
        return str(ipaddress.ip_address(header))
    except ValueError:
        return header


class BrowserGuard:
    def __init__(self, app: ASGIApp, hosts: Iterable[str] | None, origins: Iterable[str]) -> None:
        self.app = app
        self.hosts = None if hosts is None else frozenset(h.lower() for h in hosts)
        self.origins = frozenset(o.rstrip("/").lower() for o in origins)

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        problem = self.refusal(headers.get("host", ""), headers.get("origin"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": problem, "type": "permission_error", "param": None,
                                     "code": None}}).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, host: str, origin: str | None) -> str | None:
        """Why a request is refused, or None."""
        name = host_name(host)
        if self.hosts is not None and name not in self.hosts:
            return (f"this server does not answer to the host {name or '(none)'!r}: it answers to "
                    f"{', '.join(sorted(self.hosts))} (a web page reaching it under another name is refused)")
        if origin is not None and ANY not in self.origins and origin.rstrip("/").lower() not in self.origins:
            return (f"requests from web pages are refused (Origin {origin!r}); to let a web UI you trust use this "
                    f"server, start it with --allow-origin {origin}")
        return None


def cors_options(origins: Iterable[str]) -> dict[str, Any]:
    """Starlette's CORSMiddleware settings that answer preflights for the allowed origins only."""
    listed = [o.rstrip("/") for o in origins]
    return {"allow_origins": ["*"] if ANY in listed else listed, "allow_methods": ["GET", "POST"],
            "allow_headers": ["Authorization", "Content-Type"], "max_age": 600}
