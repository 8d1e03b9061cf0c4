"""The window's tools: the MCP servers' tools offered to the model, and each call it makes shown as a card.

A reply that calls tools gets one card per call (a message of role "tool": the tool, its arguments, its state and
then its result). A card asks before it runs unless the user allowed that tool ("Always allow"); a running call
can be stopped; a call that fails or times out says so in its card and a notice. Once every card of a reply is
settled, their results go back to the model (results_ready) and its next reply follows. A user's message may
lead to at most `limit` calls: past that the cards say so and nothing more runs, so a model that keeps calling
cannot loop forever.

The MCP side (app/mcp_host.py) runs on its own thread; its answers come back to the GUI thread through a queued
signal, so everything here runs on the GUI thread.
"""
from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, Signal

from .mcp_config import McpConfigError, ServerSpec, parse_servers
from .mcp_host import McpHost, ToolResult
from .models import ChatModel, Message

MCP_FILE = "mcp.json"  # the data folder's MCP servers, in the `mcpServers` JSON other clients use

# A card's states: what it shows and whether it is settled (its result can go back to the model).
ASKING, RUNNING, DONE, FAILED, DENIED, STOPPED, SKIPPED = ("asking", "running", "done", "failed", "denied",
                                                          "stopped", "skipped")
SETTLED = (DONE, FAILED, DENIED, STOPPED, SKIPPED)


def load_servers(data_dir: Path) -> tuple[list[ServerSpec], str]:
    """(the servers in the data folder's mcp.json, a problem with it in one sentence or "")."""
    path = data_dir / MCP_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], ""
    except OSError as e:
        return [], f"{path} could not be read: {e.strerror or e}"
    try:
        return parse_servers(text), ""
    except McpConfigError as e:
        return [], f"{path}: {e}"


class ToolCards(QObject):
    changed = Signal()                   # the servers' status or tools changed (Settings shows them)
    results_ready = Signal(object)       # [{"role": "tool", "content", "tool_call_id"}, ...] for the model
    notice = Signal(str, str)            # kind, text
    allowed_changed = Signal()           # a tool was allowed to run without asking (the settings keep it)
    _finished = Signal(object, object)   # (card message, ToolResult | None): from the MCP thread

    def __init__(self, chat: ChatModel, save_new: Callable[[int], object], save_change: Callable[[Message], object],
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.chat = chat
        self._save_new, self._save_change = save_new, save_change
        self.host = McpHost(on_change=self.changed.emit)
        self.allowed: set[str] = set()
        self.timeout = 60.0
        self.limit = 8
        self.calls_this_turn = 0
        self._batch: list[Message] = []  # the cards of the reply whose calls are being settled
        self._running: dict[int, Future] = {}  # id(card) -> its call
        self._finished.connect(self._on_finished)

    # --- configuration ------------------------------------------------------------------------------------

    def start(self, specs: list[ServerSpec]) -> None:
        self.host.start(specs)

    def tools(self) -> list[dict]:
        return self.host.tools()

    def close(self) -> None:
        for future in self._running.values():
            future.cancel()
        self.host.close()

    # --- a reply's calls ----------------------------------------------------------------------------------

    def new_user_turn(self) -> None:
        self.calls_this_turn = 0

    @property
    def busy(self) -> bool:
        """Cards of a reply are still asking or running."""
        return any(card.extra.get("state") not in SETTLED for card in self._batch)

    def offer(self, calls: list[dict]) -> None:
        """One card per call at the end of the chat (after the reply that made them); the allowed ones run."""
        self._batch = []
        for call in calls:
            fn = call.get("function") or {}
            self.calls_this_turn += 1
            over = self.calls_this_turn > self.limit
            state = SKIPPED if over else ASKING
            card = Message("tool", f"Not run: a message may lead to at most {self.limit} tool calls." if over else "",
                           extra={"tool": fn.get("name", ""), "arguments": fn.get("arguments", "{}"),
                                  "tool_call_id": call.get("id", ""), "state": state})
            index = self.chat.append(card)
            self._save_new(index)
            self._batch.append(card)
        if self.calls_this_turn > self.limit:
            self.notice.emit("warning", f"The model kept calling tools: after {self.limit} calls for one message, "
                                        "Eddy stopped running them. Send a message to go on.")
            return  # the loop ends here: these results are not sent back
        for card in self._batch:
            if card.extra["tool"] in self.allowed:
                self._run(card)
        self._settle()

    def act(self, index: int, action: str) -> None:
        """A card's button: "run", "always" (run, and never ask again for this tool), "deny" or "stop"."""
        if not 0 <= index < len(self.chat.messages):
            return
        card = self.chat.messages[index]
        state = card.extra.get("state")
        if action in ("run", "always") and state == ASKING:
            if action == "always":
                self.allowed.add(card.extra["tool"])
                self.allowed_changed.emit()
            self._run(card)
        elif action == "deny" and state == ASKING:
            self._set(card, DENIED, "The user did not allow this call.")
        elif action == "stop" and state == RUNNING:
            future = self._running.pop(id(card), None)
            if future is not None:
                future.cancel()
            self._set(card, STOPPED, "The user stopped this call before it finished.")
        self._settle()

    def _run(self, card: Message) -> None:
        try:
            arguments = json.loads(card.extra.get("arguments") or "{}")
        except ValueError:
            self._set(card, FAILED, "The model's arguments are not JSON.")
            return
        self._set(card, RUNNING, "")
        future = self.host.call(card.extra["tool"], arguments if isinstance(arguments, dict) else {}, self.timeout)
        self._running[id(card)] = future

        def done(f: Future) -> None:  # the MCP thread
            self._finished.emit(card, None if f.cancelled() else f.result())

        future.add_done_callback(done)

    def _on_finished(self, card: Message, result: ToolResult | None) -> None:
        if self._running.pop(id(card), None) is None or result is None:
            return  # stopped meanwhile: the card already says so
        if result.is_error:
            self.notice.emit("warning", f"The tool {card.extra['tool']} failed: {result.text[:300]}")
        self._set(card, FAILED if result.is_error else DONE, result.text, seconds=round(result.seconds, 2))
        self._settle()

    def _set(self, card: Message, state: str, text: str, **more: object) -> None:
        card.content = text
        card.extra = {**card.extra, "state": state, **more}
        if card in self.chat.messages:
            self.chat.changed.emit(self.chat.messages.index(card))
        self._save_change(card)

    def _settle(self) -> None:
        """Sends the results back once every card of the reply is settled."""
        if not self._batch or self.busy:
            return
        batch, self._batch = self._batch, []
        if any(card.extra.get("state") == SKIPPED for card in batch):
            return
        self.results_ready.emit([{"role": "tool", "content": card.content, "tool_call_id": card.extra["tool_call_id"]}
                                 for card in batch])
