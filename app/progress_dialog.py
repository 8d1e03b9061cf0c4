"""First run: the model is compiled while this shows the stages and offers Cancel.

Not modal: the build runs on the engine thread, so the window stays usable (chats can be read) meanwhile.
The weights file is written while the graph is exported and compiled, so more than one stage can be running:
each stage's line shows its own state and words (the tensors written of all, how long the compiler has run,
"done in 0:17"), and the bar the whole build, with the time left worked out from it.
"""
from __future__ import annotations

import time

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QProgressBar, QVBoxLayout, QWidget

from engine.artefacts.progress import FINISHED, STAGES, time_left

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
                       "these cache settings. Later starts take about a second.")
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
        # Not `done` or `running`: QDialog.accept() calls the virtual done(), which an attribute would shadow.
        self.started_stages: list[str] = []  # stages that have reported, in the order they started
        self.finished_stages: set[str] = set()
        self.details: dict[str, str] = {}
        self._started = time.monotonic()
        self._tick = QTimer(self)
        self._tick.setInterval(500)
        self._tick.timeout.connect(self._show_elapsed)
        self._tick.start()
        self.set_progress("loading weights", 0.0)

    def set_progress(self, stage: str, fraction: float) -> None:
        self.stage, self.fraction = stage, max(self.fraction, fraction)
        if stage in STAGES:
            if stage not in self.started_stages:
                self.started_stages.append(stage)
            if stage != "loading weights":  # its checks end as anything after it starts
                self.finished_stages.add("loading weights")
        self._render()
        self.bar.setValue(int(self.fraction * 1000))
        self.bar.setFormat(f"{self.fraction * 100:.0f}%")
        self._show_elapsed()

    def set_detail(self, stage: str, detail: str) -> None:
        """What a stage is at ("tensor 12 of 272, 40 MB of 135 MB"; "done in 0:17" when it is over)."""
        if stage not in STAGES:
            return
        self.details[stage] = detail
        if detail.startswith(FINISHED):
            self.finished_stages.add(stage)
        self._render()

    def _render(self) -> None:
        for name in STAGES:
            finished, started = name in self.finished_stages, name in self.started_stages
            mark = "✓" if finished else ("▶" if started else "○")
            text = f"{mark}  {STAGE_TEXT[name]}"
            words = self.details.get(name, "")
            if finished and words.startswith(FINISHED):
                text += f" ({words[len(FINISHED):]})"
            self.stage_labels[name].setText(f"<b>{text}</b>" if started and not finished else text)
            self.stage_labels[name].setEnabled(started or finished)
        # Under the bar, the words of every stage still running (the weights beside the export or the compiler).
        self.detail.setText(" · ".join(self.details[n] for n in self.started_stages
                                       if n not in self.finished_stages and self.details.get(n)))

    def _show_elapsed(self) -> None:
        spent = time.monotonic() - self._started
        secs = int(spent)
        left = time_left(self.fraction, spent)
        self.elapsed.setText(f"{secs // 60}:{secs % 60:02d} elapsed" + (f" · {left}" if left else ""))

    def _cancel(self) -> None:
        self.cancel_button.setEnabled(False)
        self.cancel_button.setText("Cancelling…")
        self.cancel_requested.emit()

    def reject(self) -> None:  # Esc or the close button: same as Cancel
        self._cancel()

    def finish(self) -> None:
        self._tick.stop()
        super().accept()
