"""The settings dialog: model and build options (a change rebuilds the model), generation and system prompt.

Sampling fields show the value in force: the user's own (in bold) or the loaded model's default. Leaving a
field at its default keeps it following the model; "Reset to the model's defaults" puts them all back.
"""
from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from engine.config import DEVICES, DTYPES, PIN_SLOTS
from engine.run.generation import SAMPLING_FIELDS, ChatDefaults

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
    def __init__(self, current: AppSettings, parent: QWidget | None = None, override: str | None = None,
                 defaults: ChatDefaults | None = None) -> None:
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
        row = QHBoxLayout()  # under the field, so a long path has the column's whole width
        for b in (pick_file, pick_dir, reset):
            row.addWidget(b)
        form.addRow("Model", self.model)
        form.addRow("", row)
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
        columns = QHBoxLayout()  # side by side: the dialog fits a small screen's height
        columns.addWidget(model_box, 1, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(columns)

        gen_box = QGroupBox("Generation")
        gen_column = QVBoxLayout(gen_box)
        gen = QFormLayout()
        self.defaults = defaults or ChatDefaults()
        self.defaults_note = QLabel()
        self.defaults_note.setWordWrap(True)
        self.defaults_note.setAccessibleName("Defaults in force")
        gen_column.addWidget(self.defaults_note)
        gen_column.addLayout(gen)
        self.max_new_tokens = _spin(1, 32768, current.max_new_tokens, "Max new tokens")
        shown = {**self.defaults.values, **current.sampling_overrides()}
        self.temperature = _dspin(0.0, 5.0, 0.1, shown["temperature"], "Temperature")
        self.temperature.setToolTip("0 = greedy (always the most likely token)")
        self.top_k = _spin(0, 100000, shown["top_k"], "Top-k", special="off")
        self.top_p = _dspin(0.01, 1.0, 0.05, shown["top_p"], "Top-p")
        self.min_p = _dspin(0.0, 0.99, 0.01, shown["min_p"], "Min-p", decimals=3)
        self.min_p.setSpecialValueText("off")
        self.min_p.setToolTip("Drops tokens less likely than this fraction of the most likely one")
        self.repeat_penalty = _dspin(0.5, 3.0, 0.05, shown["repeat_penalty"], "Repeat penalty")
        self.presence_penalty = _dspin(-2.0, 2.0, 0.1, shown["presence_penalty"], "Presence penalty")
        self.frequency_penalty = _dspin(-2.0, 2.0, 0.1, shown["frequency_penalty"], "Frequency penalty")
        self.repeat_last_n = _spin(0, 4096, shown["repeat_last_n"], "Repeat window")
        self.repeat_last_n.setToolTip("How many recent tokens the penalties look at")
        self.seed = _spin(-1, 2**31 - 1, current.seed, "Seed", special="random")
        self._sampling_rows: dict[str, QLabel] = {}
        for label, w, name in (("Max new tokens", self.max_new_tokens, None),
                               ("Temperature", self.temperature, "temperature"), ("Top-k", self.top_k, "top_k"),
                               ("Top-p", self.top_p, "top_p"), ("Min-p", self.min_p, "min_p"),
                               ("Repeat penalty", self.repeat_penalty, "repeat_penalty"),
                               ("Presence penalty", self.presence_penalty, "presence_penalty"),
                               ("Frequency penalty", self.frequency_penalty, "frequency_penalty"),
                               ("Repeat window", self.repeat_last_n, "repeat_last_n"), ("Seed", self.seed, None)):
            row_label = QLabel(label)
            gen.addRow(row_label, w)
            if name is not None:
                self._sampling_rows[name] = row_label
                w.valueChanged.connect(self._mark_own_values)
        self.reset_sampling = QPushButton("Reset to the model's defaults")
        self.reset_sampling.setAccessibleName("Reset to the model's defaults")
        self.reset_sampling.clicked.connect(self._reset_sampling)
        gen.addRow("", self.reset_sampling)
        self._mark_own_values()
        columns.addWidget(gen_box, 1)

        layout.addWidget(QLabel("System prompt"))
        self.system_prompt = QPlainTextEdit(current.system_prompt)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("Optional: who the assistant is and how it answers")
        self.system_prompt.setFixedHeight(self.system_prompt.fontMetrics().lineSpacing() * 4 + 12)
        layout.addWidget(self.system_prompt)
        self.pin_system = QCheckBox("Keep the system prompt in the cache for the whole chat (pinned in the sinks)")
        self.pin_system.setToolTip(f"Its tokens (up to {PIN_SLOTS}) become attention sinks: the assistant never "
                                   f"forgets it, however long the chat. Rebuilds the model once.")
        self.pin_system.setChecked(current.pin_system)
        layout.addWidget(self.pin_system)

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
        self.pin_system.toggled.connect(self._changed)
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
            max_new_tokens=self.max_new_tokens.value(), seed=self.seed.value(),
            system_prompt=self.system_prompt.toPlainText().strip(), pin_system=self.pin_system.isChecked(),
            **self._sampling_values())

    def _sampling_widget(self, name: str) -> QSpinBox | QDoubleSpinBox:
        return getattr(self, name)

    def _sampling_values(self) -> dict[str, float | int | None]:
        """The user's own values; None where a field shows the model's default (so it keeps following it)."""
        out: dict[str, float | int | None] = {}
        for name in SAMPLING_FIELDS:
            w = self._sampling_widget(name)
            default = self.defaults.values[name]
            if isinstance(w, QDoubleSpinBox):
                # Compare as shown: a default of 0.8999 sits in a 2-decimal box as 0.90 and is still the default.
                same = round(w.value(), w.decimals()) == round(float(default), w.decimals())
            else:
                same = w.value() == default
            out[name] = None if same else w.value()
        return out

    def _mark_own_values(self, *_: object) -> None:
        own = {k for k, v in self._sampling_values().items() if v is not None}
        for name, label in self._sampling_rows.items():
            font = label.font()
            font.setBold(name in own)
            label.setFont(font)
        where = self.defaults.describe()
        mine = (" Values in bold are yours and stay when the model changes; the others follow the model."
                if own else " Every value follows the model until you change it.")
        self.defaults_note.setText(f"Defaults in force: {where}.{mine}")
        self.reset_sampling.setEnabled(bool(own))

    def _reset_sampling(self) -> None:
        for name in SAMPLING_FIELDS:
            self._sampling_widget(name).setValue(self.defaults.values[name])

    def _changed(self, *_: object) -> None:
        self.rebuild_note.setVisible(self.current.needs_rebuild(self.value()))

    def accept(self) -> None:
        try:
            self.value().validate()
        except ValueError as e:
            self.error.setText(str(e))
            return
        super().accept()
