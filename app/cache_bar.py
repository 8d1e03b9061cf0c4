"""The cache as a bar: the attention-sink slots (those holding a pinned system prompt apart), the window's used and
free slots, and what was evicted."""
from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QPainter, QPainterPath, QPalette
from PySide6.QtWidgets import QSizePolicy, QWidget

from engine.events import CacheStats

from .colours import blend

SINK_COLOUR = QColor("#e0803a")    # warm: kept forever
PIN_COLOUR = QColor("#9b51e0")     # the sinks that hold the pinned system prompt
WINDOW_COLOUR = QColor("#2f80ed")  # the sliding window's used slots
MIN_SINK_PX = 6
BAR_PX = 22      # the bar itself
CAPTION_PX = 16  # under it, while a system prompt is pinned: a bracket under its sink slots, and a label


class CacheBar(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(BAR_PX)
        self.setAccessibleName("Cache window")
        self.stats = CacheStats(0, 0, 0, 0, 0, 0)
        self._describe()

    def set_stats(self, stats: CacheStats) -> None:
        self.stats = stats
        # The caption row is there only while the engine reports a pinned prompt, so the bar does not jump
        # for the users who never pin one.
        self.setFixedHeight(BAR_PX + (CAPTION_PX if self.pinned_label() else 0))
        self._describe()
        self.update()

    def pinned_label(self) -> str:
        """The pinned segment's caption ("" when no system prompt is pinned), from the engine's own count."""
        pinned = min(self.stats.pinned, self.stats.used, self.stats.sinks)
        return f"system prompt: {pinned:,} tokens pinned" if pinned else ""

    def pinned_width(self, width: float) -> float:
        """How wide the sink slots holding the pinned prompt are drawn, in a bar `width` pixels wide."""
        s = self.stats
        if not (s.capacity and s.sinks):
            return 0.0
        sink_w = max(MIN_SINK_PX, width * s.sinks / s.capacity)
        return sink_w * min(s.pinned, s.used, s.sinks) / s.sinks

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
        return QSize(240, self.height())

    def paintEvent(self, event) -> None:  # noqa: N802
        s = self.stats
        pal = self.palette()
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(0, 0, self.width(), BAR_PX).adjusted(0.5, 3.5, -0.5, -3.5)
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
        caption = self.pinned_label()
        if caption:
            # A bracket under exactly the sink slots that hold the prompt, and its label from there on.
            pin_w = max(2.0, self.pinned_width(rect.width()))
            top = BAR_PX - 1.0
            painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)  # crisp one-pixel lines
            painter.setPen(PIN_COLOUR)
            painter.drawLine(rect.left(), top, rect.left(), top + 4)
            painter.drawLine(rect.left(), top + 4, rect.left() + pin_w, top + 4)
            painter.drawLine(rect.left() + pin_w, top, rect.left() + pin_w, top + 4)
            text_rect = QRectF(rect.left(), top + 3, rect.width(), CAPTION_PX - 2)
            text = self.fontMetrics().elidedText(caption, Qt.TextElideMode.ElideRight, int(text_rect.width()))
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, text)
