"""A small MCP server for tests/test_mcp_host.py, built on the mcp SDK's MCPServer.

Usage: python mcp_echo_server.py [--hang | --exit] [--http] [--stubborn] [--log PATH] [--name NAME]

  (default)   serve over stdio
  --http      serve Streamable HTTP on a free loopback port; the first stdout line is "PORT <n>"
  --hang      never answer initialize (sleep before serving)
  --exit      exit with status 3 at once, before serving
  --stubborn  ignore SIGTERM, so only SIGKILL stops it (for close() with a hung server)
  --log PATH  append one line per tool event ("slow start", "slow cancelled", ...) for the tests to read
"""
from __future__ import annotations

import argparse
import base64
import signal
import socket
import sys
import time

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent, TextContent

_log_path: str | None = None


def _log(event: str) -> None:
    if _log_path:
        with open(_log_path, "a", encoding="utf-8") as f:
            f.write(event + "\n")


def build(name: str) -> MCPServer:
    server = MCPServer(name, log_level="WARNING")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep for the given number of seconds, then say so."""
        _log("slow start")
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            _log("slow cancelled")
            raise
        _log("slow done")
        return f"slept {seconds} s"

    @server.tool()
    async def hang() -> str:
        """Never answer (a tool whose server has hung, for the window's timeout)."""
        _log("hang start")
        await anyio.sleep_forever()
        return "never"

    @server.tool()
    async def freeze(seconds: float) -> str:
        """Block the whole server (its event loop) for the given number of seconds."""
        _log("freeze start")
        time.sleep(seconds)
        return "thawed"

    @server.tool()
    def big(n: int) -> str:
        """Return n characters of text."""
        return "x" * n

    @server.tool()
    def fail(message: str) -> str:
        """Raise an error with the given message."""
        raise ToolError(message)

    @server.tool()
    async def grow(name: str, ctx: Context) -> str:
        """Add a tool called `name` (it answers "grown") and tell the client the tool list changed."""

        def grown() -> str:
            return "grown"

        server.add_tool(grown, name=name, description="Added at run time.")
        await ctx.session.send_tool_list_changed()
        return f"added {name}"

    @server.tool()
    def picture() -> list[TextContent | ImageContent]:
        """Return a caption and a small PNG-typed image."""
        data = base64.b64encode(b"\x89PNG" + b"\0" * 96).decode()
        return [
            TextContent(type="text", text="a picture"),
            ImageContent(type="image", data=data, mime_type="image/png"),
        ]

    return server


def _serve_http(server: MCPServer) -> None:
    import uvicorn

    # Bind port 0 here and report the port, so the test never races another process for a port.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = server.streamable_http_app(host="127.0.0.1")
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    print(f"PORT {port}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


def main() -> None:
    global _log_path
    parser = argparse.ArgumentParser()
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--exit", action="store_true")
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--stubborn", action="store_true")
    parser.add_argument("--log")
    parser.add_argument("--name", default="echo")
    args = parser.parse_args()
    _log_path = args.log
    if args.stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.exit:
        print("echo server: exiting at once as asked", file=sys.stderr, flush=True)
        sys.exit(3)
    if args.hang:
        _log("hang")
        while True:
            time.sleep(3600)
    server = build(args.name)
    if args.http:
        _serve_http(server)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
