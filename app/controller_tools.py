"""The controller's tool calls: the MCP servers (started from the data folder's mcp.json), the calls a reply
makes offered as cards, and their results sent back to the model. The cards themselves are app/tool_cards.py's.

Mixed into ChatController (app/controller.py), whose chat, store, host, tools and signals it uses.
"""
from __future__ import annotations

from dataclasses import replace

from .models import Message
from .settings import save_settings
from .tool_cards import MCP_FILE, load_servers


class ToolCallHandling:
    """Starts the MCP servers, keeps mcp.json and the tools always allowed, and turns a reply's calls into cards."""

    def start_tools(self) -> None:
        """(Re)starts the MCP servers of the data folder's mcp.json; a problem with the file is a notice."""
        specs, self.tools_problem = load_servers(self.data_dir)
        if self.tools_problem:
            self.notice.emit("warning", f"No tools from MCP servers: {self.tools_problem}", "")
        self.tools.start(specs)

    def mcp_servers(self) -> tuple[str, list]:
        """(the data folder's mcp.json text, the servers' statuses) for the settings dialog."""
        try:
            text = (self.data_dir / MCP_FILE).read_text(encoding="utf-8")
        except OSError:
            text = ""
        return text, self.tools.host.status()

    def set_mcp_servers(self, text: str) -> None:
        """Keeps `text` (checked JSON, or "" for none) as mcp.json and restarts the servers if it changed."""
        path = self.data_dir / MCP_FILE
        if text.strip() == self.mcp_servers()[0].strip():
            return
        try:
            if text.strip():
                path.write_text(text.strip() + "\n", encoding="utf-8")
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            self.notice.emit("error", f"Could not save the MCP servers to {path}: {e.strerror or e}", "")
            return
        self.start_tools()

    def _keep_allowed_tools(self) -> None:
        tools = replace(self.settings.tools, allowed_tools=",".join(sorted(self.tools.allowed)))
        self.settings = replace(self.settings, tools=tools)
        save_settings(self.data_dir, self.settings)

    def _on_tools_changed(self) -> None:
        self.tools_changed.emit()
        if self.model_state == "ready":
            self.host.configure(self._chat_config())  # the model is told of the tools there are now

    def tool_action(self, index: int, action: str) -> None:
        """A tool card's button: "run", "always", "deny" or "stop"."""
        self.tools.act(index, action)
        self.busy_changed.emit()

    def _on_tool_calls(self, ticket: int, calls: list) -> None:
        index = self._last_reply
        if self._closing or not 0 <= index < len(self.chat.messages):
            return
        reply = self.chat.messages[index]
        reply.extra = {**reply.extra, "tool_calls": list(calls)}
        self.chat.changed.emit(index)
        self._save_card(reply)
        self.tools.offer(list(calls))
        self.busy_changed.emit()

    def _save_card(self, message: Message) -> None:
        """Writes a message's new text and extra (a card's result, a reply's calls) once it is on disk."""
        conv_id = self.chat.conversation_id
        if conv_id is None or message.id is None:
            return  # not on disk yet: it is written whole, as it is by then
        self._write(conv_id, lambda: self.store.update_message(message.id, message.content, message.extra))

    def _send_tool_results(self, results: list) -> None:
        if self._closing or self.model_state != "ready" or self.busy:
            return
        last = len(self.chat.messages) - 1
        self._start_turn(self.host.send_tool_results(results), last, "", after_tools=True)
