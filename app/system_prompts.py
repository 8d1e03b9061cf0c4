"""System prompts: the open chat's own prompt and the saved, named presets. No widgets here.

A chat's prompt is None until the user picks one: it then follows the app's default (Settings), as every chat
an older Eddy wrote does. The store keeps both (app/store.py, schema version 4); the controller gives the
engine the open chat's effective prompt (what it is, or the default) and rebuilds the cache when it changes.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import QObject, Signal

from .store import Store, StoreError

DEFAULT_CHOICE = "Default (from Settings)"
CUSTOM_CHOICE = "Custom…"


class SystemPrompts(QObject):
    changed = Signal()              # the presets, the open chat's prompt or the default changed: views re-render
    chat_prompt_changed = Signal()  # the open chat's effective prompt changed: the engine must be told
    failed = Signal(str)            # a write failed; the message is for the user

    def __init__(self, store: Store, default: Callable[[], str], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self._default = default
        self.conversation_id: int | None = None
        self.chat_prompt: str | None = None  # the open chat's own; None: the default
        self.presets: list[tuple[str, str]] = []
        self.reload_presets()

    # --- what the views show -------------------------------------------------------------------------------

    @property
    def default(self) -> str:
        return self._default()

    @property
    def effective(self) -> str:
        """What the engine is given for the open chat."""
        return self.default if self.chat_prompt is None else self.chat_prompt

    @property
    def choice(self) -> str:
        """The picker's entry: DEFAULT_CHOICE, the name of the preset whose text it is, or CUSTOM_CHOICE."""
        if self.chat_prompt is None:
            return DEFAULT_CHOICE
        return next((name for name, text in self.presets if text == self.chat_prompt), CUSTOM_CHOICE)

    def preset_text(self, name: str) -> str | None:
        return next((text for n, text in self.presets if n == name), None)

    # --- the open chat -------------------------------------------------------------------------------------

    def open(self, conversation_id: int | None) -> None:
        """The chat now shown (None: a new one, not saved yet, which starts on the default)."""
        self.conversation_id = conversation_id
        self.chat_prompt = None
        if conversation_id is not None and conversation_id >= 0:
            try:
                self.chat_prompt = self.store.system_prompt(conversation_id)
            except StoreError as e:
                self.failed.emit(str(e))
        self.changed.emit()

    def saved_as(self, conversation_id: int | None) -> None:
        """The open chat got its id (its first message was saved): a prompt picked before that is written now."""
        if conversation_id == self.conversation_id:
            return
        self.conversation_id = conversation_id
        if self.chat_prompt is not None:
            self._write_chat()

    def set_chat_prompt(self, text: str | None) -> None:
        """Gives the open chat its own prompt (None: back to the default)."""
        before = self.effective
        self.chat_prompt = text
        self._write_chat()
        self.changed.emit()
        if self.effective != before:
            self.chat_prompt_changed.emit()

    def pick(self, choice: str) -> None:
        """The picker's entry chosen: a preset's text, or the default (CUSTOM_CHOICE is the editor's to set)."""
        if choice == DEFAULT_CHOICE:
            self.set_chat_prompt(None)
        elif (text := self.preset_text(choice)) is not None:
            self.set_chat_prompt(text)

    def default_changed(self, before: str) -> None:
        """Settings' prompt changed (from `before`): a chat that follows it follows."""
        self.changed.emit()
        if self.chat_prompt is None and self.default != before:
            self.chat_prompt_changed.emit()

    def _write_chat(self) -> None:
        conv_id = self.conversation_id
        if conv_id is None or conv_id < 0:
            return  # not on disk yet: saved_as() writes it once it is
        try:
            self.store.set_system_prompt(conv_id, self.chat_prompt)
        except StoreError as e:
            self.failed.emit(str(e))

    # --- presets -------------------------------------------------------------------------------------------

    def reload_presets(self) -> None:
        try:
            self.presets = self.store.presets()
        except StoreError as e:
            self.failed.emit(str(e))
        self.changed.emit()

    def save_preset(self, name: str, text: str) -> bool:
        """Saves `text` under `name` (replacing a preset of that name); False if it could not be."""
        name = name.strip()
        if not name or name in (DEFAULT_CHOICE, CUSTOM_CHOICE):
            self.failed.emit("Choose another name for the preset.")
            return False
        return self._preset_write(lambda: self.store.save_preset(name, text))

    def rename_preset(self, old: str, new: str) -> bool:
        new = new.strip()
        if not new or new in (DEFAULT_CHOICE, CUSTOM_CHOICE) or (new != old and self.preset_text(new) is not None):
            self.failed.emit(f"A preset named {new!r} already exists, or the name is not allowed.")
            return False
        return self._preset_write(lambda: self.store.rename_preset(old, new))

    def delete_preset(self, name: str) -> bool:
        # A chat that uses its text keeps it (a chat stores the text, not the name): it shows as Custom.
        return self._preset_write(lambda: self.store.delete_preset(name))

    def _preset_write(self, write: Callable[[], None]) -> bool:
        try:
            write()
        except StoreError as e:
            self.failed.emit(str(e))
            return False
        self.reload_presets()
        return True
