"""A message longer than the window streaming into the model: a progress bar and Cancel (the reply's stop)."""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QWidget


class ReadingBar(QWidget):
    cancel_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Reading the message")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        # The counts live in the bar, whose text does not set its width: in the label they made the bar's minimum
        # width grow with the numbers (495 -> 601 px at seven digits), pushing on a narrow chat column.
        self.label = QLabel("Reading the message into the model")
        self.bar = QProgressBar()
        self.bar.setAccessibleName("Reading progress")
        self.bar.setTextVisible(True)
        self.cancel = QPushButton("Cancel")
        self.cancel.setAccessibleName("Cancel reading the message")
        self.cancel.setToolTip("Stop reading the message (Esc); the chat keeps it, unanswered")
        self.cancel.clicked.connect(self.cancel_requested)
        layout.addWidget(self.label)
        layout.addWidget(self.bar, 1)
        layout.addWidget(self.cancel)
        self.hide()

    def show_progress(self, done: int, total: int) -> None:
        self.bar.setFormat(f"{done:,} of {total:,} tokens")
        self.bar.setRange(0, max(1, total))
        self.bar.setValue(done)
        self.show()

    def finish(self) -> None:
        self.hide()
