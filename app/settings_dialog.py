"""The settings dialog: model and build options (a change rebuilds the model), generation and system prompt,
the model cache (the compiled builds kept on disk, app/cache_section.py) and the local server
(app/server_section.py).

Sampling fields show the value in force: the user's own (in bold) or the loaded model's default. Leaving a
field at its default keeps it following the model; "Reset to the model's defaults" puts them all back.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from engine.config import AUTO_DTYPE, DTYPE_CHOICES, KV_CHOICES, PIN_SLOTS
from engine.gpu import device_choices
from engine.run.generation import ChatDefaults, SamplingOverrides
from engine.run.sampling import OPTIONS, Option

from .cache_section import CacheSection
from .server_section import ServerSection
from .tools_section import ToolsSection
from .settings import AppSettings

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_LABEL = f"{DEFAULT_MODEL_NAME} (default)"
AUTO_LABEL = "auto (q4 for a 4-bit GGUF, else q8)"
AUTO_KV_LABEL = "auto (f16; f32 for f32 weights or on a GPU)"


def _spin(lo: int, hi: int, value: int, name: str, special: str | None = None) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    if special:
        box.setSpecialValueText(special)
    box.setValue(value)
    box.setAccessibleName(name)
    return box


def _option_box(option: Option, value: Any) -> QSpinBox | QDoubleSpinBox:
    """A sampler option's row, made from its entry in the sampler's table (engine.run.sampling.OPTIONS)."""
    box: QSpinBox | QDoubleSpinBox
    if option.kind is int:
        box = QSpinBox()
        box.setRange(int(option.low), int(option.high))
    else:
        box = QDoubleSpinBox()
        box.setDecimals(option.decimals)  # before the range and value, which it rounds
        box.setRange(option.low, option.high)
        box.setSingleStep(option.step)
    if option.off:
        box.setSpecialValueText(option.off)
    box.setValue(value)
    box.setAccessibleName(option.label)
    box.setToolTip(option.help[:1].upper() + option.help[1:])
    return box


class SettingsDialog(QDialog):
    def __init__(self, current: AppSettings, parent: QWidget | None = None, override: str | None = None,
                 defaults: ChatDefaults | None = None, tools: tuple[str, list] = ("", [])) -> None:
        """`tools`: the MCP servers' JSON text and their statuses (app/tools_section.py)."""
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
        self.model.setToolTip("Empty for the default model, tiny-random, a .gguf file, a Hugging Face model folder, or "
                              "the URL of an OpenAI-compatible server (http://host:port/v1: vLLM, llama.cpp, Ollama)")
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
        self.api_key = QLineEdit(current.api_key)
        self.api_key.setAccessibleName("API key of a remote model")
        self.api_key.setPlaceholderText("for a server URL that needs one")
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        form.addRow("API key", self.api_key)
        self.context = _spin(0, 10_000_000, current.context, "Server context", special="ask the server")
        self.context.setToolTip("A server model's context in tokens, for a server that does not say it (Ollama's "
                                "OpenAI endpoint) or to use less of it; Eddy fits the chat into it")
        form.addRow("Server context", self.context)
        self.model_folders = QLineEdit(current.model_folders.replace("|", "; "))
        self.model_folders.setAccessibleName("Model folders")
        self.model_folders.setPlaceholderText("folders of your own GGUFs, separated by ;")
        self.model_folders.setToolTip("The model picker lists the models in these folders too, beside those other "
                                      "apps downloaded (Hugging Face, LM Studio, GPT4All, Jan, Ollama)")
        form.addRow("Model folders", self.model_folders)
        if override is not None:
            note = QLabel(f"This run uses --model {override}; a model chosen here replaces it.")
            note.setWordWrap(True)
            note.setEnabled(False)
            form.addRow("", note)
        build = current.build
        self.sinks = _spin(0, 256, build.sinks, "Attention sinks")
        self.sinks.setToolTip("Tokens at the start of a conversation the model keeps forever")
        self.window = _spin(16, 32768, build.window, "Window")
        self.window.setToolTip("Most recent tokens the model keeps")
        self.dtype = QComboBox()
        for name in DTYPE_CHOICES:
            self.dtype.addItem(AUTO_LABEL if name == AUTO_DTYPE else name, name)
        self.dtype.setCurrentIndex(max(0, self.dtype.findData(build.dtype)))
        self.dtype.setToolTip("Bits a weight is stored in: fewer make a smaller, faster model, at some quality")
        self.dtype.setAccessibleName("Weight type")
        self.kv_dtype = QComboBox()
        for name in KV_CHOICES:
            self.kv_dtype.addItem(AUTO_KV_LABEL if name == AUTO_DTYPE else name, name)
        self.kv_dtype.setCurrentIndex(max(0, self.kv_dtype.findData(build.kv_dtype)))
        self.kv_dtype.setToolTip("Type of the keys and values the model keeps: 16 bits read half the memory per "
                                 "token over a long window")
        self.kv_dtype.setAccessibleName("KV cache type")
        self.device = QComboBox()
        for name, label, available in device_choices():
            self.device.addItem(label, name)
            # A device this machine lacks is shown, not offered; a choice made elsewhere is kept.
            self.device.model().item(self.device.count() - 1).setEnabled(available or name == build.device)
        self.device.setCurrentIndex(max(0, self.device.findData(build.device)))
        self.device.setAccessibleName("Device")
        self.max_chunk = _spin(1, 4096, build.max_chunk, "Prefill chunk")
        self.max_chunk.setToolTip("Longest prefill call of the compiled module")
        form.addRow("Attention sinks", self.sinks)
        form.addRow("Window", self.window)
        form.addRow("Weight type", self.dtype)
        form.addRow("KV cache type", self.kv_dtype)
        form.addRow("Device", self.device)
        form.addRow("Prefill chunk", self.max_chunk)
        columns = QHBoxLayout()  # side by side: the dialog fits a small screen's height
        left = QVBoxLayout()
        left.addWidget(model_box)
        self.cache = CacheSection()
        left.addWidget(self.cache)
        self.server = ServerSection(current.server)
        left.addWidget(self.server)
        self.tools = ToolsSection(*tools)
        left.addWidget(self.tools)
        left.addStretch(1)
        columns.addLayout(left, 3)  # the wider: the cache list has the longer lines
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
        chat = current.chat
        self.max_new_tokens = _spin(1, 32768, chat.max_new_tokens, "Max new tokens")
        gen.addRow("Max new tokens", self.max_new_tokens)
        # One row per sampler option, in the table's order, showing the value in force.
        shown = {**self.defaults.values, **current.sampling_overrides()}
        self.sampling: dict[str, QSpinBox | QDoubleSpinBox] = {}
        self._sampling_rows: dict[str, QLabel] = {}
        for name, option in OPTIONS.items():
            box = self.sampling[name] = _option_box(option, shown[name])
            row_label = self._sampling_rows[name] = QLabel(option.label)
            gen.addRow(row_label, box)
            box.valueChanged.connect(self._mark_own_values)
        self.seed = _spin(-1, 2**31 - 1, chat.seed, "Seed", special="random")
        gen.addRow("Seed", self.seed)
        self.reset_sampling = QPushButton("Reset to the model's defaults")
        self.reset_sampling.setAccessibleName("Reset to the model's defaults")
        self.reset_sampling.clicked.connect(self._reset_sampling)
        gen.addRow("", self.reset_sampling)
        self._mark_own_values()
        columns.addWidget(gen_box, 2)

        layout.addWidget(QLabel("System prompt"))
        self.system_prompt = QPlainTextEdit(chat.system_prompt)
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("Optional: who the assistant is and how it answers")
        self.system_prompt.setFixedHeight(self.system_prompt.fontMetrics().lineSpacing() * 4 + 12)
        layout.addWidget(self.system_prompt)
        self.pin_system = QCheckBox("Keep the system prompt in the cache for the whole chat (pinned in the sinks)")
        self.pin_system.setToolTip(f"Its tokens (up to {PIN_SLOTS}) become attention sinks: the assistant never "
                                   f"forgets it, however long the chat. Rebuilds the model once.")
        self.pin_system.setChecked(chat.pin_system)
        layout.addWidget(self.pin_system)

        self.rebuild_note = QLabel("⚠ These changes rebuild the model: the first time for these settings takes "
                                   "a minute or so (more for a large model), with progress shown.")
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
        for c in (self.dtype, self.kv_dtype, self.device):
            c.currentTextChanged.connect(self._changed)
        self.pin_system.toggled.connect(self._changed)
        self.model.textChanged.connect(self._changed)
        self.api_key.textChanged.connect(self._changed)
        self.context.valueChanged.connect(self._changed)
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
        c = self.current
        build = replace(c.build, sinks=self.sinks.value(), window=self.window.value(),
                        dtype=self.dtype.currentData(), kv_dtype=self.kv_dtype.currentData(),
                        device=self.device.currentData(),
                        max_chunk=self.max_chunk.value())
        chat = replace(c.chat, max_new_tokens=self.max_new_tokens.value(), seed=self.seed.value(),
                       system_prompt=self.system_prompt.toPlainText().strip(), pin_system=self.pin_system.isChecked(),
                       sampling=SamplingOverrides(**self._sampling_values()))
        return replace(c, model=self.model.text().strip(), api_key=self.api_key.text().strip(),
                       context=self.context.value(), build=build, chat=chat, server=self.server.value(),
                       model_folders="|".join(f.strip() for f in self.model_folders.text().split(";") if f.strip()))

    def _sampling_values(self) -> dict[str, float | int | None]:
        """The user's own values; None where a field shows the model's default (so it keeps following it)."""
        out: dict[str, float | int | None] = {}
        for name, w in self.sampling.items():
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
        for name, w in self.sampling.items():
            w.setValue(self.defaults.values[name])

    def _changed(self, *_: object) -> None:
        self.rebuild_note.setVisible(self.current.needs_rebuild(self.value()))

    def accept(self) -> None:
        try:
            self.value().validate()
        except ValueError as e:
            self.error.setText(str(e))
            return
        super().accept()
