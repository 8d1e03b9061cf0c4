"""app/mcp_host.py against a real MCP server (tests/mcp_echo_server.py) over real stdio and Streamable HTTP."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from app.mcp_config import McpConfigError, ServerSpec, dump_servers, parse_servers
from app.mcp_host import TOOL_NAME_RE, McpHost, ToolResult, openai_tool_name

SERVER = str(Path(__file__).with_name("mcp_echo_server.py"))
ECHO_TOOLS = {"add", "echo", "slow", "hang", "freeze", "big", "fail", "grow", "picture"}


def echo_spec(name: str = "echo", *flags: str) -> ServerSpec:
    # The server is told its name too, so echo_children can tell one test's servers from another's.
    return ServerSpec(name=name, command=sys.executable, args=(SERVER, "--name", name, *flags))


def echo_children(*names: str) -> list[psutil.Process]:
    """This test process's live echo-server children with these names (zombies awaiting a reap do not count)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
            if p.status() == psutil.STATUS_ZOMBIE or not any("mcp_echo_server" in a for a in cmd):
                continue
            if "--name" in cmd and cmd[cmd.index("--name") + 1] in names:
                out.append(p)
        except (psutil.Error, IndexError):
            pass
    return out


def wait_for(predicate, timeout: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def log_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def event_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mcp") / "events.log"


@pytest.fixture(scope="module")
def host(event_log):
    """One host with two echo servers, the second with a name that needs sanitizing for OpenAI."""
    h = McpHost(init_timeout=10)
    statuses = h.start([echo_spec("echo", "--log", str(event_log)), echo_spec("my echo.srv")]).result(timeout=20)
    assert [s.state for s in statuses] == ["ok", "ok"], statuses
    yield h
    h.close()


# ---------------------------------------------------------------------------------------------------------------
# Configuration


def test_parse_standard_config_and_round_trip():
    text = json.dumps({
        "mcpServers": {
            "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                      "env": {"DEBUG": "1"}, "autoApprove": ["read"]},
            "remote": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}},
            "typed": {"type": "http", "url": "http://127.0.0.1:8000/mcp", "disabled": True},
            "local": {"type": "stdio", "command": "uvx", "cwd": "/srv"},
        }
    })
    specs = parse_servers(text)
    assert [s.name for s in specs] == ["files", "remote", "typed", "local"]
    files, remote, typed, local = specs
    assert files.command == "npx" and files.args == ("-y", "@modelcontextprotocol/server-filesystem", "/tmp")
    assert dict(files.env) == {"DEBUG": "1"} and files.transport == "stdio" and files.url is None
    assert remote.url == "https://example.com/mcp" and dict(remote.headers) == {"Authorization": "Bearer x"}
    assert remote.transport == "http" and remote.command is None
    assert typed.disabled and not files.disabled
    assert local.cwd == "/srv" and local.args == ()
    # Round trips: one entry, and the whole file.
    for s in specs:
        assert ServerSpec.from_dict(s.name, s.to_dict()) == s
        assert json.loads(json.dumps(s.to_dict())) == s.to_dict()
    assert parse_servers(dump_servers(specs)) == specs
    assert len({hash(s) for s in specs}) == 4  # hashable despite the dict fields


