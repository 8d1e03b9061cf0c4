"""The message input: Enter sends, Shift+Enter starts a new line, and it grows with its text up to a limit.
Files dropped (or pasted) on it are not inserted as text: they are handed on to be attached."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QSize, Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QSizePolicy, QWidget

MAX_LINES = 8


class ComposeBox(QPlainTextEdit):
    submitted = Signal(str)
    cancelled = Signal()  # Esc with nothing else to do (e.g. leave edit mode)
    files_dropped = Signal(list)  # [Path]: local files dropped or pasted on the box
    recall_requested = Signal()  # Up in an empty box: edit the last message (as in a shell's history)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText("Message Eddy… (Enter to send, Shift+Enter for a new line)")
        self.setAccessibleName("Message input")
        self.setAccessibleDescription("Type a message; Enter sends it, Shift+Enter adds a line")
        self.setTabChangesFocus(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().contentsChanged.connect(self._fit)
        self._fit()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit(self.toPlainText())
            event.accept()
            return
        if (event.key() == Qt.Key.Key_Up and not self.toPlainText()
                and not event.modifiers() & ~Qt.KeyboardModifier.KeypadModifier):
            self.recall_requested.emit()
            event.accept()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.cancelled.emit()
            event.ignore()  # the window's Esc (Stop) still gets it
            return
        super().keyPressEvent(event)

    @staticmethod
    def _files(source: QMimeData) -> list[Path]:
        return [Path(u.toLocalFile()) for u in source.urls() if u.isLocalFile()] if source.hasUrls() else []

    def canInsertFromMimeData(self, source: QMimeData) -> bool:  # noqa: N802 (Qt API)
        return bool(self._files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:  # noqa: N802 (Qt API): drops and pastes
        files = self._files(source)
        if files:
            self.files_dropped.emit(files)
        else:
            super().insertFromMimeData(source)

    def _fit(self) -> None:
        lines = max(1, min(MAX_LINES, int(self.document().size().height())))
        line_h = self.fontMetrics().lineSpacing()
        margins = self.contentsMargins()
        doc_margin = int(self.document().documentMargin() * 2)
        self.setFixedHeight(lines * line_h + doc_margin + margins.top() + margins.bottom() + 4)

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(400, self.height())
