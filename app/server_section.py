"""The local server's widgets: its section of the settings dialog, and its line in the status bar."""
from __future__ import annotations

from PySide6.QtWidgets import QCheckBox, QFormLayout, QGroupBox, QLabel, QLineEdit, QSpinBox, QWidget

from .local_server import HOST
from .settings import ServerOptions


class ServerSection(QGroupBox):
    """The "Local server" switch, its port and its key. Loopback only: no host is offered."""

    def __init__(self, current: ServerOptions, parent: QWidget | None = None) -> None:
        super().__init__("Local server", parent)
        self.setAccessibleName("Local server")
        form = QFormLayout(self)
        self.enabled = QCheckBox("Serve the model to other programs on this computer")
        self.enabled.setAccessibleName("Local server")
        self.enabled.setToolTip("An OpenAI-compatible API (/v1/chat/completions) on the same model and engine as "
                                "this window; its requests wait their turn behind the window's")
        self.enabled.setChecked(current.serve)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(current.server_port)
        self.port.setAccessibleName("Server port")
        self.key = QLineEdit(current.server_key)
        self.key.setAccessibleName("Server API key")
        self.key.setPlaceholderText("none: any program on this computer may use it")
        self.key.setToolTip("When set, clients must send 'Authorization: Bearer KEY' (the openai client's api_key)")
        self.key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.address = QLabel()
        self.address.setEnabled(False)  # a caption: where it will answer
        self.address.setAccessibleName("Server address")
        form.addRow(self.enabled)
        form.addRow("Port", self.port)
        form.addRow("API key", self.key)
        form.addRow("", self.address)
        self.port.valueChanged.connect(self._show_address)
        self.enabled.toggled.connect(self._show_address)
        self._show_address()

    def _show_address(self, *_: object) -> None:
        on = self.enabled.isChecked()
        self.port.setEnabled(on)
        self.key.setEnabled(on)
        self.address.setText(f"http://{HOST}:{self.port.value()}/v1 (loopback only)")

    def value(self) -> ServerOptions:
        return ServerOptions(self.enabled.isChecked(), self.port.value(), self.key.text().strip())


class ServerStatus(QLabel):
    """The status bar's "Serving on …" while the server is on, and what it is doing when that matters."""

    def __init__(self, controller, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.setAccessibleName("Local server status")
        for signal in (controller.server_changed, controller.busy_changed, controller.turn_prefilled):
            signal.connect(self.refresh)
        self.refresh()

    def refresh(self, *_: object) -> None:
        c = self.controller
        address = c.server_address
        self.setVisible(address is not None)
        if address is None:
            self.setText("")
            return
        text = f"Serving on {address}"
        if c.waiting_for_server:
            text += " · your message is next, after a server request"
        elif c.server_busy:
            text += " · answering a request"
        self.setText(text)