def test_parse_bare_mapping_and_empty():
    specs = parse_servers('{"a": {"command": "x"}, "b": {"url": "http://localhost:1/mcp"}}')
    assert [(s.name, s.transport) for s in specs] == [("a", "stdio"), ("b", "http")]
    assert parse_servers("{}") == []
    assert parse_servers('{"mcpServers": {}}') == []


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ('["a"]', "must be a JSON object"),
        ('"text"', "must be a JSON object"),
        ('{"mcpServers": []}', '"mcpServers" must be a JSON object'),
        ('{"command": "npx", "args": []}', "give it a name"),
        ('{"s": {"command": "a", "url": "http://x/mcp"}}', 'both a "command" and a "url"'),
        ('{"s": {"args": ["x"]}}', 'needs a "command"'),
        ('{"s": "npx"}', "must be a JSON object"),
        ('{"s": {"command": ""}}', '"command" of MCP server "s" must be a non-empty string'),
        ('{"s": {"command": 5}}', '"command" of MCP server "s"'),
        ('{"s": {"command": "a", "args": "x y"}}', '"args" of MCP server "s" must be a list of strings'),
        ('{"s": {"command": "a", "args": ["x", 1]}}', '"args" of MCP server "s" must be a list of strings'),
        ('{"s": {"command": "a", "env": {"K": 1}}}', '"env" of MCP server "s"'),
        ('{"s": {"command": "a", "env": ["K=1"]}}', '"env" of MCP server "s"'),
        ('{"s": {"command": "a", "headers": {}}}', '"headers" does not apply'),
        ('{"s": {"url": "ftp://host/mcp"}}', "http:// or https://"),
        ('{"s": {"url": "localhost:8000/mcp"}}', "http:// or https://"),
        ('{"s": {"url": "http://"}}', "http:// or https://"),
        ('{"s": {"url": 8000}}', '"url" of MCP server "s"'),
        ('{"s": {"url": "http://h/mcp", "headers": {"A": true}}}', '"headers" of MCP server "s"'),
        ('{"s": {"url": "http://h/mcp", "args": []}}', '"args" does not apply'),
        ('{"s": {"type": "sse", "url": "http://h/sse"}}', "SSE transport"),
        ('{"s": {"type": "stdio", "url": "http://h/mcp"}}', "disagree"),
        ('{"s": {"type": "carrier-pigeon", "command": "a"}}', 'unknown "type"'),
        ('{"s": {"command": "a", "disabled": "yes"}}', '"disabled"'),
        ('{"": {"command": "a"}}', "non-empty name"),
        ('{"mcpServers": {"s": {"command": "a"}, "s": {"command": "b"}}}', 'names "s" twice'),
        ('{"mcpServers": {"s": {"command": "a"}, " s ": {"command": "b"}}}', 'names "s" twice'),
    ],
)
def test_parse_rejects_with_one_clear_sentence(text, words):
    with pytest.raises(McpConfigError) as info:
        parse_servers(text)
    message = str(info.value)
    assert words in message
    assert isinstance(info.value, ValueError)
    assert "\n" not in message and message.endswith(".")


def test_openai_tool_names_are_safe_and_unique():
    taken: set[str] = set()
    names = []
    for server, tool in [("my server", "read.file"), ("my_server", "read_file"), ("ünï cödé", "tööl"),
                         ("s" * 70, "t" * 70), ("s" * 70, "t" * 69 + "u"), ("a", "b")]:
        name = openai_tool_name(server, tool, taken)
        taken.add(name)
        names.append(name)
    assert all(TOOL_NAME_RE.match(n) for n in names), names
    assert len(set(names)) == len(names)
    assert names[0] == "my_server__read_file" and names[1] == "my_server__read_file_2"
    assert names[5] == "a__b"


# ---------------------------------------------------------------------------------------------------------------
# A working host


def test_tools_in_openai_format_with_unique_safe_names(host):
    tools = host.tools()
    names = [t["function"]["name"] for t in tools]
    assert len(tools) == 2 * len(ECHO_TOOLS)
    assert len(set(names)) == len(names)
    assert all(TOOL_NAME_RE.match(n) for n in names), names
    assert {n for n in names if n.startswith("echo__")} == {f"echo__{t}" for t in ECHO_TOOLS}
    assert {n for n in names if n.startswith("my_echo_srv__")} == {f"my_echo_srv__{t}" for t in ECHO_TOOLS}
    for t in tools:
        assert t["type"] == "function" and set(t["function"]) == {"name", "description", "parameters"}
        assert t["function"]["parameters"]["type"] == "object"
        assert isinstance(t["function"]["parameters"]["properties"], dict)
    add = next(t for t in tools if t["function"]["name"] == "echo__add")
    assert add["function"]["description"] == "Add two integers."
    assert set(add["function"]["parameters"]["properties"]) == {"a", "b"}
    assert host.resolve("my_echo_srv__add") == ("my echo.srv", "add")
    assert host.resolve("nope__add") is None
    assert [(s.name, s.state, s.message, s.ok) for s in host.status()] == [
        ("echo", "ok", f"{len(ECHO_TOOLS)} tools", True), ("my echo.srv", "ok", f"{len(ECHO_TOOLS)} tools", True)]


