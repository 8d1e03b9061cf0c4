"""Time to first token per turn, as bars: the signature of cache reuse is a flat row of short bars, with
tall ones only where the cache had to be rebuilt (↻) from a chat's history."""
from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFontMetrics, QMouseEvent, QPainter, QPalette
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from .colours import blend
from .models import TurnStatsModel

TURN_COLOUR = QColor("#2f80ed")
REBUILD_COLOUR = QColor("#e0803a")
SERVER_COLOUR = QColor("#8e5bd6")  # a local-server request: another conversation on the same engine
COLOURS = {"rebuild": REBUILD_COLOUR, "server": SERVER_COLOUR}
MAX_BARS = 40  # the most recent turns; older ones scroll off to the left


class TtftChart(QWidget):
    def __init__(self, model: TurnStatsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setMinimumHeight(110)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)
        self.setAccessibleName("Time to first token per turn")
        for sig in (model.modelReset, model.rowsInserted, model.rowsRemoved, model.dataChanged):
            sig.connect(self._changed)
        self._bars: list[tuple[QRectF, int]] = []
        self._changed()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(240, 120)

    def _changed(self, *_: object) -> None:
        rows = self.model.rows
        if rows:
            last = rows[-1]
            self.setAccessibleDescription(f"{len(rows)} prefills; the latest took {last.prefill_ms:.1f} ms "
                                          f"for {last.prefill_tokens} tokens")
        else:
            self.setAccessibleDescription("No turns yet")
        self.update()

    def _visible(self) -> list[int]:
        n = len(self.model.rows)
        return list(range(max(0, n - MAX_BARS), n))

    def paintEvent(self, event) -> None:  # noqa: N802
        pal = self.palette()
        text = pal.color(QPalette.ColorRole.Text)
        base = pal.color(QPalette.ColorRole.Base)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        fm = QFontMetrics(self.font())
        plot = QRectF(self.rect()).adjusted(4, fm.height() + 4, -4, -fm.height() - 4)
        painter.fillRect(QRectF(self.rect()), blend(base, text, 0.03))
        rows = self.model.rows
        visible = self._visible()
        self._bars = []
        painter.setPen(blend(base, text, 0.6))
        if not visible:
            painter.drawText(QRectF(self.rect()), Qt.AlignmentFlag.AlignCenter, "No turns yet")
            return
        top = max(rows[i].prefill_ms for i in visible) or 1.0
        painter.drawText(QPointF(4, fm.ascent() + 2), f"max {top:,.1f} ms")
        painter.setPen(blend(base, text, 0.15))
        painter.drawLine(plot.bottomLeft(), plot.bottomRight())
        slot = plot.width() / max(len(visible), 8)
        width = max(2.0, slot * 0.7)
        for k, i in enumerate(visible):
            r = rows[i]
            h = max(1.0, plot.height() * r.prefill_ms / top)
            bar = QRectF(plot.left() + k * slot + (slot - width) / 2, plot.bottom() - h, width, h)
            painter.fillRect(bar, COLOURS.get(r.kind, TURN_COLOUR))
            self._bars.append((QRectF(plot.left() + k * slot, plot.top(), slot, plot.height()), i))
        # Legend top right, latest value bottom left (elided so the two never collide).
        legend = [("■ turn", TURN_COLOUR), ("■ rebuild", REBUILD_COLOUR)]
        if any(rows[i].kind == "server" for i in visible):  # only when there is one: the panel is narrow
            legend.append(("■ server", SERVER_COLOUR))
        lx = self.width() - 4 - fm.horizontalAdvance("  ".join(entry for entry, _ in legend))
        for entry, colour in legend:
            painter.setPen(colour)
            painter.drawText(QPointF(lx, fm.ascent() + 2), entry)
            lx += fm.horizontalAdvance(entry + "  ")
        painter.setPen(blend(base, text, 0.6))
        last = rows[visible[-1]]
        latest = fm.elidedText(f"latest {last.prefill_ms:,.1f} ms for {last.prefill_tokens:,} tokens",
                               Qt.TextElideMode.ElideRight, int(plot.width()))
        painter.drawText(QPointF(plot.left(), plot.bottom() + fm.ascent() + 3), latest)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        for area, i in self._bars:
            if area.contains(event.position()):
                r = self.model.rows[i]
                label = {"rebuild": "cache rebuild", "server": "server request"}.get(r.kind) \
                    or f"turn {self.model.turn_number(i)}"
                QToolTip.showText(event.globalPosition().toPoint(),
                                  f"{label}: {r.prefill_tokens:,} tokens in {r.prefill_ms:,.1f} ms", self)
                return
        QToolTip.hideText()
