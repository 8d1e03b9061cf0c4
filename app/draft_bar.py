"""Above the message box: the documents attached to the draft (each removable) and how many tokens the draft
is, with how much of it the model will see. Renders a DraftModel; removing asks the controller."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolButton, QWidget

from .colours import blend
from .documents import size_text
from .icons import icon
from .models import DraftModel


def draft_summary(tokens: int | None, window: int, documents: int) -> str:
    """What the draft's size means for the model: all of it seen, or only its last `window` tokens."""
    if tokens is None:
        return "Counting tokens…" if documents else ""
    if tokens == 0:
        return ""
    size = f"Draft: {tokens:,} token{'s' if tokens != 1 else ''}"
    if not window:
        return size
    if tokens <= window:
        return f"{size} · fits the model's {window:,}-token window"
    # StreamingLLM: a longer message streams through the window; the reply sees its last `window` tokens.
    return (f"{size} · longer than the model's {window:,}-token window: it streams through, and the model "
            f"will see only its last {window:,} tokens ({window / tokens:.0%})")


class DraftBar(QWidget):
    remove_requested = Signal(int)  # index of the document to take off the draft

    def __init__(self, model: DraftModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setAccessibleName("Draft")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        self.chips = QHBoxLayout()
        self.chips.setSpacing(4)
        layout.addLayout(self.chips)
        self.summary = QLabel()
        self.summary.setAccessibleName("Draft size")
        self.summary.setWordWrap(True)
        layout.addWidget(self.summary, 1)
        self.chip_buttons: list[QToolButton] = []
        model.changed.connect(self.render)
        self.render()

    def render(self) -> None:
        for b in self.chip_buttons:
            self.chips.removeWidget(b)
            b.deleteLater()
        self.chip_buttons = []
        for i, doc in enumerate(self.model.documents):
            b = QToolButton()
            b.setText(f"{doc.name} · {size_text(doc.size)}")
            b.setIcon(icon("close", size=14))
            b.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
            b.setLayoutDirection(Qt.LayoutDirection.RightToLeft)  # the ✕ after the name
            b.setToolTip(f"Attached: {doc.name}. Click to remove it from the message.")
            b.setAccessibleName(f"Remove attached document {doc.name}")
            b.clicked.connect(lambda _checked=False, index=i: self.remove_requested.emit(index))
            self.chips.addWidget(b)
            self.chip_buttons.append(b)
        text = draft_summary(self.model.tokens, self.model.window, len(self.model.documents))
        self.summary.setText(text)
        pal = self.summary.palette()
        long = self.model.tokens is not None and self.model.window and self.model.tokens > self.model.window
        base = self.palette()
        colour = base.color(QPalette.ColorRole.Highlight) if long else blend(
            base.color(QPalette.ColorRole.Base), base.color(QPalette.ColorRole.Text), 0.6)
        pal.setColor(QPalette.ColorRole.WindowText, colour)
        self.summary.setPalette(pal)
        self.setVisible(bool(text or self.chip_buttons))