def test_add_returns_5(host):
    result = host.call("echo__add", {"a": 2, "b": 3}).result(timeout=10)
    assert isinstance(result, ToolResult)
    assert result.text == "5" and not result.is_error
    assert 0 <= result.seconds < 5
    assert host.call("my_echo_srv__add", {"a": -1, "b": 1}).result(timeout=10).text == "0"


def test_text_image_errors_and_limits(host):
    assert host.call("echo__echo", {"text": "héllo\nwörld"}).result(timeout=10).text == "héllo\nwörld"
    pic = host.call("echo__picture", {}).result(timeout=10)
    assert pic.text == "a picture\n[image: image/png, 100 bytes]" and not pic.is_error
    failed = host.call("echo__fail", {"message": "the disk is on fire"}).result(timeout=10)
    assert failed.is_error and "the disk is on fire" in failed.text
    bad_args = host.call("echo__add", {"a": "two"}).result(timeout=10)
    assert bad_args.is_error
    # A long result is cut, with a note saying by how much.
    n = host.max_result_chars + 1000
    big = host.call("echo__big", {"n": n}).result(timeout=10)
    assert not big.is_error and big.text.startswith("x" * host.max_result_chars)
    assert "1000 more characters cut" in big.text and len(big.text) < host.max_result_chars + 200
    # Oversized arguments never reach the server.
    huge = host.call("echo__echo", {"text": "y" * (host.max_argument_bytes + 1)}).result(timeout=1)
    assert huge.is_error and "over the limit" in huge.text and "not called" in huge.text
    unknown = host.call("echo__nonesuch", {}).result(timeout=1)
    assert unknown.is_error and "no tool called echo__nonesuch" in unknown.text
    not_object = host.call("echo__echo", ["x"]).result(timeout=1)  # type: ignore[arg-type]
    assert not_object.is_error and "JSON object" in not_object.text


def test_call_times_out_promptly_and_cancels_on_the_server(host, event_log):
    before = len(log_lines(event_log))
    t0 = time.monotonic()
    result = host.call("echo__slow", {"seconds": 20}, timeout=0.5).result(timeout=10)
    elapsed = time.monotonic() - t0
    assert result.is_error and "timed out after 0.5 s" in result.text and '"echo"' in result.text
    assert elapsed < 2.0, elapsed
    assert wait_for(lambda: log_lines(event_log)[before:] == ["slow start", "slow cancelled"])
    # The session is still good afterwards.
    assert host.call("echo__add", {"a": 1, "b": 1}).result(timeout=10).text == "2"


def test_cancelling_the_future_cancels_the_call(host, event_log):
    before = len(log_lines(event_log))
    future = host.call("echo__slow", {"seconds": 20})
    assert wait_for(lambda: log_lines(event_log)[before:] == ["slow start"])
    assert future.cancel()
    assert future.cancelled()
    # The cancellation reached the server: its sleep was interrupted, not left to run out.
    assert wait_for(lambda: log_lines(event_log)[before:] == ["slow start", "slow cancelled"], timeout=3)
    assert host.call("echo__echo", {"text": "still here"}).result(timeout=10).text == "still here"


def test_concurrent_calls(host):
    futures = [host.call("echo__add", {"a": i, "b": i}) for i in range(20)]
    assert [f.result(timeout=10).text for f in futures] == [str(2 * i) for i in range(20)]


# ---------------------------------------------------------------------------------------------------------------
# Servers that misbehave


