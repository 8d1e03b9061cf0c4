"""The header at the top of a chat: its system prompt (elided; click to edit) and a preset picker.

It renders app/system_prompts.SystemPrompts and hands every choice back to it; the controller does the rest
(the engine gets the chat's prompt, its cache is rebuilt). Presets are saved from here and renamed or deleted
in a small dialog.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QHBoxLayout, QInputDialog, QLabel, QListWidget,
                               QPlainTextEdit, QPushButton, QToolButton, QVBoxLayout, QWidget)

from .elided_label import ClickableElidedLabel
from .system_prompts import CUSTOM_CHOICE, DEFAULT_CHOICE, SystemPrompts


class SystemPromptBar(QWidget):
    def __init__(self, prompts: SystemPrompts, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.prompts = prompts
        self.setAccessibleName("System prompt")
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 4, 8, 4)
        row.addWidget(QLabel("<b>System</b>"))
        self.text_label = ClickableElidedLabel()
        self.text_label.setCursor(Qt.CursorShape.PointingHandCursor)
        self.text_label.setAccessibleName("The chat's system prompt (click to edit)")
        self.text_label.clicked.connect(self.edit_prompt)
        row.addWidget(self.text_label, 1)
        self.picker = QComboBox()
        self.picker.setAccessibleName("System prompt preset")
        self.picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.picker.activated.connect(self._on_picked)
        row.addWidget(self.picker)
        self.save_button = QToolButton()
        self.save_button.setText("Save as preset…")
        self.save_button.clicked.connect(self._ask_preset_name)
        row.addWidget(self.save_button)
        self.manage_button = QToolButton()
        self.manage_button.setText("Presets…")
        self.manage_button.clicked.connect(self._manage)
        row.addWidget(self.manage_button)
        prompts.changed.connect(self.render)
        self.render()

    @property
    def shown_text(self) -> str:
        """The whole prompt the label stands for (it shows it elided)."""
        return self.prompts.effective

    def render(self) -> None:
        p = self.prompts
        text = " ".join(p.effective.split())
        if not text:
            text = "(none)"
        source = "Settings' default" if p.chat_prompt is None else "this chat's own"
        self.text_label.set_fixed_tooltip(f"{source} system prompt; click to edit:\n\n{p.effective or '(none)'}")
        self.text_label.setText(text)
        self.picker.blockSignals(True)  # rebuilding the list is not a choice
        self.picker.clear()
        self.picker.addItem(DEFAULT_CHOICE)
        for name, _ in p.presets:
            self.picker.addItem(name)
        self.picker.addItem(CUSTOM_CHOICE)
        self.picker.setCurrentText(p.choice)
        self.picker.blockSignals(False)
        self.save_button.setEnabled(bool(p.effective.strip()))
        self.manage_button.setEnabled(bool(p.presets))

    def _on_picked(self, index: int) -> None:
        choice = self.picker.itemText(index)
        if choice == CUSTOM_CHOICE:
            self.edit_prompt()
        else:
            self.prompts.pick(choice)

    def edit_prompt(self) -> None:
        """The editor for this chat's own prompt; OK makes it the chat's (Cancel changes nothing)."""
        dialog = PromptEditor(self.prompts.effective, self)
        if dialog.exec() == QDialog.DialogCode.Accepted:
            self.prompts.set_chat_prompt(dialog.text())
        else:
            self.render()  # the picker goes back from "Custom…" to what the chat has

    def _manage(self) -> None:
        dialog = PresetsDialog(self.prompts, self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)  # its connection to the model goes with it
        dialog.exec()

    def _ask_preset_name(self) -> None:
        name, ok = QInputDialog.getText(self, "Save as preset", "Name of the preset:", text=self.prompts.choice
                                        if self.prompts.choice not in (DEFAULT_CHOICE, CUSTOM_CHOICE) else "")
        if ok:
            self.save_as_preset(name)

    def save_as_preset(self, name: str) -> bool:
        """Saves the prompt shown as a preset named `name` and makes this chat use it."""
        text = self.prompts.effective
        if not self.prompts.save_preset(name, text):
            return False
        self.prompts.set_chat_prompt(text)
        return True


class PromptEditor(QDialog):
    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("This chat's system prompt")
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("The system prompt for this chat (the next reply starts from it):"))
        self.edit = QPlainTextEdit(text)
        self.edit.setAccessibleName("System prompt")
        layout.addWidget(self.edit)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.resize(520, 260)

    def text(self) -> str:
        return self.edit.toPlainText().strip()


class PresetsDialog(QDialog):
    """Rename or delete the saved presets."""

    def __init__(self, prompts: SystemPrompts, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.prompts = prompts
        self.setWindowTitle("System prompt presets")
        layout = QVBoxLayout(self)
        self.list = QListWidget()
        self.list.setAccessibleName("Presets")
        layout.addWidget(self.list)
        row = QHBoxLayout()
        rename = QPushButton("Rename…")
        rename.clicked.connect(self._rename)
        delete = QPushButton("Delete")
        delete.clicked.connect(self._delete)
        close = QPushButton("Close")
        close.clicked.connect(self.accept)
        for b in (rename, delete):
            row.addWidget(b)
        row.addStretch(1)
        row.addWidget(close)
        layout.addLayout(row)
        prompts.changed.connect(self.render)
        self.render()

    def render(self) -> None:
        self.list.clear()
        for name, text in self.prompts.presets:
            self.list.addItem(name)
            self.list.item(self.list.count() - 1).setToolTip(text)

    def _selected(self) -> str | None:
        item = self.list.currentItem()
        return item.text() if item is not None else None

    def _rename(self) -> None:
        old = self._selected()
        if old is None:
            return
        new, ok = QInputDialog.getText(self, "Rename preset", "New name:", text=old)
        if ok and new.strip() != old:
            self.prompts.rename_preset(old, new)

    def _delete(self) -> None:
        name = self._selected()
        if name is not None:
            self.prompts.delete_preset(name)
