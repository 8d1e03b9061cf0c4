"""Settings' "Model cache": the compiled builds kept on disk, their sizes and dates, and Delete.

Listing reads a few small files per entry, so it runs on the GUI thread; deleting a build of gigabytes can take
a while, so it runs on a thread of its own and the list refreshes when it ends. The entry a running Eddy has
loaded (this app's current model included) cannot be deleted: engine/artefacts/cache.py tells by its lock.
"""
from __future__ import annotations

import threading
import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QGroupBox, QHBoxLayout, QHeaderView, QLabel, QMessageBox,
                               QPushButton, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget)

from engine.artefacts.store import artefacts_root
from engine.artefacts.cache import CacheEntry, CacheError, describe_total, list_entries, remove
from engine.artefacts.progress import megabytes

# Two lines a row (model over its settings, date over time): the section shares the dialog's width with the
# generation column, too narrow for a column each.
COLUMNS = ("Build", "Size", "Last used")


def _when(entry: CacheEntry) -> str:
    if entry.state == "building":
        return "being built"
    if entry.state == "damaged":
        return "damaged"
    return time.strftime("%Y-%m-%d\n%H:%M", time.localtime(entry.last_used)) if entry.last_used else ""


class CacheSection(QGroupBox):
    deleted = Signal(str, str)  # from the deleting thread: the folder's name, an error ("" if none)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Model cache", parent)
        self.setAccessibleName("Model cache")
        layout = QVBoxLayout(self)
        self.total = QLabel()
        self.total.setWordWrap(True)
        self.total.setAccessibleName("Model cache total")
        self.total.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.total)
        self.tree = QTreeWidget()
        self.tree.setAccessibleName("Cached builds")
        self.tree.setHeaderLabels(COLUMNS)
        self.tree.setRootIsDecorated(False)
        self.tree.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.tree.header().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for column in range(1, len(COLUMNS)):
            self.tree.header().setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        metrics = self.tree.fontMetrics()
        self.tree.setFixedHeight(metrics.lineSpacing() * 7 + 12)
        # Wide enough for a usual build's settings, its size and date unelided.
        self.tree.setMinimumWidth(metrics.horizontalAdvance("q8, 128 sinks + 1020 window, chunk 64, cpu")
                                  + metrics.horizontalAdvance("9,999 MB") + metrics.horizontalAdvance("2026-12-01")
                                  + 60)
        self.tree.itemSelectionChanged.connect(self._selection_changed)
        layout.addWidget(self.tree)
        row = QHBoxLayout()
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setEnabled(False)
        row.addWidget(self.note, 1)
        self.delete_button = QPushButton("Delete")
        self.delete_button.setAccessibleName("Delete the selected build")
        self.delete_button.setToolTip("Frees its disk space; it is rebuilt (minutes) if it is needed again")
        self.delete_button.clicked.connect(self.delete_selected)
        row.addWidget(self.delete_button)
        layout.addLayout(row)
        self.confirm: QMessageBox | None = None  # the open confirmation (tests answer it)
        self.entries: list[CacheEntry] = []
        self._deleting: str | None = None
        self.deleted.connect(self._on_deleted)
        self.refresh()

    def refresh(self) -> None:
        root = artefacts_root()
        try:
            self.entries = list_entries(root)
        except OSError as e:
            self.entries = []
            self.total.setText(f"Cannot read the model cache in {root}: {e.strerror or e}")
        else:
            self.total.setText(describe_total(self.entries, root) if self.entries
                               else f"No compiled models are kept in {root}.")
        selected = self.selected()
        self.tree.clear()
        for e in self.entries:
            model = e.model + (" (in use)" if e.in_use else "")
            item = QTreeWidgetItem([f"{model}\n{e.summary()}", megabytes(e.size), _when(e)])
            item.setData(0, Qt.ItemDataRole.UserRole, e.name)
            for column in range(len(COLUMNS)):
                item.setToolTip(column, f"{e.model}: {e.summary()}\n{e.folder}")
            item.setTextAlignment(1, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.tree.addTopLevelItem(item)
            if selected is not None and e.name == selected.name:
                item.setSelected(True)
        self._selection_changed()

    def selected(self) -> CacheEntry | None:
        items = self.tree.selectedItems()
        if not items:
            return None
        name = items[0].data(0, Qt.ItemDataRole.UserRole)
        return next((e for e in self.entries if e.name == name), None)

    def select(self, name: str) -> None:
        for i in range(self.tree.topLevelItemCount()):
            item = self.tree.topLevelItem(i)
            item.setSelected(item.data(0, Qt.ItemDataRole.UserRole) == name)

    def _selection_changed(self) -> None:
        e = self.selected()
        why = ""
        if self._deleting is not None:
            why = f"Deleting {self._deleting}…"
        elif e is not None and e.in_use:
            why = "In use: the model loaded now (or by another Eddy) cannot be deleted."
        elif e is not None and e.state == "building":
            why = "Being built right now."
        self.note.setText(why)
        self.delete_button.setEnabled(e is not None and not e.in_use and e.state != "building"
                                      and self._deleting is None)

    def delete_selected(self) -> None:
        e = self.selected()
        if e is None or e.in_use or self._deleting is not None:
            return
        self.confirm = QMessageBox(QMessageBox.Icon.Question, "Delete a compiled model",
                                   f"Delete the compiled {e.model} ({e.summary()}, {megabytes(e.size)})?\n\n"
                                   f"If it is used again, it is rebuilt first (minutes).",
                                   QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self)
        self.confirm.setDefaultButton(QMessageBox.StandardButton.Cancel)
        answer = self.confirm.exec()
        self.confirm = None
        if answer != QMessageBox.StandardButton.Yes:
            return
        self._deleting = e.name
        self._selection_changed()

        def work() -> None:
            try:
                remove(e)
                error = ""
            except (CacheError, OSError) as err:
                error = str(err)
            try:
                self.deleted.emit(e.name, error)
            except RuntimeError:
                pass  # the dialog was closed meanwhile: nobody is left to tell

        threading.Thread(target=work, name="eddy-cache-delete", daemon=True).start()

    def _on_deleted(self, name: str, error: str) -> None:
        self._deleting = None
        self.refresh()
        if error:
            self.note.setText(error)
