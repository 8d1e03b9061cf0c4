"""Search hits on screen: a list that renders a SearchResultsModel (title, who wrote it, the snippet with its
matches in bold), the live search that fills one from a text field, and the Ctrl+K popup.

The searching itself is the controller's (ChatController.search); these widgets only ask and render.
"""
from __future__ import annotations

import html
from typing import Callable

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QAbstractTextDocumentLayout, QKeyEvent, QPalette, QTextDocument
from PySide6.QtWidgets import (QDialog, QLabel, QLineEdit, QListView, QStyle, QStyledItemDelegate,
                               QStyleOptionViewItem, QVBoxLayout, QWidget)

from .models import SearchResultsModel
from .store import SearchHit
from .store_search import MARK_END, MARK_START

SEARCH_DELAY_MS = 150  # typing pauses this long before a search runs: one query per word, not per key


def hit_html(hit: SearchHit) -> str:
    """A hit as rich text: the chat's title, then who wrote the message and the snippet, matches in bold."""
    def marked(text: str) -> str:
        return html.escape(text).replace(MARK_START, "<b>").replace(MARK_END, "</b>")

    if hit.message_id is None:
        return f"{marked(hit.snippet)}<br><small>chat title</small>"
    who = "You" if hit.role == "user" else "Eddy"
    return f"<small>{html.escape(hit.title)}</small><br><i>{who}:</i> {marked(hit.snippet)}"


class HitDelegate(QStyledItemDelegate):
    """Paints a hit's rich text, wrapped to the list's width."""

    def _document(self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex) -> QTextDocument:
        doc = QTextDocument()
        doc.setDefaultFont(option.font)
        doc.setDocumentMargin(4)
        doc.setHtml(hit_html(index.data(SearchResultsModel.HitRole)))
        doc.setTextWidth(max(80, option.rect.width()))
        return doc

    def paint(self, painter, option: QStyleOptionViewItem, index) -> None:
        self.initStyleOption(option, index)
        widget = option.widget
        style = widget.style() if widget else None
        text_option = QStyleOptionViewItem(option)
        text_option.text = ""
        if style:
            style.drawControl(QStyle.ControlElement.CE_ItemViewItem, text_option, painter, widget)
        doc = self._document(option, index)
        context = QAbstractTextDocumentLayout.PaintContext()
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        context.palette.setColor(QPalette.ColorRole.Text, option.palette.color(role))
        painter.save()
        painter.translate(option.rect.topLeft())
        painter.setClipRect(option.rect.translated(-option.rect.topLeft()))
        doc.documentLayout().draw(painter, context)
        painter.restore()

    def sizeHint(self, option: QStyleOptionViewItem, index) -> QSize:  # noqa: N802
        self.initStyleOption(option, index)
        doc = self._document(option, index)
        return QSize(int(doc.idealWidth()), int(doc.size().height()) + 2)


class SearchResults(QListView):
    """The hits of a SearchResultsModel; Enter or a click emits hit_activated."""

    hit_activated = Signal(object)  # SearchHit

    def __init__(self, model: SearchResultsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setModel(model)
        self.setItemDelegate(HitDelegate(self))
        self.setWordWrap(True)
        self.setResizeMode(QListView.ResizeMode.Adjust)  # rows re-wrap when the list's width changes
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setVerticalScrollMode(QListView.ScrollMode.ScrollPerPixel)
        self.setAccessibleName("Search results")
        self.activated.connect(self._emit)
        self.clicked.connect(self._emit)

    def _emit(self, index: QModelIndex) -> None:
        hit = index.data(SearchResultsModel.HitRole)
        if hit is not None:
            self.hit_activated.emit(hit)


class LiveSearch:
    """Runs `search` on a field's text a moment after the typing stops and puts the hits into `model`."""

    def __init__(self, field: QLineEdit, search: Callable[[str], list[SearchHit]], model: SearchResultsModel,
                 messages_only: bool = False) -> None:
        self.field, self.search, self.model, self.messages_only = field, search, model, messages_only
        self.timer = QTimer(field)
        self.timer.setSingleShot(True)
        self.timer.setInterval(SEARCH_DELAY_MS)
        self.timer.timeout.connect(self.run)
        field.textChanged.connect(lambda _text: self.timer.start())

    def run(self) -> None:
        self.timer.stop()
        hits = self.search(self.field.text()) if self.field.text().strip() else []
        if self.messages_only:  # the sidebar's list already filters the titles itself
            hits = [h for h in hits if h.message_id is not None]
        self.model.set_hits(hits)


class SearchPopup(QDialog):
    """Ctrl+K: a search field over every chat; Enter opens the chosen hit, Esc closes."""

    hit_chosen = Signal(object)  # SearchHit

    def __init__(self, search: Callable[[str], list[SearchHit]], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Search chats")
        self.setAccessibleName("Search chats")
        self.resize(560, 420)
        layout = QVBoxLayout(self)
        self.field = QLineEdit()
        self.field.setPlaceholderText("Search every chat's titles and messages")
        self.field.setAccessibleName("Search text")
        self.field.setClearButtonEnabled(True)
        self.field.installEventFilter(self)
        layout.addWidget(self.field)
        self.model = SearchResultsModel(self)
        self.results = SearchResults(self.model)
        self.results.hit_activated.connect(self._choose)
        layout.addWidget(self.results, 1)
        self.status = QLabel()
        self.status.setAccessibleName("Search status")
        layout.addWidget(self.status)
        self.live = LiveSearch(self.field, search, self.model)
        self.model.modelReset.connect(self._show_count)
        self.field.returnPressed.connect(self._open_current)

    def open_search(self) -> None:
        self.field.selectAll()
        self.show()
        self.raise_()
        self.activateWindow()
        self.field.setFocus()

    def _show_count(self) -> None:
        n = len(self.model.hits)
        if not self.field.text().strip():
            self.status.setText("")
        else:
            self.status.setText("No matches" if n == 0 else f"{n} match{'es' if n != 1 else ''}")
        if n:
            self.results.setCurrentIndex(self.model.index(0))

    def _open_current(self) -> None:
        self.live.run()  # Enter before the pause: search now
        index = self.results.currentIndex()
        if index.isValid():
            self._choose(index.data(SearchResultsModel.HitRole))

    def _choose(self, hit: SearchHit) -> None:
        self.hide()
        self.hit_chosen.emit(hit)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802
        # Up and Down in the field move through the hits, so the keyboard never has to leave the field.
        if obj is self.field and isinstance(event, QKeyEvent) and event.type() == QKeyEvent.Type.KeyPress:
            if event.key() in (Qt.Key.Key_Down, Qt.Key.Key_Up) and self.model.hits:
                row = self.results.currentIndex().row()
                row = max(0, min(len(self.model.hits) - 1, row + (1 if event.key() == Qt.Key.Key_Down else -1)))
                self.results.setCurrentIndex(self.model.index(row))
                return True
        return super().eventFilter(obj, event)
