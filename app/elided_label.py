"""A one-line label that asks for no width and ends in "…" where its text is longer than the room it gets.

A reply's meta line ("… partly out of the model's window: it sees the last 848 of 5,338 tokens") as a plain
label set the whole chat column's minimum width past the view, so every bubble of a long chat was laid out
again at the wider width and back (80-170 ms stalls around a document). Word wrap instead made each streamed
token's layout about 1.8x dearer (height for width). The chat's system-prompt header elides the same way.
"""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class ElidedLabel(QLabel):
    """text() is the whole text; the tooltip is the whole text when it is cut, unless a fixed one is set."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._full = ""
        self._fixed_tooltip: str | None = None
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    def setText(self, text: str) -> None:  # noqa: N802 (Qt API)
        if text == self._full:  # a streaming reply sets the same "writing…" on every flush
            return
        self._full = text
        self._elide()

    def text(self) -> str:
        return self._full

    def set_fixed_tooltip(self, tooltip: str | None) -> None:
        """A tooltip of the caller's own (None: the whole text, shown only when it is cut)."""
        self._fixed_tooltip = tooltip
        self._elide()

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        shown = self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideRight, max(0, self.width()))
        if shown != super().text():
            super().setText(shown)
        if self._fixed_tooltip is not None:
            self.setToolTip(self._fixed_tooltip)
        else:
            self.setToolTip(self._full if shown != self._full else "")


class ClickableElidedLabel(ElidedLabel):
    clicked = Signal()

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        if event.button() == Qt.MouseButton.LeftButton:
            self.clicked.emit()
        super().mouseReleaseEvent(event)
