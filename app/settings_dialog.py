"""The settings dialog: model and build options (a change rebuilds the model), generation and system prompt."""
from __future__ import annotations

from dataclasses import replace

from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from engine.config import DEVICES, DTYPES

from .settings import AppSettings

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_LABEL = f"{DEFAULT_MODEL_NAME} (default)"


def _spin(lo: int, hi: int, value: int, name: str, special: str | None = None) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    if special:
        box.setSpecialValueText(special)
    box.setValue(value)
    box.setAccessibleName(name)
    return box


def _dspin(lo: float, hi: float, step: float, value: float, name: str, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    box.setValue(value)
    box.setAccessibleName(name)
    return box


class SettingsDialog(QDialog):
    def __init__(self, current: AppSettings, parent: QWidget | None = None, override: str | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Eddy settings")
        self.setAccessibleName("Settings")
        self.current = current
        layout = QVBoxLayout(self)

        model_box = QGroupBox("Model (changing these rebuilds the model)")
        form = QFormLayout(model_box)
        self.model = QLineEdit(current.model)
        self.model.setPlaceholderText(DEFAULT_MODEL_LABEL)
        self.model.setAccessibleName("Model")
        self.model.setToolTip("Empty for the default model, tiny-random, a .gguf file or a Hugging Face model folder")
        pick_file = QPushButton("GGUF file…")
        pick_file.setAccessibleName("Choose a GGUF file")
        pick_file.clicked.connect(self._pick_file)
        pick_dir = QPushButton("Folder…")
        pick_dir.setAccessibleName("Choose a Hugging Face model folder")
        pick_dir.clicked.connect(self._pick_folder)
        reset = QPushButton("Default")
        reset.setAccessibleName("Use the default model")
        reset.clicked.connect(lambda: self.model.setText(""))
        row = QHBoxLayout()
        row.addWidget(self.model, 1)
        for b in (pick_file, pick_dir, reset):
            row.addWidget(b)
        form.addRow("Model", row)
        if override is not None:
            note = QLabel(f"This run uses --model {override}; a model chosen here replaces it.")
            note.setWordWrap(True)
            note.setEnabled(False)
            form.addRow("", note)
        self.sinks = _spin(0, 256, current.sinks, "Attention sinks")
        self.sinks.setToolTip("Tokens at the start of a conversation the model keeps forever")
        self.window = _spin(16, 32768, current.window, "Window")
        self.window.setToolTip("Most recent tokens the model keeps")
        self.dtype = QComboBox()
        self.dtype.addItems(DTYPES)
        self.dtype.setCurrentText(current.dtype)
        self.dtype.setAccessibleName("Weight type")
        self.device = QComboBox()
        self.device.addItems(DEVICES)
        self.device.setCurrentText(current.device)
        self.device.setAccessibleName("Device")
        self.max_chunk = _spin(1, 4096, current.max_chunk, "Prefill chunk")
        self.max_chunk.setToolTip("Longest prefill call of the compiled module")
        form.addRow("Attention sinks", self.sinks)
        form.addRow("Window", self.window)
        form.addRow("Weight type", self.dtype)
        form.addRow("Device", self.device)
        form.addRow("Prefill chunk", self.max_chunk)
        layout.addWidget(model_box)

        gen_box = QGroupBox("Generation")
        gen = QFormLayout(gen_box)
        self.max_new_tokens = _spin(1, 32768, current.max_new_tokens, "Max new tokens")
        self.temperature = _dspin(0.0, 5.0, 0.1, current.temperature, "Temperature")
        self.temperature.setToolTip("0 = greedy (always the most likely token)")
        self.top_k = _spin(0, 100000, current.top_k, "Top-k", special="off")
        self.top_p = _dspin(0.01, 1.0, 0.05, current.top_p, "Top-p")
        self.repeat_penalty = _dspin(0.5, 3.0, 0.05, current.repeat_penalty, "Repeat penalty")
        self.repeat_last_n = _spin(0, 4096, current.repeat_last_n, "Repeat window")
        self.seed = _spin(-1, 2**31 - 1, current.seed, "Seed", special="random")
        for label, w in (("Max new tokens", self.max_new_tokens), ("Temperature", self.temperature),
                         ("Top-k", self.top_k), ("Top-p", self.top_p), ("Repeat penalty", self.repeat_penalty),
                         ("Repeat window", self.repeat_last_n), ("Seed", self.seed)):
            gen.addRow(label, w)
        layout.addWidget(gen_box)

        layout.addWidget(QLabel("System prompt"))
        self.system_prompt = QPlainTextEdit(current.system_prompt)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("Optional: who the assistant is and how it answers")
        self.system_prompt.setFixedHeight(self.system_prompt.fontMetrics().lineSpacing() * 4 + 12)
        layout.addWidget(self.system_prompt)

        self.rebuild_note = QLabel("⚠ These changes rebuild the model: the first time for these settings takes "
                                   "about two minutes, with progress shown.")
        self.rebuild_note.setWordWrap(True)
        self.rebuild_note.setAccessibleName("Rebuild warning")
        layout.addWidget(self.rebuild_note)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d9453d")
        layout.addWidget(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

        for w in (self.sinks, self.window, self.max_chunk):
            w.valueChanged.connect(self._changed)
        for c in (self.dtype, self.device):
            c.currentTextChanged.connect(self._changed)
        self.model.textChanged.connect(self._changed)
        self._changed()

    def _pick_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.model.setText(path)

    def _pick_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder")
        if path:
            self.model.setText(path)

    def value(self) -> AppSettings:
        return replace(
            self.current, model=self.model.text().strip(), sinks=self.sinks.value(), window=self.window.value(),
            dtype=self.dtype.currentText(), device=self.device.currentText(), max_chunk=self.max_chunk.value(),
            max_new_tokens=self.max_new_tokens.value(), temperature=self.temperature.value(),
            top_k=self.top_k.value(), top_p=self.top_p.value(), repeat_penalty=self.repeat_penalty.value(),
            repeat_last_n=self.repeat_last_n.value(), seed=self.seed.value(),
            system_prompt=self.system_prompt.toPlainText().strip())

    def _changed(self, *_: object) -> None:
        self.rebuild_note.setVisible(self.current.needs_rebuild(self.value()))

    def accept(self) -> None:
        try:
            self.value().validate()
        except ValueError as e:
            self.error.setText(str(e))
            return
        super().accept()
