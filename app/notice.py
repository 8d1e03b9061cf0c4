"""A message strip at the top of the chat: errors and warnings stay in the window instead of popping up."""
from __future__ import annotations

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QToolButton, QWidget

from .colours import blend
from .icons import icon

LEVEL_COLOURS = {"info": QColor("#2f80ed"), "warning": QColor("#e0a030"), "error": QColor("#d9453d")}
ACTION_LABELS = {"retry_load": "Build again", "settings": "Settings…", "retry_save": "Save now"}


class NoticeBar(QFrame):
    action_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.level = "info"
        self.action = ""
        self.setAccessibleName("Notice")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.label, 1)
        self.button = QPushButton()
        self.button.clicked.connect(lambda: self.action_requested.emit(self.action))
        layout.addWidget(self.button)
        self.dismiss = QToolButton()
        self.dismiss.setAutoRaise(True)
        self.dismiss.setIcon(icon("close", size=14))
        self.dismiss.setAccessibleName("Dismiss notice")
        self.dismiss.setToolTip("Dismiss")
        self.dismiss.clicked.connect(self.hide)
        layout.addWidget(self.dismiss)
        self.hide()

    def show_notice(self, level: str, text: str, action: str = "") -> None:
        self.level, self.action = level, action
        self.label.setText(text)
        self.setAccessibleDescription(f"{level}: {text}")
        self.button.setText(ACTION_LABELS.get(action, ""))
        self.button.setVisible(bool(action))
        self.button.setAccessibleName(ACTION_LABELS.get(action, ""))
        self.show()
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802
        pal = self.palette()
        colour = LEVEL_COLOURS.get(self.level, LEVEL_COLOURS["info"])
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        path = QPainterPath()
        path.addRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 8, 8)
        painter.fillPath(path, blend(pal.color(QPalette.ColorRole.Base), colour, 0.16))
        painter.setPen(colour)
        painter.drawPath(path)
