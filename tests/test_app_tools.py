"""Issue 43: tools in the window through MCP, on the real compiled tiny-random module and a real stdio MCP server
(tests/mcp_echo_server.py, written with the `mcp` SDK). The model's call is forced by the grammar (tiny-random
would never call on its own); its card asks, is approved, runs, and the reply follows; a call to a server that
hangs times out with a notice and the chat goes on; the cards are stored, found by search and exported."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import conftest_app  # noqa: F401  (headless Qt, pytest-qt)
from conftest_app import TURN_TIMEOUT_MS, open_window, wait_idle, write_settings
from PySide6.QtCore import Qt

SERVER = Path(__file__).resolve().parent / "mcp_echo_server.py"


def _window(qtbot, tmp_path: Path):
    data = tmp_path / "data"
    write_settings(data, max_new_tokens=120)
    (data / "mcp.json").write_text(json.dumps({"mcpServers": {"echo": {"command": sys.executable,
                                                                        "args": [str(SERVER)]}}}))
    window = open_window(qtbot, data)
    c = window.controller
    qtbot.waitUntil(lambda: any(t["function"]["name"].endswith("add") for t in c.tools.tools()), timeout=20_000)
    return window, c


def _tool(c, short: str) -> str:
    return next(t["function"]["name"] for t in c.tools.tools() if t["function"]["name"].endswith(short))


def _send(qtbot, window, text: str) -> None:
    window.compose.setFocus()
    qtbot.keyClicks(window.compose, text)
    with qtbot.waitSignal(window.controller.turn_finished, timeout=TURN_TIMEOUT_MS):
        qtbot.keyClick(window.compose, Qt.Key.Key_Return)


def test_a_forced_call_shows_its_card_runs_when_approved_and_the_reply_follows(qtbot, tmp_path):
    window, c = _window(qtbot, tmp_path)
    add = _tool(c, "add")
    c.tool_choice = {"type": "function", "function": {"name": add}}
    c.host.configure(c._chat_config())
    _send(qtbot, window, "Add two numbers with the tool.")
    qtbot.waitUntil(lambda: c.chat.messages[-1].role == "tool", timeout=TURN_TIMEOUT_MS)
    reply, card = c.chat.messages[-2], c.chat.messages[-1]
    call = reply.extra["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == add and set(args) == {"a", "b"}
    assert "<tool_call>" not in reply.content  # the call's text never showed as the reply's
    assert card.extra["state"] == "asking" and not c.can_send
    last = len(c.chat.messages) - 1
    # Bubbles are built a pass later, and shown after the layout takes them in: on a busy machine (a CI run beside
    # builds) that was after the bubble existed.
    qtbot.waitUntil(lambda: window.chat_view.widget(last) is not None
                    and window.chat_view.widget(last).tool_buttons["run"].isVisible())
    bubble = window.chat_view.widget(last)
    assert not bubble.tool_buttons["stop"].isVisible()
    assert add in bubble.call.text()

    c.tool_choice = "auto"  # the reply after the result is the model's own
    c.host.configure(c._chat_config())
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        bubble.tool_buttons["always"].click()  # run it, and never ask again for this tool
    assert card.extra["state"] == "done" and card.content == str(args["a"] + args["b"])
    from app.settings import load_settings
    assert load_settings(c.data_dir).tools.allowed_tools == add  # kept for the next start
    answer = c.chat.messages[-1]
    assert answer.role == "assistant" and not answer.streaming and answer.content
    wait_idle(qtbot, window)
    assert c.can_send

    # Stored: the card and the reply's call come back with the chat, the result is found by search, and the
    # export says what ran.
    conv = c.chat.conversation_id
    rows = c.store.messages(conv)
    assert [r.role for r in rows][-3:] == ["assistant", "tool", "assistant"]
    assert rows[-2].extra["state"] == "done" and rows[-3].extra["tool_calls"][0]["function"]["name"] == add
    assert any(h.conversation_id == conv for h in c.search(card.content))
    assert f"**Tool `{add}`** (done)" in c.chat_markdown()


def test_a_call_to_a_server_that_hangs_times_out_with_a_notice_and_the_chat_goes_on(qtbot, tmp_path):
    window, c = _window(qtbot, tmp_path)
    hang = _tool(c, "hang")
    c.tools.allowed.add(hang)  # "Always allow": it runs without asking
    c.tools.timeout = 1.0
    c.tool_choice = {"type": "function", "function": {"name": hang}}
    c.host.configure(c._chat_config())
    notices = []
    c.notice.connect(lambda kind, text, action: notices.append(text))
    _send(qtbot, window, "Call the tool that hangs.")
    qtbot.waitUntil(lambda: c.chat.messages[-1].role == "tool", timeout=TURN_TIMEOUT_MS)
    card = c.chat.messages[-1]
    assert card.extra["state"] == "running"
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        pass  # the timeout settles the card, and its result goes back to the model
    assert card.extra["state"] == "failed" and "timed out" in card.content
    assert any(hang in n and "timed out" in n for n in notices)
    assert c.chat.messages[-1].role == "assistant"


def test_settings_list_the_servers_check_new_ones_and_apply_them(qtbot, tmp_path):
    from app.settings_dialog import SettingsDialog
    from app.tools_section import ServersDialog

    window, c = _window(qtbot, tmp_path)
    dialog = SettingsDialog(c.settings, window, None, c.chat_defaults, c.mcp_servers())
    qtbot.addWidget(dialog)
    assert dialog.tools.list.text().startswith("echo: ") and "tools" in dialog.tools.list.text()
    editor = ServersDialog('{"mcpServers": {"x": {"url": "ftp://nowhere"}}}', dialog)
    qtbot.addWidget(editor)
    editor.accept()
    assert editor.result() != ServersDialog.DialogCode.Accepted and editor.error.text()  # refused, and says why
    c.set_mcp_servers("")  # OK with no servers: the file goes, and so do the model's tools
    qtbot.waitUntil(lambda: c.tools.tools() == [], timeout=10_000)
    assert not (c.data_dir / "mcp.json").exists()


def test_calls_past_the_bound_are_not_run_and_the_loop_ends(qtbot, tmp_path):
    window, c = _window(qtbot, tmp_path)
    c.tools.limit = 0  # the bound (8 by default) already reached
    c.tool_choice = {"type": "function", "function": {"name": _tool(c, "add")}}
    c.host.configure(c._chat_config())
    notices = []
    c.notice.connect(lambda kind, text, action: notices.append(text))
    _send(qtbot, window, "Add numbers.")
    qtbot.waitUntil(lambda: c.chat.messages[-1].role == "tool", timeout=TURN_TIMEOUT_MS)
    card = c.chat.messages[-1]
    assert card.extra["state"] == "skipped" and "at most 0 tool calls" in card.content
    assert any("stopped running them" in n for n in notices)
    wait_idle(qtbot, window)
    assert c.chat.messages[-1] is card and c.can_send  # nothing went back to the model: the user goes on


def test_a_running_call_can_be_stopped_and_the_model_is_told(qtbot, tmp_path):
    window, c = _window(qtbot, tmp_path)
    c.tool_choice = {"type": "function", "function": {"name": _tool(c, "hang")}}
    c.host.configure(c._chat_config())
    _send(qtbot, window, "Call the tool that hangs.")
    qtbot.waitUntil(lambda: c.chat.messages[-1].role == "tool", timeout=TURN_TIMEOUT_MS)
    index = len(c.chat.messages) - 1
    c.tool_action(index, "run")
    card = c.chat.messages[index]
    assert card.extra["state"] == "running"
    qtbot.waitUntil(lambda: window.chat_view.widget(index) is not None)
    bubble = window.chat_view.widget(index)
    qtbot.waitUntil(lambda: bubble.tool_buttons["stop"].isVisible())
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS):
        bubble.tool_buttons["stop"].click()
    assert card.extra["state"] == "stopped" and "stopped" in card.content
    assert c.chat.messages[-1].role == "assistant"  # the model was told, and answered