def test_server_hanging_at_initialize_is_reported_and_the_other_works(tmp_path):
    # Long enough for the good server to start on a loaded machine; the stuck one is what it bounds.
    h = McpHost(init_timeout=2.5)
    try:
        t0 = time.monotonic()
        statuses = h.start([echo_spec("stuck", "--hang", "--log", str(tmp_path / "hang.log")), echo_spec("good")]
                           ).result(timeout=10)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.5 + 2.0, elapsed
        by_name = {s.name: s for s in statuses}
        assert by_name["stuck"].state == "error" and "within 2.5 s" in by_name["stuck"].message
        assert by_name["good"].ok
        assert h.status() == statuses
        assert log_lines(tmp_path / "hang.log") == ["hang"]  # it did start, and then hung
        assert {t["function"]["name"].split("__")[0] for t in h.tools()} == {"good"}
        assert h.call("good__add", {"a": 2, "b": 3}).result(timeout=10).text == "5"
        # The hung one was killed rather than left behind.
        assert wait_for(lambda: echo_children("stuck") == [], timeout=3)
    finally:
        h.close()


def test_server_that_exits_at_once_or_cannot_start_is_reported():
    h = McpHost(init_timeout=5)
    try:
        missing = ServerSpec(name="missing", command="/no/such/mcp-server-binary")
        statuses = h.start([echo_spec("quitter", "--exit"), missing, echo_spec("fine")]).result(timeout=10)
        by_name = {s.name: s for s in statuses}
        assert by_name["quitter"].state == "error"
        assert "exited with status 3" in by_name["quitter"].message
        assert "exiting at once" in by_name["quitter"].message  # its stderr explains why
        assert by_name["missing"].state == "error" and "no such program" in by_name["missing"].message
        assert by_name["fine"].ok
    finally:
        h.close()


def test_server_dying_is_reported_and_calls_to_it_fail_naming_it():
    changes = threading.Event()
    h = McpHost(on_change=changes.set)
    try:
        assert h.start([echo_spec("mortal")]).result(timeout=10)[0].ok
        (child,) = echo_children("mortal")
        changes.clear()
        child.kill()
        assert wait_for(lambda: h.status()[0].state == "error", timeout=5), h.status()
        assert changes.is_set()
        assert "killed by signal 9" in h.status()[0].message
        assert h.tools() == []
        result = h.call("mortal__add", {"a": 1, "b": 2}).result(timeout=5)
        assert result.is_error and "mortal" in result.text
    finally:
        h.close()


def test_call_in_flight_when_the_server_dies():
    h = McpHost()
    try:
        assert h.start([echo_spec("doomed")]).result(timeout=10)[0].ok
        (child,) = echo_children("doomed")
        future = h.call("doomed__slow", {"seconds": 20})
        time.sleep(0.3)
        child.kill()
        result = future.result(timeout=5)
        assert result.is_error and '"doomed" stopped during the call' in result.text
    finally:
        h.close()


def test_close_is_prompt_and_leaves_no_child(tmp_path):
    h = McpHost()
    assert all(s.ok for s in h.start([echo_spec("a"), echo_spec("b")]).result(timeout=10))
    assert len(echo_children("a", "b")) == 2
    in_flight = h.call("a__slow", {"seconds": 20})
    time.sleep(0.2)
    t0 = time.monotonic()
    h.close()
    assert time.monotonic() - t0 < 3.0
    assert echo_children("a", "b") == []
    assert in_flight.done()
    if not in_flight.cancelled():  # it ends either way, never left hanging; a result says what happened
        assert in_flight.result().is_error
    after = h.call("a__add", {"a": 1, "b": 1}).result(timeout=1)
    assert after.is_error and "closed" in after.text
    h.close()  # twice is fine


def test_close_kills_a_frozen_server_that_ignores_sigterm(tmp_path):
    log = tmp_path / "freeze.log"
    h = McpHost()
    assert h.start([echo_spec("ice", "--stubborn", "--log", str(log))]).result(timeout=10)[0].ok
    h.call("ice__freeze", {"seconds": 60})
    assert wait_for(lambda: log_lines(log) == ["freeze start"])
    t0 = time.monotonic()
    h.close()
    assert time.monotonic() - t0 < 4.0
    assert echo_children("ice") == []


