"""A message's bubble (MessageWidget: who, the meta line, its ‹ 2/3 › alternatives, thinking, a tool card's
buttons and the text) and the "left the window" marker between bubbles. What the buttons and the menu ask for
is the controller's to do: a bubble only asks.
"""
from __future__ import annotations

import json

from PySide6.QtCore import QEvent, QRectF, Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase, QPainter, QPainterPath, QPalette
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QMenu, QPushButton, QToolButton, QVBoxLayout, QWidget

from .colours import blend
from .elided_label import ElidedLabel
from .icons import icon
from .markdown_view import MarkdownView
from .message_meta import cut_note, cut_offset, message_tooltip, meta_line, short_time
from .models import Message

FLASH_MS = 1600  # how long a revealed message (a search hit) stays highlighted


class MessageWidget(QFrame):
    """One message: who, a little meta line, its alternatives (‹ 2/3 ›), a copy button and the text."""

    copy_requested = Signal(str)
    switch_requested = Signal(int)  # -1: the previous alternative, +1: the next
    edit_requested = Signal()
    regenerate_requested = Signal()
    fork_requested = Signal()
    delete_requested = Signal()
    tool_action = Signal(str)  # a tool card's button: "run", "always", "deny", "stop"

    def __init__(self, message: Message, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = message.role
        self.forgotten = False
        self.flashing = False
        self.setFocusPolicy(Qt.FocusPolicy.TabFocus)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 10)
        layout.setSpacing(2)
        header = QHBoxLayout()
        header.setSpacing(6)
        self.who = QLabel({"user": "You", "tool": "Tool"}.get(message.role, "Eddy"))
        font = self.who.font()
        font.setBold(True)
        self.who.setFont(font)
        self.time = QLabel()  # when it was written; the tooltip has the date and a reply's speed
        self.time.setObjectName("time")
        small = self.time.font()
        if small.pointSizeF() > 0:
            small.setPointSizeF(small.pointSizeF() * 0.85)
        self.time.setFont(small)
        self.meta = ElidedLabel()
        self.meta.setObjectName("meta")
        self.copy = QToolButton()
        self.copy.setAutoRaise(True)
        self.copy.setIcon(icon("copy", size=16))
        self.copy.setToolTip("Copy this message")
        self.copy.setAccessibleName("Copy message")
        self.copy.clicked.connect(lambda: self.copy_requested.emit(self._content))
        self.previous = self._arrow("‹", "Previous alternative", -1)
        self.position = QLabel()
        self.position.setObjectName("alternatives")
        self.next = self._arrow("›", "Next alternative", +1)
        header.addWidget(self.who)
        header.addWidget(self.time)
        header.addWidget(self.meta, 1)  # the room between the name and the buttons
        for w in (self.previous, self.position, self.next):
            header.addWidget(w)
        header.addWidget(self.copy)
        layout.addLayout(header)
        # A reasoning model's thinking: open while it thinks, folded once the reply is done (its length and
        # time on the button); a click opens or folds it, and that choice then stays.
        self.thinking_toggle = QToolButton()
        self.thinking_toggle.setObjectName("thinking")
        self.thinking_toggle.setAutoRaise(True)
        self.thinking_toggle.setCheckable(True)
        self.thinking_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.thinking_toggle.setAccessibleName("Show or hide the model's thinking")
        self.thinking_toggle.toggled.connect(self._show_thinking)
        self.thinking_toggle.clicked.connect(lambda: setattr(self, "_thinking_chosen", True))
        self.thinking = MarkdownView()
        self.thinking.setObjectName("thinkingText")
        self.thinking.setAccessibleName("The model's thinking")
        self._thinking_chosen = False
        quiet = self.thinking.palette()  # thinking reads as an aside: the placeholder's colour, in any theme
        quiet.setColor(QPalette.ColorRole.Text, quiet.color(QPalette.ColorRole.PlaceholderText))
        self.thinking.setPalette(quiet)
        layout.addWidget(self.thinking_toggle)
        layout.addWidget(self.thinking)
        self.thinking_toggle.hide()
        self.thinking.hide()
        # A tool card: the call (tool and arguments) and, while it asks or runs, what the user may do.
        self.call = ElidedLabel()
        self.call.setObjectName("toolCall")
        self.call.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.card_buttons = QHBoxLayout()
        self.card_buttons.setSpacing(6)
        self.tool_buttons: dict[str, QPushButton] = {}
        for action, text, tip in (("run", "Run", "Run this call once"),
                                  ("always", "Always allow", "Run this tool from now on without asking"),
                                  ("deny", "Don't run", "Tell the model the call was not allowed"),
                                  ("stop", "Stop", "Stop the call; the model is told it was stopped")):
            b = QPushButton(text)
            b.setToolTip(tip)
            b.clicked.connect(lambda _=False, a=action: self.tool_action.emit(a))
            self.card_buttons.addWidget(b)
            self.tool_buttons[action] = b
        self.card_buttons.addStretch(1)
        layout.addWidget(self.call)
        layout.addLayout(self.card_buttons)
        self.call.hide()
        for b in self.tool_buttons.values():
            b.hide()
        self.body = MarkdownView()
        self.body.setAccessibleName("Message text")
        self.body.extra_menu = self.fill_menu
        self.body.code_copied.connect(self.copy_requested)
        layout.addWidget(self.body)
        self._content = ""
        self._shown: tuple | None = None  # what set_message last showed
        self.alternatives = (1, 1)
        self._switcher: tuple[int, int, bool] | None = None  # what set_alternatives last showed
        self.locked = False
        self.set_message(message)

    def _arrow(self, text: str, name: str, step: int) -> QToolButton:
        b = QToolButton()
        b.setText(text)
        b.setAutoRaise(True)
        b.setAccessibleName(name)
        b.setToolTip(name)
        b.clicked.connect(lambda: self.switch_requested.emit(step))
        return b

    def fill_menu(self, menu: QMenu) -> None:
        """The message's own actions (its context menu, after the text's Copy)."""
        menu.addAction("Copy message", lambda: self.copy_requested.emit(self._content))
        if self.role == "user":
            edit = menu.addAction("Edit message…", self.edit_requested.emit)
            edit.setEnabled(not self.locked)
        elif self.role == "assistant":
            again = menu.addAction("Regenerate reply", self.regenerate_requested.emit)
            again.setEnabled(not self.locked)
        fork = menu.addAction("Fork chat here", self.fork_requested.emit)
        fork.setEnabled(not self.locked)
        if self.alternatives[1] > 1:  # with nothing to show in its place, a delete would end the chat here
            delete = menu.addAction("Delete this alternative…", self.delete_requested.emit)
            delete.setEnabled(not self.locked)

    def contextMenuEvent(self, event) -> None:  # noqa: N802 (Qt API)
        menu = QMenu(self)
        self.fill_menu(menu)
        menu.exec(event.globalPos())
        menu.deleteLater()

    def set_alternatives(self, position: int, count: int, locked: bool) -> None:
        """Which of `count` alternatives this message is (the switcher shows only when there are several);
        `locked`: a reply is being written, so nothing can be switched, edited or forked now."""
        before, self._switcher = self._switcher, (position, count, locked)
        self.alternatives, self.locked = (position, count), locked
        # Every render of every bubble asks again, and every send locks all of them: a long chat's send asked
        # 200 times. A bubble without alternatives shows no switcher, so locking changes nothing it shows.
        if before == self._switcher or (count == 1 and before is not None and before[1] == 1):
            return
        several = count > 1
        for w in (self.previous, self.position, self.next):
            w.setVisible(several)
        self.position.setText(f"{position}/{count}")
        self.position.setAccessibleName(f"Alternative {position} of {count}")
        self.previous.setEnabled(several and position > 1 and not locked)
        self.next.setEnabled(several and position < count and not locked)

    def set_message(self, message: Message, forgotten: bool = False, partly: bool = False,
                    seen: tuple[int, int] | None = None) -> None:
        """`seen`: for the message the model's window begins inside, (its tokens still seen, all its tokens)."""
        # Every window change renders every bubble again; most show just what they did (a 200-message chat
        # spent 30-60 ms of the GUI thread per send on that alone).
        shown = (message.content, message.streaming, dict(message.meta), message.created, forgotten, partly, seen,
                 json.dumps(message.extra, sort_keys=True), message.reasoning)
        if shown == self._shown:
            return
        self._shown = shown
        self._content = message.content
        self._set_thinking(message)
        self._set_card(message)
        self.forgotten = forgotten
        markdown = message.role == "assistant"  # a tool's result is shown as it came
        cut = (cut_offset(message.content, *seen), cut_note(seen)) if seen and not markdown else None
        self.cut_note = cut[1] if cut else ""
        self.body.set_content(message.content, markdown=markdown, cut=cut)
        self.meta.setText(meta_line(message, forgotten, partly, seen))
        self.time.setText(short_time(message.created))
        # On the whole bubble: its text shows the tooltip too (the text view has none of its own).
        self.setToolTip(message_tooltip(message))
        who = "Your message" if self.role == "user" else "Reply from Eddy"
        self.setAccessibleName(who + (" (no longer seen by the model)" if forgotten else ""))
        self.setAccessibleDescription(message.content[:500])
        self._recolour()

    def _set_thinking(self, message: Message) -> None:
        text = message.reasoning
        self.thinking_toggle.setVisible(bool(text))
        if not text:
            self.thinking.hide()
            return
        still = message.streaming and not message.content
        seconds = message.extra.get("thinking_ms", 0) / 1e3
        label = "Thinking…" if still else (f"Thought for {seconds:.1f} s" if seconds else "Thought")
        self.thinking_toggle.setText(f"{'▾' if self.thinking_toggle.isChecked() else '▸'} {label} · "
                                     f"{len(text):,} characters")
        self.thinking.set_content(text, markdown=True)
        if not self._thinking_chosen:
            self.thinking_toggle.setChecked(still)  # open while it thinks, folded after
        self._show_thinking(self.thinking_toggle.isChecked())

    def _set_card(self, message: Message) -> None:
        card = message.role == "tool"
        self.call.setVisible(card)
        state = message.extra.get("state", "")
        for action, b in self.tool_buttons.items():
            b.setVisible(card and (state == "running") == (action == "stop") and state in ("asking", "running"))
        if card:
            call = f"{message.extra.get('tool', '?')}({message.extra.get('arguments', '')})"
            self.call.setText(call)
            self.call.setToolTip(call[:2000])
        # A card before its result, and a reply that only called tools, have no text to show.
        self.body.setVisible(bool(message.content) or message.streaming or not (card or message.extra.get("tool_calls")))

    def _show_thinking(self, shown: bool) -> None:
        self.thinking.setVisible(shown and bool(self._shown and self._shown[-1]))
        text = self.thinking_toggle.text()
        if text[:1] in "▸▾":
            self.thinking_toggle.setText(("▾" if shown else "▸") + text[1:])

    def cut_y(self) -> int:
        """Where the cut-off note sits inside this bubble, in its own coordinates (-1: it has none)."""
        if not self.cut_note:
            return -1
        found = self.body.document().find(self.cut_note)
        if found.isNull():
            return -1
        return self.body.mapTo(self, self.body.cursorRect(found).topLeft()).y()

    def flash(self) -> None:
        """Highlights the bubble for a moment (the message a search hit led to)."""
        self.flashing = True
        self.update()
        QTimer.singleShot(FLASH_MS, self, self._unflash)  # self: not once gone

    def _unflash(self) -> None:
        self.flashing = False
        self.update()

    def _recolour(self) -> None:
        pal = self.palette()
        dim = blend(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text), 0.55)
        meta_pal = self.meta.palette()
        meta_pal.setColor(QPalette.ColorRole.WindowText, dim)
        self.meta.setPalette(meta_pal)
        self.time.setPalette(meta_pal)
        body_pal = self.body.palette()
        text = pal.color(QPalette.ColorRole.Text)
        body_pal.setColor(QPalette.ColorRole.Text, blend(text, pal.color(QPalette.ColorRole.Base), 0.4) if self.forgotten else text)
        self.body.setPalette(body_pal)
        self.update()

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self._recolour()

    def paintEvent(self, event) -> None:  # noqa: N802
        pal = self.palette()
        base = pal.color(QPalette.ColorRole.Base)
        if self.role == "user":
            fill = blend(base, pal.color(QPalette.ColorRole.Highlight), 0.14)
        else:
            fill = blend(base, pal.color(QPalette.ColorRole.Text), 0.04)
        if self.forgotten:
            fill = blend(fill, pal.color(QPalette.ColorRole.Window), 0.5)
        if self.flashing:
            fill = blend(fill, pal.color(QPalette.ColorRole.Highlight), 0.30)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        path = QPainterPath()
        path.addRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 10, 10)
        painter.fillPath(path, fill)
        if self.hasFocus() or self.flashing:
            painter.setPen(pal.color(QPalette.ColorRole.Highlight))
            painter.drawPath(path)


