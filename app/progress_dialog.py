"""First run: the model is compiled (about two minutes) while this shows the stages and offers Cancel.

Not modal: the build runs on the engine thread, so the window stays usable (chats can be read) meanwhile.
Under the bar, the stage's own words: the tensors written of all, then how long the compiler has run.
"""
from __future__ import annotations

import time

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QProgressBar, QVBoxLayout, QWidget

from engine.build.progress import STAGES
STAGE_TEXT = {
    "loading weights": "Checking the model's weights",
    "exporting": "Exporting the StreamingLLM graph",
    "saving weights": "Converting the weights into the weights file",
    "compiling": "Compiling for this machine",
}


class BuildProgressDialog(QDialog):
    cancel_requested = Signal()

    def __init__(self, model_name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Preparing the model")
        self.setModal(False)
        self.setMinimumWidth(420)
        self.setAccessibleName("Model build progress")
        layout = QVBoxLayout(self)
        intro = QLabel(f"<b>Preparing {model_name}</b><br>Eddy compiles the model once for this machine and "
                       "these cache settings (about two minutes). Later starts take about a second.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        self.stage_labels: dict[str, QLabel] = {}
        for stage in STAGES:
            label = QLabel()
            self.stage_labels[stage] = label
            layout.addWidget(label)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setAccessibleName("Build progress")
        layout.addWidget(self.bar)
        self.detail = QLabel()
        self.detail.setAccessibleName("Build step")
        layout.addWidget(self.detail)
        self.elapsed = QLabel()
        self.elapsed.setEnabled(False)
        layout.addWidget(self.elapsed)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.cancel_button = self.buttons.button(QDialogButtonBox.StandardButton.Cancel)
        self.cancel_button.setAccessibleName("Cancel the build")
        self.buttons.rejected.connect(self._cancel)
        layout.addWidget(self.buttons)
        self.stage = ""
        self.fraction = 0.0
        self._started = time.monotonic()
        self._tick = QTimer(self)
        self._tick.setInterval(500)
        self._tick.timeout.connect(self._show_elapsed)
        self._tick.start()
        self.set_progress("loading weights", 0.0)

    def set_progress(self, stage: str, fraction: float) -> None:
        if stage != self.stage:
            self.detail.clear()  # the last stage's words no longer apply
        self.stage, self.fraction = stage, fraction
        current = STAGES.index(stage) if stage in STAGES else len(STAGES)
        for i, name in enumerate(STAGES):
            mark = "✓" if i < current else ("▶" if i == current else "○")
            text = f"{mark}  {STAGE_TEXT[name]}"
            self.stage_labels[name].setText(f"<b>{text}</b>" if i == current else text)
            self.stage_labels[name].setEnabled(i <= current)
        self.bar.setValue(int(fraction * 1000))
        self.bar.setFormat(f"{fraction * 100:.0f}%")
        self._show_elapsed()

    def set_detail(self, stage: str, detail: str) -> None:
        """What the stage is at ("tensor 12 of 272, 40 MB of 135 MB"); ignored if the stage has moved on."""
        if stage == self.stage:
            self.detail.setText(detail)

    def _show_elapsed(self) -> None:
        secs = int(time.monotonic() - self._started)
        self.elapsed.setText(f"{secs // 60}:{secs % 60:02d} elapsed")

    def _cancel(self) -> None:
        self.cancel_button.setEnabled(False)
        self.cancel_button.setText("Cancelling…")
        self.cancel_requested.emit()

    def reject(self) -> None:  # Esc or the close button: same as Cancel
        self._cancel()

    def finish(self) -> None:
        self._tick.stop()
        super().accept()
