"""The live statistics: the cache window, this turn's prefill and decode speed, TTFT per turn, all turns."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QAbstractItemView, QFrame, QGridLayout, QHeaderView, QLabel, QTableView, QVBoxLayout, QWidget

from engine.events import CacheStats, Prefill

from .cache_bar import CacheBar
from .models import TurnStatsModel
from .ttft_chart import TtftChart
from .worker_payloads import ModelInfo


def _heading(text: str) -> QLabel:
    label = QLabel(text)
    font = label.font()
    font.setBold(True)
    label.setFont(font)
    return label


class StatsPanel(QFrame):
    show_marker_requested = Signal()

    def __init__(self, turns: TurnStatsModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Statistics")
        self.setMinimumWidth(260)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 10, 10, 10)
        layout.setSpacing(6)

        layout.addWidget(_heading("Cache window"))
        self.cache_bar = CacheBar()
        layout.addWidget(self.cache_bar)
        self.cache_label = QLabel(self.cache_bar.legend_html())
        self.cache_label.setTextFormat(Qt.TextFormat.RichText)
        self.cache_label.setAccessibleName("Cache summary")
        layout.addWidget(self.cache_label)
        # Which messages the model still sees, with a link to the marker in the chat.
        self.context_label = QLabel("")
        self.context_label.setWordWrap(True)
        self.context_label.setAccessibleName("Messages the model sees")
        self.context_label.setTextFormat(Qt.TextFormat.RichText)
        self.context_label.linkActivated.connect(lambda _link: self.show_marker_requested.emit())
        layout.addWidget(self.context_label)
        # A remote model: what Eddy cannot know there, said once (the figures below are the server's own).
        self.remote_label = QLabel("")
        self.remote_label.setWordWrap(True)
        self.remote_label.setAccessibleName("Remote model")
        self.remote_label.hide()
        layout.addWidget(self.remote_label)

        layout.addSpacing(6)
        layout.addWidget(_heading("This turn"))
        grid = QGridLayout()
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(2)
        self.prefill_value = QLabel("–")
        self.prefill_value.setAccessibleName("Prefill of this turn")
        # A rebuild's line ("… (rebuilt cache) · … tok/s") is wider than the panel: it wraps instead of clipping.
        self.prefill_value.setWordWrap(True)
        self.prefill_value.setAlignment(Qt.AlignmentFlag.AlignRight)
        self.ttft_value = QLabel("–")
        self.ttft_value.setAccessibleName("Time to first token")
        self.rate_value = QLabel("–")
        self.rate_value.setAccessibleName("Decode speed")
        font = self.rate_value.font()
        font.setPointSizeF(font.pointSizeF() * 1.4)
        font.setBold(True)
        self.rate_value.setFont(font)
        for row, (name, value) in enumerate((("New tokens", self.prefill_value), ("Time to first token", self.ttft_value),
                                             ("Decode", self.rate_value))):
            label = QLabel(name)
            label.setEnabled(False)  # the palette's dimmed text: a caption, not a value
            grid.addWidget(label, row, 0, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
            grid.addWidget(value, row, 1, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        layout.addLayout(grid)

        layout.addSpacing(6)
        layout.addWidget(_heading("Time to first token per turn"))
        self.chart = TtftChart(turns)
        layout.addWidget(self.chart)

        layout.addSpacing(6)
        layout.addWidget(_heading("Turns"))
        self.table = QTableView()
        self.table.setModel(turns)
        self.table.setAccessibleName("Turn statistics")
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setAccessibleName("Turn statistics columns")
        self.table.verticalHeader().setAccessibleName("Turn rows")
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setAlternatingRowColors(True)
        self.table.setShowGrid(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        self.table.verticalHeader().setDefaultSectionSize(self.table.fontMetrics().height() + 6)
        turns.rowsInserted.connect(lambda *_: self.table.scrollToBottom())
        # The # column fits its widest mark ("server", a turn number in the hundreds): Qt sizes a
        # ResizeToContents column from the rows it had when laid out, not from rows inserted since.
        turns.rowsInserted.connect(lambda *_: header.resizeSections())
        layout.addWidget(self.table, 1)

    # --- fed by the controller's signals -------------------------------------------------------------------

    def show_remote(self, info: ModelInfo) -> None:
        """Says, for a model on a server, which figures come from it and which Eddy cannot know."""
        remote = info.remote
        self.remote_label.setVisible(remote)
        if remote:
            self.remote_label.setText(
                "A model on a server: the window is its context; tokens and speeds are the server's own counts "
                "(estimated where it sends none). Nothing is cached here, so there is no reuse to show, and the "
                "time to first token includes the network.")

    def show_cache(self, stats: CacheStats) -> None:
        self.cache_bar.set_stats(stats)
        self.cache_label.setText(self.cache_bar.legend_html())
        self.cache_label.setAccessibleDescription(self.cache_bar.summary())

    def show_context(self, forgotten: int, total: int, partly: bool = False) -> None:
        """`partly`: the window's start falls inside a message (a long one streamed through it)."""
        link = self.palette().color(QPalette.ColorRole.Highlight).name()  # readable on light and dark
        if total and not forgotten and partly:
            self.context_label.setText("The model sees every message, but only the end of a long one. "
                                       f"<a href='#marker' style='color:{link}'>Show where</a>")
            return
        if total == 0 or forgotten == 0:
            self.context_label.setText("The model sees the whole chat." if total else "")
            return
        seen = total - forgotten
        self.context_label.setText(f"The model sees the last {seen} of {total} messages. "
                                   f"<a href='#marker' style='color:{link}'>Show where</a>")

    def show_prefill(self, ev: Prefill) -> None:
        """A turn's message went in: its prefill is the time to first token; the decode figure follows."""
        self._show_prefill(ev, "new")
        self.rate_value.setText("…")

    def show_rebuild(self, ev: Prefill) -> None:
        self._show_prefill(ev, "rebuilt cache")

    def _show_prefill(self, ev: Prefill, what: str) -> None:
        rate = ev.new_tokens / (ev.ms / 1e3) if ev.ms else 0.0
        self.prefill_value.setText(f"{ev.new_tokens:,} ({what}) · {rate:,.0f} tok/s")
        self.ttft_value.setText(f"{ev.ms:,.1f} ms")

    def show_rate(self, tok_s: float, tokens: int) -> None:
        self.rate_value.setText(f"{tok_s:,.1f} tok/s")
        self.rate_value.setToolTip(f"{tokens} tokens so far")

    def clear_turn(self) -> None:
        for label in (self.prefill_value, self.ttft_value, self.rate_value):
            label.setText("–")