class EvictionMarker(QWidget):
    """A rule with a caption: the messages above it have left the model's window."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Context window marker")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 4)
        self.label = QLabel()
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.label.setWordWrap(True)
        font = self.label.font()
        font.setPointSizeF(font.pointSizeF() * 0.9)
        self.label.setFont(font)
        layout.addWidget(self.label, 1)
        self.evicted = 0

    def set_counts(self, evicted: int, sinks: int, dropped: bool) -> None:
        self.evicted = evicted
        if evicted:
            text = f"▲ The model no longer sees the messages above: {evicted:,} tokens have left its window"
            if sinks:
                text += f" (it keeps the first {sinks} as attention sinks)"
        elif dropped:
            text = "▲ The messages above did not fit the model's window when this chat was reopened"
        else:
            text = ""
        self.label.setText(text)
        self.setAccessibleDescription(text)
        self._recolour()

    def _recolour(self) -> None:
        pal = self.label.palette()
        pal.setColor(QPalette.ColorRole.WindowText, self.palette().color(QPalette.ColorRole.Highlight))
        self.label.setPalette(pal)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self._recolour()

    def paintEvent(self, event) -> None:  # noqa: N802
        painter = QPainter(self)
        pen = painter.pen()
        pen.setColor(self.palette().color(QPalette.ColorRole.Highlight))
        pen.setStyle(Qt.PenStyle.DashLine)
        painter.setPen(pen)
        y = self.height() // 2
        text_w = min(self.label.fontMetrics().horizontalAdvance(self.label.text()) + 24, self.width())
        gap = (self.width() - text_w) // 2
        if gap > 8:
            painter.drawLine(0, y, gap, y)
            painter.drawLine(self.width() - gap, y, self.width(), y)
