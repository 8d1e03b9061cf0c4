"""The settings dialog's "Tools" section: the MCP servers whose tools the model is offered.

They are kept as the `mcpServers` JSON that Claude Desktop, LM Studio and Cursor use (the data folder's mcp.json,
app/tool_cards.py), so a file from any of them can be imported as it is. Each server's state is listed: how many
tools it gave, or why it gave none.
"""
from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFileDialog, QGroupBox, QHBoxLayout, QLabel, QPlainTextEdit,
                               QPushButton, QVBoxLayout, QWidget)

from .mcp_config import McpConfigError, parse_servers
from .mcp_host import ServerStatus

EXAMPLE = json.dumps({"mcpServers": {"files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem",
                                                                          "/home/me/notes"]},
                                     "web": {"url": "http://127.0.0.1:8931/mcp"}}}, indent=2)


class ToolsSection(QGroupBox):
    def __init__(self, text: str, statuses: list[ServerStatus], parent: QWidget | None = None) -> None:
        super().__init__("Tools (MCP servers)", parent)
        self.setAccessibleName("Tools")
        self.text = text
        layout = QVBoxLayout(self)
        self.list = QLabel(_describe(statuses) if text.strip() else "No MCP servers: the model has no tools.")
        self.list.setWordWrap(True)
        self.list.setAccessibleName("MCP servers")
        layout.addWidget(self.list)
        row = QHBoxLayout()
        self.edit = QPushButton("Edit servers…")
        self.edit.setToolTip("The servers as mcpServers JSON: stdio commands and Streamable HTTP URLs")
        self.edit.clicked.connect(self._edit)
        self.import_ = QPushButton("Import…")
        self.import_.setToolTip("Read the servers from another client's file (claude_desktop_config.json, mcp.json)")
        self.import_.clicked.connect(self._import)
        row.addWidget(self.edit)
        row.addWidget(self.import_)
        row.addStretch(1)
        layout.addLayout(row)

    def set_text(self, text: str) -> None:
        """A new servers text (checked by the caller); shown as waiting for OK."""
        self.text = text
        names = [s.name for s in parse_servers(text)] if text.strip() else []
        self.list.setText(("Servers after OK: " + ", ".join(names)) if names else "No MCP servers after OK.")

    def _edit(self) -> None:
        dialog = ServersDialog(self.text or EXAMPLE, self)
        if dialog.exec() == QDialog.DialogCode.Accepted:
            self.set_text(dialog.text())

    def _import(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import MCP servers", "", "JSON (*.json);;All files (*)")
        if not path:
            return
        try:
            text = Path(path).read_text(encoding="utf-8")
            parse_servers(text)
        except (OSError, UnicodeDecodeError, McpConfigError) as e:
            self.list.setText(f"Not imported: {e}")
            return
        self.set_text(text)


class ServersDialog(QDialog):
    """The servers' JSON, checked before OK takes it."""

    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("MCP servers")
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel('As other clients write it: {"mcpServers": {"name": {"command": ..., "args": [...]} '
                                'or {"url": ...}}}. Empty: no tools.'))
        self.editor = QPlainTextEdit(text)
        self.editor.setAccessibleName("MCP servers JSON")
        self.editor.setMinimumSize(520, 260)
        layout.addWidget(self.editor)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d9453d")
        layout.addWidget(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def text(self) -> str:
        return self.editor.toPlainText().strip()

    def accept(self) -> None:
        if self.text():
            try:
                parse_servers(self.text())
            except McpConfigError as e:
                self.error.setText(str(e))
                return
        super().accept()


def _describe(statuses: list[ServerStatus]) -> str:
    if not statuses:
        return "Starting the MCP servers…"
    return "\n".join(f"{s.name}: {s.message}" if s.ok else f"{s.name}: {s.state} ({s.message})" for s in statuses)