def test_tool_list_changes_are_followed():
    h = McpHost()
    try:
        assert h.start([echo_spec("grower")]).result(timeout=10)[0].ok
        assert h.call("grower__grow", {"name": "sprout"}).result(timeout=10).text == "added sprout"
        assert wait_for(lambda: "grower__sprout" in {t["function"]["name"] for t in h.tools()}, timeout=5)
        assert h.status()[0].message == f"{len(ECHO_TOOLS) + 1} tools"
        assert h.call("grower__sprout", {}).result(timeout=10).text == "grown"
    finally:
        h.close()


def test_close_from_on_change_does_not_deadlock():
    holder: list[McpHost] = []

    def on_change() -> None:
        if any(s.state == "error" for s in holder[0].status()):
            holder[0].close()  # on the host's own thread

    h = McpHost(on_change=on_change)
    holder.append(h)
    assert h.call("x__y", {}).result(timeout=1).is_error  # before start: no tools, an answer all the same
    h.start([echo_spec("quits", "--exit")])
    assert wait_for(lambda: h._thread is not None and not h._thread.is_alive(), timeout=5)
    assert h.call("quits__add", {"a": 1, "b": 1}).result(timeout=1).is_error
    h.close()


def test_restart_replaces_the_servers():
    h = McpHost()
    try:
        assert h.start([echo_spec("first")]).result(timeout=10)[0].ok
        assert h.start([echo_spec("second"), ServerSpec(name="off", command="x", disabled=True)]).result(timeout=10)
        assert [(s.name, s.state) for s in h.status()] == [("second", "ok"), ("off", "disabled")]
        assert {t["function"]["name"].split("__")[0] for t in h.tools()} == {"second"}
        assert h.call("first__add", {"a": 1, "b": 1}).result(timeout=5).is_error
        assert len(echo_children("first", "second")) == 1
    finally:
        h.close()


# ---------------------------------------------------------------------------------------------------------------
# Streamable HTTP


@pytest.fixture()
def http_server(tmp_path):
    log = tmp_path / "http.log"
    proc = subprocess.Popen([sys.executable, SERVER, "--http", "--log", str(log)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp", log, proc
    finally:
        proc.kill()
        proc.wait(timeout=5)
        proc.stdout.close()


def test_streamable_http_server(http_server):
    url, log, proc = http_server
    (spec,) = parse_servers(json.dumps({"mcpServers": {"web": {"url": url, "headers": {"X-Eddy": "1"}}}}))
    h = McpHost(init_timeout=5)
    try:
        assert h.start([spec]).result(timeout=10)[0].ok
        assert {t["function"]["name"] for t in h.tools()} == {f"web__{t}" for t in ECHO_TOOLS}
        assert h.call("web__add", {"a": 2, "b": 3}).result(timeout=10).text == "5"
        t0 = time.monotonic()
        slow = h.call("web__slow", {"seconds": 20}, timeout=0.5).result(timeout=10)
        assert slow.is_error and "timed out after 0.5 s" in slow.text and time.monotonic() - t0 < 2.0
        assert wait_for(lambda: log_lines(log) == ["slow start", "slow cancelled"], timeout=3)
        proc.kill()
        proc.wait(timeout=5)
        dead = h.call("web__add", {"a": 1, "b": 1}, timeout=5).result(timeout=10)
        assert dead.is_error and "web" in dead.text
    finally:
        t0 = time.monotonic()
        h.close()
        assert time.monotonic() - t0 < 3.0


def test_unreachable_http_server_is_reported():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h = McpHost(init_timeout=5)
    try:
        (status,) = h.start([ServerSpec(name="far", url=f"http://127.0.0.1:{port}/mcp")]).result(timeout=10)
        assert status.state == "error" and f"127.0.0.1:{port}" in status.message
    finally:
        h.close()
