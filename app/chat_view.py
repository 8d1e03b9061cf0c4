"""The conversation: one bubble per message (app/message_bubble.py) in a column, and the "left the window"
marker between the messages the model no longer sees and the rest. A long chat opens with its last bubbles and
builds the older ones above them a slice at a time; the view follows a reply as it is written while it is
scrolled to the bottom.

Renders a ChatModel and nothing else. Streaming text is coalesced: a reply is re-rendered at most every
REFRESH_MS, so a fast model (1000 tokens/s) costs the event loop a few renders a second, not a thousand.
"""
from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QToolButton, QVBoxLayout, QWidget

from .message_bubble import FLASH_MS, EvictionMarker, MessageWidget
from .models import ChatModel, Message

REFRESH_MS = 40
# A chat of more than LAZY_FROM messages opens with its last EAGER_MESSAGES built at once (more than a screen)
# and the older ones built above them in slices of about BUILD_SLICE_MS every BUILD_EVERY_MS: a bubble lays its
# text out when built, 3-10 ms each, so 200 at once froze the window for seconds. Each slice is followed by a
# layout pass of the whole column (5-10 ms at 200 bubbles), and the gap between slices keeps input and painting
# flowing (and leaves a core to the engine rebuilding the chat's cache meanwhile): the 200 are built in ~4 s.
LAZY_FROM = 24
EAGER_MESSAGES = 8
BUILD_SLICE_MS = 4
BUILD_EVERY_MS = 32
# A send appends two messages (the user's, the reply being written) in one slot; their two bubbles, built and
# laid out and painted in that one pass of the event loop, stalled it 20-30 ms. Appended messages get their
# bubbles a pass later, one bubble a pass, and the bubbles come from spares (one per role) built ahead,
# SPARE_AFTER_MS after the last was used, when the reply is streaming or done: a send fills them in.
SPARE_AFTER_MS = 1000


