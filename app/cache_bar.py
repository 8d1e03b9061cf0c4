"""The cache as a bar: the attention-sink slots (those holding a pinned system prompt apart), the window's used and
free slots, and what was evicted."""
from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPainterPath, QPalette
from PySide6.QtWidgets import QSizePolicy, QWidget

from engine.events import CacheStats

from .chat_view import blend

SINK_COLOUR = QColor("#e0803a")    # warm: kept forever
PIN_COLOUR = QColor("#9b51e0")     # the sinks that hold the pinned system prompt
WINDOW_COLOUR = QColor("#2f80ed")  # the sliding window's used slots
MIN_SINK_PX = 6


class CacheBar(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(22)
        self.setAccessibleName("Cache window")
        self.stats = CacheStats(0, 0, 0, 0, 0, 0)
        self._describe()

    def set_stats(self, stats: CacheStats) -> None:
        self.stats = stats
        self._describe()
        self.update()

    @property
    def window_used(self) -> int:
        s = self.stats
        return max(0, min(s.used, s.capacity) - s.sinks)

    def legend_html(self) -> str:
        """The bar's numbers, with colour keys, for a label next to it."""
        s = self.stats
        if not s.capacity:
            return "No model loaded"
        pinned = (f"<span style='color:{PIN_COLOUR.name()}'>■</span> system prompt pinned ({s.pinned}) &nbsp; "
                  if s.pinned else "")
        return (f"{pinned}<span style='color:{SINK_COLOUR.name()}'>■</span> sinks {min(s.used, s.sinks)}/{s.sinks}"
                f" &nbsp; <span style='color:{WINDOW_COLOUR.name()}'>■</span> window {self.window_used:,}/{s.window:,}"
                f"<br>{s.evicted:,} tokens evicted · {s.position:,} seen in this chat")

    def summary(self) -> str:
        s = self.stats
        if not s.capacity:
            return "No model loaded"
        pinned = f"system prompt pinned in {s.pinned} sinks · " if s.pinned else ""
        return (f"{pinned}{min(s.used, s.sinks)}/{s.sinks} sinks · window {self.window_used:,}/{s.window:,} used · "
                f"{s.evicted:,} evicted")

    def _describe(self) -> None:
        self.setToolTip(f"{self.summary()}\n{self.stats.position:,} tokens seen in this conversation.\n"
                        "Sinks (orange) keep the conversation's first tokens forever, a pinned system prompt "
                        "(purple) among them; the window (blue) keeps the most recent ones. Older tokens are "
                        "evicted.")
        self.setAccessibleDescription(self.summary())

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(240, 22)

    def paintEvent(self, event) -> None:  # noqa: N802
        s = self.stats
        pal = self.palette()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(0.5, 3.5, -0.5, -3.5)
        outline = QPainterPath()
        outline.addRoundedRect(rect, 5, 5)
        free = blend(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text), 0.08)
        painter.fillPath(outline, free)
        if s.capacity:
            painter.save()
            painter.setClipPath(outline)
            sink_w = max(MIN_SINK_PX, rect.width() * s.sinks / s.capacity) if s.sinks else 0.0
            window_w = rect.width() - sink_w
            used_sinks = min(s.used, s.sinks)
            if used_sinks:
                painter.fillRect(QRectF(rect.left(), rect.top(), sink_w * used_sinks / s.sinks, rect.height()),
                                 SINK_COLOUR)
            pinned = min(s.pinned, used_sinks)
            if pinned:
                painter.fillRect(QRectF(rect.left(), rect.top(), sink_w * pinned / s.sinks, rect.height()),
                                 PIN_COLOUR)
            if s.window:
                used_w = window_w * self.window_used / s.window
                painter.fillRect(QRectF(rect.left() + sink_w, rect.top(), used_w, rect.height()), WINDOW_COLOUR)
            if s.evicted:
                # The window is a ring: once it is full every new token evicts the oldest. Hatching says so.
                hatch = QColor(pal.color(QPalette.ColorRole.Base))
                hatch.setAlpha(90)
                painter.fillRect(QRectF(rect.left() + sink_w, rect.top(), window_w, rect.height()),
                                 QBrush(hatch, Qt.BrushStyle.BDiagPattern))
            painter.setPen(pal.color(QPalette.ColorRole.Base))
            if sink_w:
                painter.drawLine(rect.left() + sink_w, rect.top(), rect.left() + sink_w, rect.bottom())
            painter.restore()
        painter.setPen(blend(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text), 0.3))
        painter.drawPath(outline)
