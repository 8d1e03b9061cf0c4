"""The window's MCP host: tools from MCP servers, offered to the model in OpenAI's format. No Qt here.

`McpHost` runs one background thread with an asyncio loop that owns every server's session (stdio servers as
child processes through the SDK's stdio client, remote ones through its Streamable HTTP client), started from
the `ServerSpec`s that app/mcp_config.py reads. Nothing a server does (failing to start, hanging before it is
ready, dying, hanging inside a call) can block the caller's thread, another server, or `close()`; it shows up
in `status()` and in `ToolResult`s instead.

Threading: every public method may be called from any thread. Results come back as
`concurrent.futures.Future`s; `on_change` is called on the host's own thread, so a Qt caller should emit a
signal from it (a queued connection brings it to the GUI thread) rather than touch widgets.

Written against the mcp SDK 2.x (`mcp.client.stdio.stdio_client`, `mcp.client.streamable_http.
streamable_http_client`, `mcp.ClientSession`).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import contextvars
import copy
import hashlib
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

from .mcp_config import ServerSpec

log = logging.getLogger(__name__)

# The name OpenAI (and every client that copies its API) accepts for a function.
TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_UNSAFE_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_-]")

DEFAULT_INIT_TIMEOUT = 10.0
DEFAULT_CALL_TIMEOUT = 60.0
# A model that loops can emit megabytes of arguments; a server should not be asked to parse them.
MAX_ARGUMENT_BYTES = 256 * 1024
# A result goes back into the model's context; past this it is cut, with a note the model can read.
MAX_RESULT_CHARS = 64 * 1024
# After close() closes a stdio server's stdin, how long it has to exit before it is killed.
_POLITE_EXIT_SECONDS = 1.5
# After a call's timeout, how long the cancellation may take to reach the server before the caller is answered.
_CANCEL_GRACE_SECONDS = 1.0
_MAX_TOOL_PAGES = 50


# ---------------------------------------------------------------------------------------------------------------
# Results and status


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave, as text for the model. is_error: the tool, its server or the host failed."""

    text: str
    is_error: bool
    seconds: float


class ServerStatus(NamedTuple):
    """One server's state: "starting", "ok" (message: how many tools), "error" (message: why), "disabled"."""

    name: str
    state: Literal["starting", "ok", "error", "disabled"]
    message: str

    @property
    def ok(self) -> bool:
        return self.state == "ok"


@dataclass(frozen=True)
class _ToolEntry:
    server: str
    tool: str
    openai: dict[str, Any]


def openai_tool_name(server: str, tool: str, taken: set[str]) -> str:
    """`server__tool` made safe for OpenAI's `^[a-zA-Z0-9_-]{1,64}$` and unique among `taken` (not added to it)."""
    base = f"{_UNSAFE_NAME_CHARS.sub('_', server)}__{_UNSAFE_NAME_CHARS.sub('_', tool)}"
    if len(base) > 64:
        # A hash of the full name keeps two long names that share a 55-character prefix apart.
        digest = hashlib.sha1(f"{server}\0{tool}".encode()).hexdigest()[:8]
        base = f"{base[:55]}_{digest}"
    name, n = base, 2
    while name in taken:
        suffix = f"_{n}"
        name = base[: 64 - len(suffix)] + suffix
        n += 1
    return name


# ---------------------------------------------------------------------------------------------------------------
# The host


# The SDK's stdio client keeps its child process to itself; the host needs it to kill a hung server at once
# (not after the SDK's 2 s + 2 s TERM/KILL escalation) and to say how it exited. Each server's task sets this
# to its own list, and the wrapper below appends what it spawned, so concurrent spawns are never confused.
_spawned: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("mcp_host_spawned", default=None)


def _install_spawn_hook() -> None:
    import mcp.client.stdio as stdio

    original = getattr(stdio, "_create_platform_compatible_process", None)
    if original is None or getattr(original, "_mcp_host_hook", False):
        return  # another SDK layout: the host still works, only without fast kills and exit statuses

    async def hooked(*args: Any, **kwargs: Any) -> Any:
        process = await original(*args, **kwargs)
        sink = _spawned.get()
        if sink is not None:
            sink.append(process)
        return process

    hooked._mcp_host_hook = True  # type: ignore[attr-defined]
    stdio._create_platform_compatible_process = hooked