class ChatView(QScrollArea):
    """Renders a ChatModel: bubbles in a column, the eviction marker between the forgotten and seen ones."""

    copy_requested = Signal(str)
    switch_requested = Signal(int, int)  # message index, step (-1 / +1)
    edit_requested = Signal(int)         # message index
    regenerate_requested = Signal(int)   # message index of the reply
    fork_requested = Signal(int)         # message index
    tool_action = Signal(int, str)       # a tool card's index and button ("run", "always", "deny", "stop")
    delete_requested = Signal(int)       # message index (one of several alternatives)

    def __init__(self, model: ChatModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setAccessibleName("Conversation")
        self.column = QWidget()
        self.column.setObjectName("chatColumn")
        self.layout_ = QVBoxLayout(self.column)
        self.layout_.setContentsMargins(16, 12, 16, 12)
        self.layout_.setSpacing(10)
        self.empty = QLabel("Start a conversation: type a message below and press Enter.\n"
                            "The statistics panel on the right shows what the model's cache is doing.")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setWordWrap(True)
        self.empty.setEnabled(False)
        self.layout_.addWidget(self.empty)
        self.marker = EvictionMarker()
        self.marker.hide()
        self.layout_.addWidget(self.marker)
        self.layout_.addStretch(1)
        self.setWidget(self.column)
        self.widgets: list[MessageWidget] = []  # the bubbles of messages[top:], in order
        self.top = 0  # messages before it have no bubble yet: a long chat's older messages, built a slice a tick
        self._building = QTimer(self)
        self._building.setSingleShot(True)
        self._building.setInterval(BUILD_EVERY_MS)
        self._building.timeout.connect(self._build_slice)
        # While bubbles are built above what is read, the bubble at the view's top stays where it is on screen.
        self._anchor: tuple[MessageWidget, int] | None = None  # (that bubble, the view's offset from its top)
        self._anchored = False
        self._restoring = False  # the view is being put back at the anchor (not the user scrolling)
        self._unanchor = QTimer(self)  # until the layout has placed the last slice
        self._unanchor.setSingleShot(True)
        self._unanchor.setInterval(200)
        self._unanchor.timeout.connect(lambda: setattr(self, "_anchored", False))
        self.locked = False  # a reply is being written: no switching, editing or forking
        self._spares: dict[str, MessageWidget] = {}  # role -> a hidden bubble built ahead for the next append
        self._tail = QTimer(self)  # builds the bubbles of messages appended since, one a pass of the event loop
        self._tail.setSingleShot(True)
        self._tail.setInterval(0)
        self._tail.timeout.connect(self._build_tail)
        self._restock = QTimer(self)
        self._restock.setSingleShot(True)
        self._restock.timeout.connect(self._build_spares)
        self._dirty: set[int] = set()
        self._refresh = QTimer(self)
        self._refresh.setSingleShot(True)
        self._refresh.setInterval(REFRESH_MS)
        self._refresh.timeout.connect(self._flush)
        self._stick = True  # follow new text while the view is scrolled to the bottom
        self._revealing = -1  # a message being revealed: kept in view while the bubbles above settle their heights
        self._reveal_end = QTimer(self)
        self._reveal_end.setSingleShot(True)
        self._reveal_end.setInterval(FLASH_MS)
        self._reveal_end.timeout.connect(self._end_reveal)
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self.verticalScrollBar().valueChanged.connect(self._note_position)
        # Shown while the view is scrolled up (older messages being read): the way back to the end, where the
        # view follows a reply as it is written again. New text never moves the view while it shows.
        self.jump = QToolButton(self.viewport())
        self.jump.setObjectName("jumpToBottom")
        self.jump.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.jump.setAccessibleName("Scroll to the latest message")
        self.jump.setToolTip("Scroll to the latest message and follow the reply")
        self.jump.setCursor(Qt.CursorShape.PointingHandCursor)
        self.jump.setStyleSheet("QToolButton { background: palette(highlight); color: palette(highlighted-text); "
                                "border: none; border-radius: 13px; padding: 5px 14px; font-weight: bold; }")
        self.jump.clicked.connect(self.follow_again)
        self.jump.hide()
        model.changed.connect(self._update_jump)  # a reply starts or stops being written: the label says which
        model.reset.connect(self._rebuild)
        model.appended.connect(self._on_appended)
        model.changed.connect(self._on_changed)
        model.truncated.connect(self._on_truncated)
        model.replaced.connect(self._on_replaced)
        model.window_changed.connect(self._place_marker)
        self._rebuild()

    # --- model signals -----------------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        self._building.stop()
        self._tail.stop()
        for w in self.widgets:
            self.layout_.removeWidget(w)
            w.deleteLater()
        self.widgets = []
        self._dirty.clear()
        self._end_reveal()
        messages = self.model.messages
        self.top = len(messages) - EAGER_MESSAGES if len(messages) > LAZY_FROM else 0
        for message in messages[self.top:]:
            self._add_widget(message)
        self._stick = True
        self._place_marker()
        self.empty.setVisible(not messages)
        self._update_jump()
        QTimer.singleShot(0, self, self.scroll_to_bottom)
        if len(self._spares) < 2:
            self._restock.start(SPARE_AFTER_MS)
        if self.top:
            self._anchored = True
            self._building.start()

    def _build_slice(self) -> None:
        """Builds the bubbles of older messages above those built, for about BUILD_SLICE_MS."""
        start = time.perf_counter()
        below = self.top
        while self.top:
            self.top -= 1
            self._add_widget(self.model.messages[self.top], front=True)
            if (time.perf_counter() - start) * 1e3 >= BUILD_SLICE_MS:
                break
        if self.top:
            self._building.start()
        else:
            self._unanchor.start()
        for i in range(self.top, below):  # the new ones only: those below show their state already
            self._render(i)
        self._move_marker()

    def build_all(self) -> None:
        """Builds every bubble now (something needs an old message's bubble: a search hit, the marker)."""
        self._catch_up()
        self._building.stop()
        while self.top:
            self.top -= 1
            self._add_widget(self.model.messages[self.top], front=True)
        self._unanchor.start()
        self._place_marker()

    def _built_to(self) -> int:
        """Messages from here on were appended and have no bubble yet (a pass of the event loop later)."""
        return self.top + len(self.widgets)

    def _build_tail(self) -> None:
        index = self._built_to()
        if index >= len(self.model.messages):
            return
        self._add_widget(self.model.messages[index])
        # Only the new bubble: a message added at the end moves nobody else in or out of the window (the engine
        # reports that with window_changed), and rendering all 200 bubbles of a long chat cost a send 6 ms each.
        self._move_marker()
        self._render(index)
        if index + 1 < len(self.model.messages):
            self._tail.start()

    def _catch_up(self) -> None:
        """Builds the bubbles of appended messages now (before a change that counts on every bubble)."""
        while self._built_to() < len(self.model.messages):
            self._build_tail()
        self._tail.stop()

    def widget(self, index: int) -> MessageWidget | None:
        """Message `index`'s bubble (None: not built yet)."""
        return self.widgets[index - self.top] if self.top <= index < self.top + len(self.widgets) else None

    def _add_widget(self, message: Message, front: bool = False) -> None:
        spare = self._spares.pop(message.role, None)
        w = spare or self._new_bubble(message)
        if front:  # above the others, below the empty-chat label
            self.layout_.insertWidget(1, w)
            self.widgets.insert(0, w)
        else:  # before the stretch at the end; the marker moves between them
            self.layout_.insertWidget(self.layout_.count() - 1, w)
            self.widgets.append(w)
        if spare is not None:
            spare.set_message(message)
            spare.show()  # after the layout has it: never shown where it sat outside it
            self._restock.start(SPARE_AFTER_MS)
        if front:
            w.set_alternatives(*self.model.alternatives(self.top), self.locked)

    def _new_bubble(self, message: Message) -> MessageWidget:
        w = MessageWidget(message, self.column)
        w.copy_requested.connect(self.copy_requested)
        # By the widget, not a fixed index: the index is looked up when asked, after any change above it.
        w.switch_requested.connect(lambda step: self.switch_requested.emit(self._index(w), step))
        w.edit_requested.connect(lambda: self.edit_requested.emit(self._index(w)))
        w.regenerate_requested.connect(lambda: self.regenerate_requested.emit(self._index(w)))
        w.fork_requested.connect(lambda: self.fork_requested.emit(self._index(w)))
        w.tool_action.connect(lambda action: self.tool_action.emit(self._index(w), action))
        w.delete_requested.connect(lambda: self.delete_requested.emit(self._index(w)))
        return w

    def _build_spares(self) -> None:
        """Builds one missing spare bubble (5-7 ms), and the next one a little later: one would be a stall."""
        missing = [role for role in ("user", "assistant") if role not in self._spares]
        if not missing:
            return
        w = self._new_bubble(Message(missing[0], ""))
        # Shown once, where nothing sees it, and hidden: a first show polishes and lays out every child (2-3 ms a
        # bubble). Hidden, a child of the column outside its layout takes no room.
        w.setGeometry(0, -10 * self.column.height() - 1000, self.viewport().width(), 100)
        w.show()
        w.hide()
        self._spares[missing[0]] = w
        if len(missing) > 1:
            self._restock.start(BUILD_EVERY_MS)

    def _index(self, w: MessageWidget) -> int:
        return self.top + self.widgets.index(w)

    def _on_appended(self, index: int) -> None:
        self.empty.hide()
        self._stick = True
        if not self._tail.isActive():
            self._tail.start()

    def _on_changed(self, index: int) -> None:
        self._dirty.add(index)
        if not self._refresh.isActive():
            self._refresh.start()

    def _on_truncated(self, index: int) -> None:
        self._catch_up()
        self._drop_from(index)
        self.empty.setVisible(not self.model.messages)
        self._place_marker()

    def _on_replaced(self, index: int) -> None:
        # Another branch from `index` on: its bubbles replace those below, rendered once (not once per message),
        # and the view stays where it is, at the message whose alternative was chosen.
        self._catch_up()
        self._drop_from(index)
        for message in self.model.messages[index:]:
            self._add_widget(message)
        self.empty.setVisible(not self.model.messages)
        self._place_marker()

    def _drop_from(self, index: int) -> None:
        """Removes the bubbles of messages `index` on (building those above first if `index` has none yet)."""
        if index < self.top:
            self.build_all()
        for w in self.widgets[index - self.top:]:
            self.layout_.removeWidget(w)
            w.deleteLater()
        del self.widgets[index - self.top:]
        self._dirty = {i for i in self._dirty if i < index}

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        start = time.perf_counter()
        for i in sorted(dirty):
            self._render(i)
        # A long reply costs more to lay out each time: render less often so the event loop stays free
        # (at most a fifth of the time goes to re-rendering a streaming reply).
        spent_ms = (time.perf_counter() - start) * 1e3
        self._refresh.setInterval(max(REFRESH_MS, min(500, int(spent_ms * 4))))

    def flush(self) -> None:
        """Renders pending changes now (tests and screenshots call this instead of waiting a tick)."""
        self._catch_up()
        self._refresh.stop()
        self._flush()

    def _render(self, index: int) -> None:
        w = self.widget(index)
        if w is None:
            return  # built later, from the message as it is then
        forgotten = index < self.model.forgotten()
        w.set_message(self.model.messages[index], forgotten, self.model.partly_forgotten(index),
                      self.model.seen_of(index))
        w.set_alternatives(*self.model.alternatives(index), self.locked)

    def set_locked(self, locked: bool) -> None:
        """While a reply is being written nothing can switch branch, be edited or be forked."""
        self.locked = locked
        for i, w in enumerate(self.widgets, self.top):
            w.set_alternatives(*self.model.alternatives(i), locked)

    def _place_marker(self) -> None:
        self._move_marker()
        # Cheap for the bubbles whose window state did not change: set_message skips what it already shows.
        for i in range(self.top, self.top + len(self.widgets)):
            self._render(i)

    def _move_marker(self) -> None:
        n = self.model.forgotten()
        self.layout_.removeWidget(self.marker)
        # Above the first bubble only once every bubble above it is built.
        if 0 < n <= self.top + len(self.widgets) and (n > self.top or not self.top):
            self.marker.set_counts(self.model.evicted, self.model.sinks, self.model.left_out)
            # Index in the layout: the empty label first, then the message widgets.
            self.layout_.insertWidget(1 + n - self.top, self.marker)
            self.marker.show()
        else:
            self.marker.set_counts(0, 0, False)
            self.layout_.insertWidget(self.layout_.count() - 1, self.marker)
            self.marker.hide()

    # --- scrolling -----------------------------------------------------------------------------------------

    def _note_position(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick = value >= bar.maximum() - 24
        if self._anchored and not self._stick and not self._restoring:
            w = next((w for w in self.widgets if w.geometry().bottom() >= value), None)
            self._anchor = (w, value - w.geometry().top()) if w else None
        self._update_jump()

    def _follow(self, _min: int, _max: int) -> None:
        bar = self.verticalScrollBar()
        if self._revealing >= 0:
            self._show_revealed()
        elif self._stick:
            bar.setValue(bar.maximum())
        elif self._anchored and self._anchor:
            # Now, and again once the layout has moved the bubbles (their geometry may not be updated yet).
            self._restore_anchor()
            QTimer.singleShot(0, self, self._restore_anchor)
        self._update_jump()

    def _restore_anchor(self) -> None:
        if self._stick or not self._anchor or self._anchor[0] not in self.widgets:
            return
        w, offset = self._anchor
        self._restoring = True
        try:
            self.verticalScrollBar().setValue(w.geometry().top() + offset)
        finally:
            self._restoring = False

    def _update_jump(self, *_: object) -> None:
        bar = self.verticalScrollBar()
        up = not self._stick and bar.value() < bar.maximum() - 24
        if up:
            writing = bool(self.model.messages) and self.model.messages[-1].streaming
            text = "↓  Follow the reply" if writing else "↓  Latest message"
            if text != self.jump.text():
                self.jump.setText(text)
                self.jump.adjustSize()
            self._place_jump()
            self.jump.raise_()
        self.jump.setVisible(up)

    def _place_jump(self) -> None:
        v = self.viewport()
        self.jump.move((v.width() - self.jump.width()) // 2, v.height() - self.jump.height() - 12)

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._place_jump()

    def follow_again(self) -> None:
        """Back to the end of the chat, following the reply being written from there."""
        self._end_reveal()
        self._stick = True
        self.scroll_to_bottom()
        self._update_jump()

    def reveal(self, index: int) -> None:
        """Scrolls message `index` into view and highlights it for a moment (a search hit was opened)."""
        if not 0 <= index < len(self.model.messages):
            return
        if index < self.top:
            self.build_all()
        self._stick = False
        self._revealing = index
        self._reveal_end.start()
        self.flush()
        self.widget(index).flash()
        # Now and once the layout has run: the bubbles' heights settle after they are first shown.
        self._show_revealed()
        QTimer.singleShot(0, self, self._show_revealed)

    def _show_revealed(self) -> None:
        w = self.widget(self._revealing)
        if w is not None:
            # Its top a little below the view's top (the column is the bubbles' parent): a long message is
            # read from its start, and the one before it shows that this is the middle of a chat.
            top = w.geometry().top()
            self.verticalScrollBar().setValue(max(0, top - min(self.viewport().height() // 4, 80)))

    def _end_reveal(self) -> None:
        self._revealing = -1
        self._reveal_end.stop()

    def scroll_to_marker(self) -> None:
        """Shows where the model's view begins: the marker between messages, else the note inside a message."""
        self.build_all()
        if not self.marker.isHidden():
            self._stick = False
            self.ensureWidgetVisible(self.marker, 0, self.viewport().height() // 3)
            return
        for w in self.widgets:
            y = w.cut_y()
            if y >= 0:
                self._stick = False
                top = w.geometry().top() + y  # the column is the bubbles' parent
                self.verticalScrollBar().setValue(max(0, top - self.viewport().height() // 3))
                return

    def scroll_to_bottom(self) -> None:
        if self._revealing >= 0:
            return  # a search hit was opened: stay at it
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def marker_index(self) -> int:
        """Where the marker sits: the number of message bubbles above it (-1 when hidden)."""
        if self.marker.isHidden():
            return -1
        return self.top + self.layout_.indexOf(self.marker) - 1


def copy_to_clipboard(text: str) -> None:
    QGuiApplication.clipboard().setText(text)