def _kill_process_tree(pid: int) -> None:
    # The SDK starts each server in a new session, so its process group is its pid: this takes npx's children too.
    try:
        if sys.platform != "win32":
            os.killpg(pid, signal.SIGKILL)
        else:  # pragma: no cover
            os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError, OSError):
        pass


class _Server:
    """Loop-thread state for one server."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.state: Literal["starting", "ok", "error", "disabled"] = "disabled" if spec.disabled else "starting"
        self.message = "disabled" if spec.disabled else "starting"
        self.tools: list[Any] = []
        self.session: Any = None
        self.processes: list[Any] = []
        self.errlog: Any = None
        self.stopping = False
        self.wake: asyncio.Event = asyncio.Event()
        self.ready: asyncio.Event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.relists: set[asyncio.Task[None]] = set()  # held so the loop does not drop them mid-flight

    @property
    def process(self) -> Any:
        return self.processes[0] if self.processes else None

    def kill(self) -> None:
        p = self.process
        if p is not None and p.returncode is None:
            _kill_process_tree(p.pid)

    def stderr_tail(self, limit: int = 400) -> str:
        """The last lines the server wrote to stderr, for a failure message (a traceback's last line, say)."""
        if self.errlog is None:
            return ""
        try:
            fd = self.errlog.fileno()
            size = os.fstat(fd).st_size
            # pread, not seek+read: the child shares this file's offset, and moving it would misplace its writes.
            raw = os.pread(fd, 4096, max(0, size - 4096))
        except (OSError, ValueError, AttributeError):
            return ""
        lines = [ln.strip() for ln in raw.decode("utf-8", "replace").splitlines() if ln.strip()]
        tail = " | ".join(lines[-3:])
        return tail[-limit:]


class McpHost:
    """Connects to MCP servers on a thread of its own and runs their tools for the model.

    start(specs) -> Future of the statuses once every server is up or has failed; tools() -> OpenAI tools;
    call(name, arguments) -> Future[ToolResult]; status(); close(). Safe to call from any thread.
    """

    def __init__(
        self,
        *,
        init_timeout: float = DEFAULT_INIT_TIMEOUT,
        max_argument_bytes: int = MAX_ARGUMENT_BYTES,
        max_result_chars: int = MAX_RESULT_CHARS,
        on_change: Callable[[], None] | None = None,
        client_name: str = "Eddy",
    ) -> None:
        self.init_timeout = init_timeout
        self.max_argument_bytes = max_argument_bytes
        self.max_result_chars = max_result_chars
        self._on_change = on_change
        self._client_name = client_name
        self._lock = threading.Lock()  # guards the published snapshots and the thread handle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Loop-thread state.
        self._servers: list[_Server] = []
        # Snapshots for the caller's thread, replaced whole by _publish (never mutated in place).
        self._status: tuple[ServerStatus, ...] = ()
        self._table: dict[str, _ToolEntry] = {}
        self._pids: set[int] = set()

    # -- public API ---------------------------------------------------------------------------------------------

    def start(self, specs: Iterable[ServerSpec]) -> concurrent.futures.Future[list[ServerStatus]]:
        """Connect to every enabled server (stopping any started before), in the background.

        The future resolves once each has either listed its tools or failed (at most about init_timeout);
        it never raises for a server's failure, which is in the statuses instead.
        """
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("two MCP servers share a name")
        loop = self._ensure_loop()
        if loop is None:
            return _done([])
        return asyncio.run_coroutine_threadsafe(self._start(specs), loop)

    def status(self) -> list[ServerStatus]:
        with self._lock:
            return list(self._status)

    def tools(self) -> list[dict[str, Any]]:
        """Every ready server's tools as OpenAI function tools, with names unique and OpenAI-safe."""
        with self._lock:
            return [copy.deepcopy(e.openai) for e in self._table.values()]

    def resolve(self, name: str) -> tuple[str, str] | None:
        """(server name, tool name) behind an OpenAI tool name from tools(), or None."""
        with self._lock:
            entry = self._table.get(name)
        return (entry.server, entry.tool) if entry else None

    def call(
        self, name: str, arguments: Mapping[str, Any] | None, timeout: float = DEFAULT_CALL_TIMEOUT
    ) -> concurrent.futures.Future[ToolResult]:
        """Run the tool called `name` (a name from tools()) with `arguments`, on the host's thread.

        Always resolves to a ToolResult, never an exception: a failure of any kind is a result with
        is_error True whose text says what happened, for the model to read. cancel() on the future
        cancels the call on the server too.
        """
        started = time.monotonic()

        def refuse(text: str) -> concurrent.futures.Future[ToolResult]:
            return _done(ToolResult(text, True, time.monotonic() - started))

        if self._closed:
            return refuse(f"The tool {name} is not available: the MCP host has been closed.")
        with self._lock:
            entry = self._table.get(name)
            loop = self._loop
        if entry is None or loop is None:
            return refuse(f"There is no tool called {name}.")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return refuse(f"The arguments for {name} must be a JSON object, not {type(arguments).__name__}.")
        try:
            encoded = json.dumps(arguments, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            return refuse(f"The arguments for {name} are not JSON: {e}.")
        if len(encoded) > self.max_argument_bytes:
            return refuse(
                f"The arguments for {name} are {len(encoded)} bytes of JSON, over the limit of "
                f"{self.max_argument_bytes} bytes; the tool was not called."
            )
        try:
            return asyncio.run_coroutine_threadsafe(self._call(entry, dict(arguments), timeout, started), loop)
        except RuntimeError:  # the loop closed between the check and here
            return refuse(f"The tool {name} is not available: the MCP host has been closed.")

    def close(self, timeout: float = 3.0) -> None:
        """Stop every server and the thread, within about `timeout` seconds whatever the servers do.

        Servers get stdin closed (or an HTTP session DELETE) and a moment to exit; a stdio server still
        running after that is killed with its process group.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if threading.current_thread() is thread:
            # Called from on_change, on the host's own thread: waiting here would wait on ourselves.
            async def stop() -> None:
                await self._stop_all(polite=min(_POLITE_EXIT_SECONDS, timeout / 2))
                loop.stop()

            loop.create_task(stop())
            return
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception):
            fut = asyncio.run_coroutine_threadsafe(self._stop_all(polite=min(_POLITE_EXIT_SECONDS, timeout / 2)), loop)
            fut.result(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(max(0.1, deadline - time.monotonic()))
        # Last resort, if the loop could not finish: kill any server process still ours.
        for pid in list(self._pids):
            if _is_our_live_child(pid):
                _kill_process_tree(pid)
        with self._lock:
            self._status, self._table = (), {}

    # -- loop thread --------------------------------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop | None:
        with self._lock:
            if self._closed:
                return None
            if self._loop is None:
                _install_spawn_hook()
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                # Daemon: a window that forgets close() must still be able to exit.
                thread = threading.Thread(target=self._run_loop, args=(loop, ready), name="mcp-host", daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
            # Whatever is left (calls in flight at close) is cancelled, with a bound on how long that may take.
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), 1.0))
        finally:
            with contextlib.suppress(Exception):
                loop.close()

    def _publish(self) -> None:
        """Rebuild the caller-side snapshots from the loop's state and tell the owner."""
        statuses = tuple(ServerStatus(s.spec.name, s.state, s.message) for s in self._servers)
        table: dict[str, _ToolEntry] = {}
        for s in self._servers:
            if s.state != "ok":
                continue
            for tool in s.tools:
                safe = openai_tool_name(s.spec.name, tool.name, set(table))
                table[safe] = _ToolEntry(s.spec.name, tool.name, _openai_tool(safe, s.spec.name, tool))
        with self._lock:
            self._status, self._table = statuses, table
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:
                log.exception("MCP host on_change callback raised")

    async def _start(self, specs: list[ServerSpec]) -> list[ServerStatus]:
        await self._stop_all(polite=_POLITE_EXIT_SECONDS)
        if self._closed:
            return []
        self._servers = [_Server(spec) for spec in specs]
        self._publish()
        for srv in self._servers:
            if srv.state == "starting":
                srv.task = asyncio.create_task(self._run_server(srv), name=f"mcp:{srv.spec.name}")
            else:
                srv.ready.set()
        await asyncio.gather(*(s.ready.wait() for s in self._servers))
        return [ServerStatus(s.spec.name, s.state, s.message) for s in self._servers]

    async def _stop_all(self, polite: float) -> None:
        servers, self._servers = self._servers, []
        tasks = [s.task for s in servers if s.task is not None and not s.task.done()]
        for s in servers:
            s.stopping = True
            s.wake.set()
        if tasks:
            # Stdin closed (by the SDK, on leaving the session) is a server's cue to exit; most do at once.
            _, pending = await asyncio.wait(tasks, timeout=polite)
            if pending:
                for s in servers:
                    s.kill()
                _, pending = await asyncio.wait(pending, timeout=1.0)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=0.5)
        self._publish()

    async def _run_server(self, srv: _Server) -> None:
        import anyio
        from mcp import ClientSession
        from mcp.shared.exceptions import MCPError

        _spawned.set(srv.processes)
        spec = srv.spec
        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await self._open_transport(srv, stack)
                for p in srv.processes:
                    self._pids.add(p.pid)
                # The session reads through this pump so the host learns when the server's stream ends (the
                # process died, the connection dropped): the SDK only tells calls in flight, not the owner.
                pumped_send, pumped_recv = anyio.create_memory_object_stream[Any](0)
                lost = asyncio.Event()
                pump_scope = anyio.CancelScope()
                tg = await stack.enter_async_context(anyio.create_task_group())
                tg.start_soon(_pump, read, pumped_send, lost, srv.wake, pump_scope)
                stack.callback(pump_scope.cancel)  # runs before the task group's exit waits on the pump
                from mcp.types import Implementation

                session = await stack.enter_async_context(
                    ClientSession(
                        pumped_recv,
                        write,
                        client_info=Implementation(name=self._client_name, version="1"),
                        message_handler=partial(self._on_server_message, srv),
                    )
                )
                try:
                    with anyio.fail_after(self.init_timeout):
                        await session.initialize()
                        tools = await _list_all_tools(session)
                except TimeoutError:
                    srv.kill()  # a server that hangs now is not worth the SDK's polite shutdown
                    self._fail(srv, f"did not finish starting within {self.init_timeout:g} s" + _tail(srv))
                    raise _InitFailure from None
                except MCPError as e:
                    await _settle(srv)
                    self._fail(srv, _ended_message(srv, f"failed to start: {e.error.message}"))
                    raise _InitFailure from None
                srv.session, srv.tools = session, tools
                srv.state, srv.message = "ok", _count(tools)
                self._publish()
                srv.ready.set()
                while not srv.stopping and not lost.is_set():
                    srv.wake.clear()
                    await srv.wake.wait()
                srv.session = None
                if not srv.stopping:
                    await _settle(srv)
                    srv.state, srv.message = "error", _ended_message(srv, "the connection closed")
                    self._publish()
        except BaseException as e:  # noqa: BLE001 - one server's failure is a status, never the host's crash
            # anyio's task groups may wrap what was raised inside them in an ExceptionGroup.
            leaf = _first_leaf(e)
            if isinstance(leaf, (KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(leaf, _InitFailure):
                pass  # recorded (and published) before the unwinding, which can take a moment
            elif isinstance(leaf, asyncio.CancelledError) or isinstance(e, asyncio.CancelledError):
                if not srv.stopping:
                    srv.state, srv.message = "error", "cancelled"
                raise
            elif srv.state == "starting":
                srv.state, srv.message = "error", _describe_start_error(spec, e) + _tail(srv)
            elif not srv.stopping:
                srv.state, srv.message = "error", f"failed: {_leaf(e)}"
        finally:
            srv.session = None
            for p in srv.processes:
                if p.returncode is not None:
                    self._pids.discard(p.pid)
            if srv.errlog is not None:
                with contextlib.suppress(Exception):
                    srv.errlog.close()
            srv.ready.set()
            if not srv.stopping and srv in self._servers:
                self._publish()

    async def _on_server_message(self, srv: _Server, message: Any) -> None:
        from mcp.types import ToolListChangedNotification

        if isinstance(message, ToolListChangedNotification) and srv.session is not None:
            # In a task of its own: this handler runs on the session's receive path, and the new list's answer
            # has to come in through that same path.
            task = asyncio.create_task(self._relist(srv))
            srv.relists.add(task)
            task.add_done_callback(srv.relists.discard)

    async def _relist(self, srv: _Server) -> None:
        session = srv.session
        try:
            tools = await asyncio.wait_for(_list_all_tools(session), self.init_timeout)
        except Exception:  # a failed refresh keeps the old list; the server's next notification tries again
            log.warning("MCP server %r: listing its changed tools failed", srv.spec.name, exc_info=True)
            return
        if srv.session is session and srv.state == "ok":
            srv.tools = tools
            srv.message = _count(tools)
            self._publish()

    def _fail(self, srv: _Server, message: str) -> None:
        srv.state, srv.message = "error", message
        if not srv.stopping and srv in self._servers:
            self._publish()
        srv.ready.set()

    async def _open_transport(self, srv: _Server, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        spec = srv.spec
        if spec.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            # The server's stderr goes to a private file: its tail explains a failed start, and a chatty
            # server does not scribble over the app's own terminal output.
            srv.errlog = tempfile.TemporaryFile()
            params = StdioServerParameters(
                command=spec.command, args=list(spec.args), env=dict(spec.env) or None, cwd=spec.cwd
            )
            return await stack.enter_async_context(stdio_client(params, errlog=srv.errlog))
        from mcp.client.streamable_http import streamable_http_client

        try:  # the SDK's own client: its default timeouts suit a long-lived event stream
            from mcp.shared._httpx_utils import create_mcp_http_client
        except ImportError:  # pragma: no cover - a later SDK that moved it
            import httpx2

            def create_mcp_http_client(headers: dict[str, str] | None = None) -> Any:
                return httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))

        client = await stack.enter_async_context(create_mcp_http_client(headers=dict(spec.headers) or None))
        return await stack.enter_async_context(streamable_http_client(spec.url, http_client=client))

    async def _call(self, entry: _ToolEntry, arguments: dict[str, Any], timeout: float, started: float) -> ToolResult:
        inner = asyncio.ensure_future(self._call_inner(entry, arguments))
        try:
            # asyncio.wait, not wait_for: the answer must come at the timeout even if the cancellation below is
            # slow to get through (a frozen server's full pipe, say).
            await asyncio.wait({inner}, timeout=timeout)
        except asyncio.CancelledError:
            inner.cancel()  # the caller's future.cancel(): the SDK tells the server (notifications/cancelled)
            with contextlib.suppress(BaseException):
                await asyncio.wait({inner}, timeout=_CANCEL_GRACE_SECONDS)
            raise
        elapsed = time.monotonic() - started
        if not inner.done():
            inner.cancel()
            await asyncio.wait({inner}, timeout=_CANCEL_GRACE_SECONDS)
            return ToolResult(
                f"The tool {entry.tool} on MCP server \"{entry.server}\" timed out after {timeout:g} s "
                "and was cancelled.",
                True,
                time.monotonic() - started,
            )
        try:
            text, is_error = inner.result()
        except asyncio.CancelledError:
            text, is_error = f"The call to {entry.tool} was cancelled.", True
        return ToolResult(text, is_error, elapsed)

    async def _call_inner(self, entry: _ToolEntry, arguments: dict[str, Any]) -> tuple[str, bool]:
        from mcp.shared.exceptions import MCPError

        srv = next((s for s in self._servers if s.spec.name == entry.server), None)
        if srv is None or srv.session is None:
            why = srv.message if srv is not None else "it is no longer configured"
            return f'MCP server "{entry.server}" is not running ({why}), so {entry.tool} could not be called.', True
        try:
            result = await srv.session.call_tool(entry.tool, arguments)
        except MCPError as e:
            if srv.stopping:
                return f'MCP server "{entry.server}" was shut down during the call to {entry.tool}.', True
            if srv.session is None or srv.state != "ok" or _is_connection_closed(e):
                await _settle(srv)
                how = _ended_message(srv, "the connection closed")
                return f'MCP server "{entry.server}" stopped during the call to {entry.tool} ({how}).', True
            return f'MCP server "{entry.server}" refused the call to {entry.tool}: {e.error.message}', True
        except Exception as e:  # a malformed result, a schema mismatch, a transport error
            return f'Calling {entry.tool} on MCP server "{entry.server}" failed: {_leaf(e)}', True
        text = _result_text(result)
        if len(text) > self.max_result_chars:
            cut = len(text) - self.max_result_chars
            text = (
                text[: self.max_result_chars]
                + f"\n[{cut} more characters cut: the result was {len(text)} characters, over the limit of "
                f"{self.max_result_chars}]"
            )
        return text, bool(getattr(result, "is_error", False))


def _count(tools: list[Any]) -> str:
    return f"{len(tools)} tool{'s' if len(tools) != 1 else ''}"


class _InitFailure(Exception):
    pass


async def _pump(src: Any, dst: Any, lost: asyncio.Event, wake: asyncio.Event, scope: Any) -> None:
    import anyio

    with scope:
        try:
            async with dst:
                async for item in src:
                    await dst.send(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream):
            pass
    lost.set()
    wake.set()


async def _list_all_tools(session: Any) -> list[Any]:
    from mcp.types import PaginatedRequestParams

    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(_MAX_TOOL_PAGES):  # a server whose cursor never ends must not hang the start
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


async def _settle(srv: _Server, seconds: float = 0.5) -> None:
    """Give a dying stdio server a moment to be reaped, so its exit status can be reported."""
    p = srv.process
    deadline = time.monotonic() + seconds
    while p is not None and p.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _ended_message(srv: _Server, fallback: str) -> str:
    p = srv.process
    if p is not None and p.returncode is not None:
        code = p.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return how + _tail(srv)
    return fallback + _tail(srv)


def _tail(srv: _Server) -> str:
    tail = srv.stderr_tail()
    return f" (stderr: {tail})" if tail else ""


def _describe_start_error(spec: ServerSpec, e: BaseException) -> str:
    leaf = _first_leaf(e)
    if isinstance(leaf, FileNotFoundError) and spec.command is not None:
        return f'could not start "{spec.command}": no such program'
    if isinstance(leaf, PermissionError) and spec.command is not None:
        return f'could not start "{spec.command}": permission denied'
    if isinstance(leaf, OSError) and spec.command is not None:
        return f'could not start "{spec.command}": {leaf.strerror or leaf}'
    if spec.url is not None:
        return f"could not connect to {spec.url}: {_leaf(e)}"
    return f"failed to start: {_leaf(e)}"


def _first_leaf(e: BaseException) -> BaseException:
    # anyio task groups wrap failures in ExceptionGroups; the first real one is the story.
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _leaf(e: BaseException) -> str:
    leaf = _first_leaf(e)
    text = str(leaf).strip()
    return f"{type(leaf).__name__}: {text}" if text else type(leaf).__name__


def _is_connection_closed(e: Any) -> bool:
    try:
        from mcp.types import CONNECTION_CLOSED
    except ImportError:  # pragma: no cover
        CONNECTION_CLOSED = -32000
    return getattr(getattr(e, "error", None), "code", None) == CONNECTION_CLOSED


def _is_our_live_child(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.ppid() == os.getpid() and p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def _openai_tool(safe: str, server: str, tool: Any) -> dict[str, Any]:
    schema = copy.deepcopy(tool.input_schema) if isinstance(tool.input_schema, dict) else {}
    # OpenAI wants an object schema with properties; MCP allows a bare {} for a tool without arguments.
    schema.setdefault("type", "object")
    if schema.get("type") == "object":
        schema.setdefault("properties", {})
    description = tool.description or getattr(tool, "title", None) or f"{tool.name} (from MCP server {server})"
    return {"type": "function", "function": {"name": safe, "description": description, "parameters": schema}}


def _b64_size(data: str) -> int:
    try:
        return len(base64.b64decode(data, validate=False))
    except (binascii.Error, ValueError):
        return len(data) * 3 // 4


def _result_text(result: Any) -> str:
    """The result's content as text: text kept, everything else described in words the model can use."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.mime_type}, {_b64_size(block.data)} bytes]")
        elif kind == "resource_link":
            label = getattr(block, "name", None) or ""
            parts.append(f"[resource link: {block.uri}{' (' + label + ')' if label else ''}]")
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            if text is not None:
                parts.append(f"[resource: {res.uri}]\n{text}")
            else:
                mime = getattr(res, "mime_type", None) or "binary"
                parts.append(f"[resource: {res.uri}, {mime}, {_b64_size(getattr(res, 'blob', ''))} bytes]")
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


def _done(value: Any) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut
