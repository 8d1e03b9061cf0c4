"""The main window: chats on the left, the conversation in the middle, live statistics on the right.

Only layout and wiring live here: user actions go to the ChatController, and the views render its models.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import (QByteArray, QEvent, QItemSelectionModel, QModelIndex, QSettings, QSortFilterProxyModel, Qt,
                            QTimer, Signal)
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QLineEdit, QListView,
                               QMainWindow, QMenu, QMessageBox, QPushButton, QSplitter, QToolButton, QVBoxLayout, QWidget)

from .chat_view import ChatView, copy_to_clipboard
from .compose import ComposeBox
from .controller import ChatController
from .documents import MAX_DOCUMENT_BYTES, size_text
from .draft_bar import DraftBar
from .icons import icon, logo
from .models import ConversationListModel, SearchResultsModel
from .notice import NoticeBar
from .progress_dialog import BuildProgressDialog
from .reading_bar import ReadingBar
from .search_view import LiveSearch, SearchPopup, SearchResults
from .server_section import ServerStatus
from .settings_dialog import DEFAULT_MODEL_NAME, SettingsDialog
from .stats_panel import StatsPanel
from .model_picker import ModelCatalog, ModelPicker, choices
from .system_prompt_bar import SystemPromptBar
from .worker_payloads import ModelInfo

UI_STATE_FILE = "ui.ini"


class MainWindow(QMainWindow):
    closed = Signal()  # everything is stopped and saved: the process may exit

    def __init__(self, data_dir: Path, model: str | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.data_dir = data_dir
        self.setWindowTitle("Eddy")
        self.setWindowIcon(logo())
        self.controller = c = ChatController(data_dir, model, self)
        self.progress_dialog: BuildProgressDialog | None = None
        self.editing = False
        self.editing_index = -1  # the user message being edited (a new branch from it once sent)
        self._closing = False
        self._closed = False
        self._selecting = False

        self._build_sidebar()
        self._build_center()
        self.stats = StatsPanel(c.turns)
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(self.center)
        self.splitter.addWidget(self.stats)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setStretchFactor(2, 0)
        self.splitter.setSizes([220, 640, 300])
        self.splitter.setChildrenCollapsible(False)
        self.setCentralWidget(self.splitter)
        self.status_label = QLabel("Starting…")
        self.status_label.setAccessibleName("Model status")
        self.statusBar().addWidget(self.status_label, 1)
        self.server_status = ServerStatus(c)  # "Serving on http://127.0.0.1:PORT/v1" while the local server is on
        self.statusBar().addPermanentWidget(self.server_status)
        self._build_actions()
        self._refresh_icons()

        c.busy_changed.connect(self._update_controls)
        for sig in (c.chat.reset, c.chat.appended, c.chat.truncated, c.chat.replaced):
            sig.connect(self._update_controls)
        c.model_state_changed.connect(self._on_model_state)
        c.model_info_changed.connect(self._on_model_info)
        c.load_progress.connect(self._on_progress)
        c.notice.connect(self.notice.show_notice)
        c.cache_changed.connect(self.stats.show_cache)
        c.turn_prefilled.connect(self.stats.show_prefill)
        c.rebuilt.connect(self.stats.show_rebuild)
        c.cache_changed.connect(self._show_status)
        c.live_rate.connect(self.stats.show_rate)
        c.restore_input.connect(self._restore_input)
        c.conversation_opened.connect(self._on_conversation_opened)
        c.current_changed.connect(self._select_current)
        c.conversations.dataChanged.connect(self._update_controls)  # a renamed chat: the window title
        c.closed.connect(self._finish_close)
        c.message_revealed.connect(self.chat_view.reveal)
        c.reading.connect(self.reading_bar.show_progress)
        c.turn_prefilled.connect(lambda _ev: self.reading_bar.finish())
        c.busy_changed.connect(lambda: c.busy or self.reading_bar.finish())
        self.reading_bar.cancel_requested.connect(c.stop)
        # The draft's size is counted by the engine a moment after typing stops, or documents change.
        self._count_timer = QTimer(self)
        self._count_timer.setSingleShot(True)
        self._count_timer.setInterval(300)
        self._count_timer.timeout.connect(self.count_draft)
        self.compose.textChanged.connect(self._count_timer.start)
        c.draft.documents_changed.connect(self._count_timer.start)
        c.model_state_changed.connect(lambda _state: self._count_timer.start())
        self.draft_bar.remove_requested.connect(c.detach)
        self.compose.files_dropped.connect(self.attach_paths)
        self.notice.action_requested.connect(self._on_notice_action)
        c.chat.window_changed.connect(self._show_context)
        self.stats.show_marker_requested.connect(self.chat_view.scroll_to_marker)
        self.chat_view.copy_requested.connect(copy_to_clipboard)
        self.chat_view.switch_requested.connect(c.switch_alternative)
        self.chat_view.edit_requested.connect(self.start_edit)
        self.chat_view.fork_requested.connect(c.fork_chat)
        self.chat_view.tool_action.connect(c.tool_action)
        self.chat_view.delete_requested.connect(self._confirm_delete_alternative)
        self.chat_view.regenerate_requested.connect(c.regenerate)
        c.busy_changed.connect(lambda: self.chat_view.set_locked(c.busy))
        self.compose.recall_requested.connect(self.start_edit)
        self.resize(1180, 760)
        self._restore_ui_state()
        c.start(self._last_chat())
        self._update_controls()

    # --- layout --------------------------------------------------------------------------------------------

    def _build_sidebar(self) -> None:
        self.sidebar = QWidget()
        self.sidebar.setAccessibleName("Chats")
        self.sidebar.setMinimumWidth(170)
        layout = QVBoxLayout(self.sidebar)
        layout.setContentsMargins(8, 8, 4, 8)
        self.new_button = QPushButton("New chat")
        self.new_button.setAccessibleName("New chat")
        self.new_button.setToolTip("Start a new chat (Ctrl+N)")
        self.new_button.clicked.connect(self.controller.new_chat)
        layout.addWidget(self.new_button)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter chats (Ctrl+K searches)")
        self.filter.setAccessibleName("Filter chats by title and search their messages")
        self.filter.setClearButtonEnabled(True)
        layout.addWidget(self.filter)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.controller.conversations)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.filter.textChanged.connect(self.proxy.setFilterFixedString)
        self.chat_list = QListView()
        self.chat_list.setModel(self.proxy)
        self.chat_list.setAccessibleName("Chat list")
        self.chat_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.chat_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.chat_list.setUniformItemSizes(True)
        self.chat_list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed |
                                       QAbstractItemView.EditTrigger.DoubleClicked)
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.chat_list.customContextMenuRequested.connect(self._chat_menu)
        self.chat_list.selectionModel().currentChanged.connect(self._on_list_current)
        layout.addWidget(self.chat_list, 1)
        # The filter also searches the messages: their hits show under the chats whose titles match.
        self.hits = SearchResultsModel(self)
        self.hits_label = QLabel("In messages")
        self.hits_list = SearchResults(self.hits)
        self.hits_list.setAccessibleName("Messages that match the filter")
        self.hits_list.hit_activated.connect(self.controller.open_hit)
        self.filter_search = LiveSearch(self.filter, self.controller.search, self.hits, messages_only=True)
        self.hits.modelReset.connect(self._show_hits)
        layout.addWidget(self.hits_label)
        layout.addWidget(self.hits_list, 1)
        self._show_hits()
        self.search_popup = SearchPopup(self.controller.search, self)
        self.search_popup.hit_chosen.connect(self.controller.open_hit)

    def _show_hits(self) -> None:
        searching = bool(self.filter.text().strip())
        self.hits_label.setVisible(searching)
        self.hits_list.setVisible(searching)
        self.hits_label.setText(f"In messages: {len(self.hits.hits)}" if self.hits.hits else "In messages: none")

    def open_search(self) -> None:
        self.search_popup.open_search()

    def _build_center(self) -> None:
        self.center = QWidget()
        layout = QVBoxLayout(self.center)
        layout.setContentsMargins(4, 8, 4, 8)
        layout.setSpacing(6)
        self.notice = NoticeBar()
        layout.addWidget(self.notice)
        # The model (app/model_picker.py) at the top, the chat's system prompt and its preset below it.
        self.model_picker = ModelPicker()
        self.model_picker.picked.connect(self.controller.switch_model)
        self.model_picker.opened.connect(self.refresh_models)
        self.catalog = ModelCatalog(self)
        self.catalog.ready.connect(self._show_models)
        self.refresh_models()  # in the background: the disk is scanned for a few seconds at most
        self.setAcceptDrops(True)  # a .gguf dropped on the window is opened
        self.system_bar = SystemPromptBar(self.controller.prompts)
        top = QHBoxLayout()
        top.addWidget(self.model_picker)
        top.addStretch(1)
        layout.addLayout(top)
        layout.addWidget(self.system_bar)
        self.chat_view = ChatView(self.controller.chat)
        layout.addWidget(self.chat_view, 1)
        self.reading_bar = ReadingBar()
        layout.addWidget(self.reading_bar)

        tools = QHBoxLayout()
        tools.setSpacing(2)
        self.regenerate_button = self._tool("regenerate", "Regenerate", "Write the last reply again (Ctrl+R)",
                                            self.regenerate)
        self.edit_button = self._tool("edit", "Edit last message", "Edit your last message and resend it (Ctrl+E)",
                                      lambda: self.start_edit())
        self.copy_chat_button = self._tool("copy", "Copy chat", "Copy the whole chat as Markdown (Ctrl+Alt+C)",
                                           self.copy_chat)
        self.attach_button = self._tool("attach", "Attach file",
                                        f"Attach a text file: plain text, Markdown, code, CSV, JSON, up to "
                                        f"{size_text(MAX_DOCUMENT_BYTES)} (or drop it on the message box)",
                                        self.attach_files)
        for b in (self.regenerate_button, self.edit_button, self.copy_chat_button, self.attach_button):
            tools.addWidget(b)
        tools.addStretch(1)
        self.edit_label = QLabel("Editing your last message: Enter resends it, Esc cancels")
        self.edit_label.setAccessibleName("Edit mode")
        self.edit_label.hide()
        tools.addWidget(self.edit_label)
        layout.addLayout(tools)

        self.draft_bar = DraftBar(self.controller.draft)
        layout.addWidget(self.draft_bar)
        row = QHBoxLayout()
        self.compose = ComposeBox()
        self.compose.submitted.connect(self.submit)
        row.addWidget(self.compose, 1)
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send message")
        self.send_button.setToolTip("Send (Enter)")
        self.send_button.clicked.connect(lambda: self.submit(self.compose.toPlainText()))
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop reply")
        self.stop_button.setToolTip("Stop the reply (Esc)")
        self.stop_button.clicked.connect(self.controller.stop)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.stop_button, 0, Qt.AlignmentFlag.AlignBottom)
        layout.addLayout(row)

    def _tool(self, name: str, text: str, tip: str, slot) -> QToolButton:
        b = QToolButton()
        b.setObjectName(name)
        b.setText(text)
        b.setToolTip(tip)
        b.setAccessibleName(text)
        b.setAutoRaise(True)
        b.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        b.clicked.connect(slot)
        return b

    def _build_actions(self) -> None:
        c = self.controller
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.new_action = self._action(file_menu, "&New chat", QKeySequence.StandardKey.New, c.new_chat)
        self._action(file_menu, "&Open model…", QKeySequence.StandardKey.Open, self.open_model)
        file_menu.addSeparator()
        self._action(file_menu, "Export as &Markdown…", None, lambda: self.export_chat("markdown"))
        self._action(file_menu, "Export as &JSON…", None, lambda: self.export_chat("json"))
        file_menu.addSeparator()
        self._action(file_menu, "&Settings…", QKeySequence("Ctrl+,"), self.open_settings)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", QKeySequence.StandardKey.Quit, self.close)
        chat_menu = bar.addMenu("&Chat")
        self.regenerate_action = self._action(chat_menu, "&Regenerate last reply", QKeySequence("Ctrl+R"), self.regenerate)
        self.edit_action = self._action(chat_menu, "&Edit last message", QKeySequence("Ctrl+E"), lambda: self.start_edit())
        # Esc itself is a window-wide shortcut (below); "\t" only shows it in the menu.
        self.stop_action = self._action(chat_menu, "&Stop reply\tEsc", None, c.stop)
        chat_menu.addSeparator()
        self.copy_reply_action = self._action(chat_menu, "Copy last re&ply", QKeySequence("Ctrl+Shift+C"),
                                              self.copy_last_reply)
        self._action(chat_menu, "&Copy chat", QKeySequence("Ctrl+Alt+C"), self.copy_chat)
        self._action(chat_menu, "Re&name chat…", QKeySequence("F2"), self.rename_current)
        self._action(chat_menu, "&Delete chat…", None, self.delete_current)
        view_menu = bar.addMenu("&View")
        self.stats_action = self._action(view_menu, "&Statistics panel", QKeySequence("F9"),
                                         lambda on: self.stats.setVisible(on))
        self.stats_action.setCheckable(True)
        self.stats_action.setChecked(True)
        self.sidebar_action = self._action(view_menu, "C&hat list", QKeySequence("Ctrl+B"),
                                           lambda on: self.sidebar.setVisible(on))
        self.sidebar_action.setCheckable(True)
        self.sidebar_action.setChecked(True)
        self._action(view_menu, "&Find chat", QKeySequence.StandardKey.Find, self.filter.setFocus)
        self.search_action = self._action(view_menu, "Search &all chats…", QKeySequence("Ctrl+K"), self.open_search)
        # Esc stops a reply anywhere in the window, or leaves edit mode.
        esc = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        esc.setContext(Qt.ShortcutContext.WindowShortcut)
        esc.activated.connect(self.escape)

    # --- models --------------------------------------------------------------------------------------------

    def open_model(self) -> None:
        """File › Open model…: a GGUF file (a Hugging Face folder or a server's URL go in Settings' Model field)."""
        path, _ = QFileDialog.getOpenFileName(self, "Open a model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.controller.switch_model(path)

    def refresh_models(self) -> None:
        """Looks for models again (in the background); the picker shows them when found."""
        c = self.controller
        self.catalog.folders = [Path(f).expanduser() for f in c.settings.model_folders.split("|") if f.strip()]
        self.catalog.refresh([c.model_spec, *c.settings.recent_models.split("|")], c.settings.build_settings())

    def _show_models(self, entries: list, found: list, built: set, times: object, shaped: set) -> None:
        c = self.controller
        recent = [m for m in c.settings.recent_models.split("|") if m]
        self.model_picker.set_choices(choices(recent, entries, found, c.model_spec, built, times, shaped),
                                      c.model_spec)

    def dragEnterEvent(self, event) -> None:  # noqa: N802 (Qt API)
        if _dropped_gguf(event.mimeData()) is not None:
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 (Qt API)
        path = _dropped_gguf(event.mimeData())
        if path is not None:
            event.acceptProposedAction()
            self.controller.switch_model(path)

    def _action(self, menu: QMenu, text: str, shortcut, slot) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(shortcut)
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _refresh_icons(self) -> None:
        self.new_button.setIcon(icon("new"))
        self.regenerate_button.setIcon(icon("regenerate", size=16))
        self.edit_button.setIcon(icon("edit", size=16))
        self.copy_chat_button.setIcon(icon("copy", size=16))
        self.attach_button.setIcon(icon("attach", size=16))
        self.send_button.setIcon(icon("send"))
        self.stop_button.setIcon(icon("stop"))

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self._refresh_icons()  # icons are drawn in the palette's text colour

    # --- user actions --------------------------------------------------------------------------------------

    def submit(self, text: str) -> None:
        if not text.strip() and (self.editing or not self.controller.draft.documents):
            return
        ok = self.controller.edit_message(self.editing_index, text) if self.editing else self.controller.send(text)
        if ok:
            self.compose.clear()
            self._set_editing(False)

    def regenerate(self) -> None:
        self.controller.regenerate()

    def attach_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach text files", str(Path.home()),
                                                "Text files (*.txt *.md *.csv *.json *.py *.c *.h *.js *.ts *.rs "
                                                "*.go *.java *.sh *.toml *.yaml *.yml *.xml *.html *.log);;All files (*)")
        self.attach_paths([Path(p) for p in paths])

    def attach_paths(self, paths: list[Path]) -> None:
        for path in paths:
            if self.controller.attach(path):
                self.statusBar().showMessage(f"Attached {path.name}", 3000)
        self.compose.setFocus()

    def count_draft(self) -> None:
        self.controller.count_draft(self.compose.toPlainText())

    def start_edit(self, index: int | None = None) -> None:
        """Puts a user message (the last one unless `index` says which) into the input box to be edited; sent,
        it starts a new branch from there."""
        c = self.controller
        if index is None:
            index = c.last_user_index()
        msgs = c.chat.messages
        if index is None or c.busy or not 0 <= index < len(msgs) or msgs[index].role != "user":
            return
        self.editing_index = index
        self._set_editing(True)
        self.compose.setPlainText(msgs[index].content)
        self.compose.setFocus()
        cursor = self.compose.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        self.compose.setTextCursor(cursor)

    def _set_editing(self, on: bool) -> None:
        self.editing = on
        if on:
            last = self.editing_index == self.controller.last_user_index()
            self.edit_label.setText(f"Editing your {'last ' if last else ''}message: Enter sends it as a new "
                                    "branch (the old one stays), Esc cancels")
        self.edit_label.setVisible(on)
        self.send_button.setText("Resend" if on else "Send")
        self.send_button.setAccessibleName("Resend edited message" if on else "Send message")

    def escape(self) -> None:
        if self.controller.busy:
            self.controller.stop()
        elif self.editing:
            self._set_editing(False)
            self.compose.clear()

    def copy_chat(self) -> None:
        copy_to_clipboard(self.controller.chat_markdown())
        self.statusBar().showMessage("Chat copied as Markdown", 3000)

    def copy_last_reply(self) -> None:
        """The last reply written (not one still being written) onto the clipboard, as its Markdown."""
        reply = next((m for m in reversed(self.controller.chat.messages)
                      if m.role == "assistant" and not m.streaming and m.content), None)
        if reply is not None:
            copy_to_clipboard(reply.content)
            self.statusBar().showMessage("Last reply copied", 3000)

    def export_chat(self, fmt: str) -> None:
        suffix, filt = (".json", "JSON (*.json)") if fmt == "json" else (".md", "Markdown (*.md)")
        name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in self.controller.chat.title).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(Path.home() / f"{name}{suffix}"), filt)
        if not path:
            return
        try:
            self.controller.export_chat(Path(path), fmt)
        except OSError as e:
            self.notice.show_notice("error", f"Could not export the chat: {e.strerror or e}")
            return
        self.statusBar().showMessage(f"Exported to {path}", 5000)

    def open_settings(self) -> None:
        dialog = SettingsDialog(self.controller.settings, self, self.controller.model_override,
                                self.controller.chat_defaults, self.controller.mcp_servers())
        if dialog.exec() == SettingsDialog.DialogCode.Accepted:
            new = dialog.value()
            self.controller.set_mcp_servers(dialog.tools.text)
            if self.controller.settings.needs_rebuild(new):
                self.notice.show_notice("info", "The model is being rebuilt for the new settings.")
            self.controller.apply_settings(new)

    def _selected_conversation(self, index: QModelIndex | None = None) -> int | None:
        index = index if index is not None else self.chat_list.currentIndex()
        if not index.isValid():
            return None
        return self.proxy.data(index, ConversationListModel.IdRole)

    def _chat_menu(self, pos) -> None:
        index = self.chat_list.indexAt(pos)
        conv_id = self._selected_conversation(index)
        if conv_id is None:
            return
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.chat_list.edit(index))
        menu.addAction("Delete…", lambda: self._confirm_delete(conv_id))
        menu.exec(self.chat_list.viewport().mapToGlobal(pos))

    def rename_current(self) -> None:
        conv_id = self.controller.chat.conversation_id
        if conv_id is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=self.controller.chat.title)
        if ok and title.strip():
            self.controller.rename_chat(conv_id, title)

    def delete_current(self) -> None:
        if self.controller.chat.conversation_id is not None:
            self._confirm_delete(self.controller.chat.conversation_id)

    def _confirm_delete_alternative(self, index: int) -> None:
        position, count = self.controller.chat.alternatives(index)
        what = "reply" if self.controller.chat.messages[index].role == "assistant" else "message"
        answer = QMessageBox.question(self, "Delete alternative",
                                      f"Delete this {what} (alternative {position} of {count}) and everything that "
                                      "followed it in its branch? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            self.controller.delete_alternative(index)

    def _confirm_delete(self, conv_id: int) -> None:
        row = self.controller.conversations.row_of(conv_id)
        title = self.controller.conversations.rows[row].title if row >= 0 else "this chat"
        answer = QMessageBox.question(self, "Delete chat", f"Delete “{title}”? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            self.controller.delete_chat(conv_id)

    def _restore_input(self, text: str) -> None:
        if not self.compose.toPlainText().strip():
            self.compose.setPlainText(text)

    def _on_notice_action(self, action: str) -> None:
        if action == "retry_load":
            self.notice.hide()
            self.controller.load_model()
        elif action == "settings":
            self.open_settings()
        elif action == "retry_save":
            self.notice.hide()
            self.controller.retry_saves()  # says how it went in a new notice

    # --- controller signals --------------------------------------------------------------------------------

    def _on_list_current(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if self._selecting:
            return
        conv_id = self._selected_conversation(current)
        if conv_id is not None and conv_id != self.controller.chat.conversation_id:
            self.controller.open_chat(conv_id)

    def _on_conversation_opened(self) -> None:
        self._set_editing(False)
        self.stats.clear_turn()
        self._select_current()

    def _select_current(self) -> None:
        """Highlights the open chat in the list (without reopening it)."""
        conv_id = self.controller.chat.conversation_id
        self._selecting = True
        try:
            row = self.controller.conversations.row_of(conv_id) if conv_id is not None else -1
            if row >= 0:
                index = self.proxy.mapFromSource(self.controller.conversations.index(row))
                self.chat_list.selectionModel().setCurrentIndex(index, QItemSelectionModel.SelectionFlag.ClearAndSelect)
            else:
                self.chat_list.selectionModel().clearSelection()
                self.chat_list.setCurrentIndex(QModelIndex())
        finally:
            self._selecting = False
        self._update_controls()

    def _show_context(self) -> None:
        chat = self.controller.chat
        partly = chat.context is not None and chat.context.cut >= 0
        self.stats.show_context(chat.forgotten(), len(chat.messages), partly)

    def _on_progress(self, stage: str, fraction: float) -> None:
        if self.progress_dialog is None and self.controller.model_state == "loading" and not self._closing:
            self.progress_dialog = BuildProgressDialog(self.controller.model_spec or DEFAULT_MODEL_NAME, self)
            self.progress_dialog.cancel_requested.connect(self.controller.cancel_load)
            self.controller.host.worker.progress_detail.connect(self.progress_dialog.set_detail)
            self.progress_dialog.show()
        if self.progress_dialog is not None:
            self.progress_dialog.set_progress(stage, fraction)
        self.status_label.setText(f"Building the model: {stage} {fraction * 100:.0f}%")

    def _on_model_state(self, state: str) -> None:
        if state != "loading" and self.progress_dialog is not None:
            self.progress_dialog.finish()
            self.progress_dialog.deleteLater()
            self.progress_dialog = None
        if state == "loading":
            self.status_label.setText("Loading the model…")
        elif state == "failed":
            self.status_label.setText("No model loaded")
        self._update_controls()

    def _on_model_info(self, info: ModelInfo) -> None:
        self._show_status()
        self.stats.show_remote(info)
        self.refresh_models()  # a build just made is "built" now

    def _show_status(self, *_: object) -> None:
        """The model and its cache: the sinks in force in this chat (more when a system prompt is pinned)."""
        info, cache = self.controller.model_info, self.controller.cache
        if self.controller.model_state != "ready" or info is None:
            return
        if info.build is None:  # a model on a server
            self.status_label.setText(f"{info.model} · {info.device} · context {info.window:,} tokens · "
                                      f"connected in {info.seconds:.1f} s")
            return
        sinks = cache.sinks or info.build.sinks
        pinned = f" ({cache.pinned} pinned)" if cache.pinned else ""
        self.status_label.setText(f"{info.model} · {info.build.dtype} · {info.device} · cache {sinks} sinks{pinned} + "
                                  f"{info.window} window · loaded in {info.seconds:.1f} s")

    def _update_controls(self, *_: object) -> None:
        c = self.controller
        busy, ready = c.busy, c.model_state == "ready"
        msgs = c.chat.messages
        self.send_button.setVisible(not busy)
        self.stop_button.setVisible(busy)
        self.send_button.setEnabled(ready)
        can_regen = ready and not busy and len(msgs) >= 2 and msgs[-1].role == "assistant"
        self.regenerate_button.setEnabled(can_regen)
        self.regenerate_action.setEnabled(can_regen)
        can_edit = ready and not busy and any(m.role == "user" for m in msgs)
        self.edit_button.setEnabled(can_edit)
        self.edit_action.setEnabled(can_edit)
        self.stop_action.setEnabled(busy)
        self.copy_chat_button.setEnabled(bool(msgs))
        self.setWindowTitle(f"{c.chat.title} — Eddy")
        if not ready:
            placeholder = ("The model is loading…" if c.model_state == "loading"
                           else "No model loaded: see the message above")
        else:
            placeholder = "Message Eddy… (Enter to send, Shift+Enter for a new line)"
        if placeholder != self.compose.placeholderText():
            self.compose.setPlaceholderText(placeholder)
            # QPlainTextEdit repaints only when the placeholder appears or goes, not when its text changes.
            self.compose.viewport().update()

    # --- closing -------------------------------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802
        if self._closed:
            event.accept()
            return
        # Never block here: ask the engine to stop, hide, and close for real once it has (see _finish_close).
        event.ignore()
        if self._closing:
            return
        self._closing = True
        self._save_ui_state()
        if self.progress_dialog is not None:
            self.progress_dialog.hide()
        self.hide()
        self.controller.shutdown()

    def _finish_close(self) -> None:
        self._closed = True
        self.close()
        self.closed.emit()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _ui_settings(self) -> QSettings:
        return QSettings(str(self.data_dir / UI_STATE_FILE), QSettings.Format.IniFormat)

    def _save_ui_state(self) -> None:
        s = self._ui_settings()
        s.setValue("geometry", self.saveGeometry())
        s.setValue("splitter", self.splitter.saveState())
        s.setValue("stats_visible", not self.stats.isHidden())
        conv_id = self.controller.chat.conversation_id
        if conv_id is not None and conv_id >= 0:  # a negative id is not on disk yet: it will not be there
            s.setValue("last_chat", conv_id)
        else:
            s.remove("last_chat")

    def _last_chat(self) -> int | None:
        """The chat open when the app last closed (None: the most recent one is opened)."""
        try:
            return int(self._ui_settings().value("last_chat"))
        except (TypeError, ValueError):
            return None

    def _restore_ui_state(self) -> None:
        s = self._ui_settings()
        geometry, splitter = s.value("geometry"), s.value("splitter")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        if isinstance(splitter, QByteArray):
            self.splitter.restoreState(splitter)
        if str(s.value("stats_visible", "true")).lower() == "false":
            self.stats.hide()
            self.stats_action.setChecked(False)


def _dropped_gguf(mime) -> str | None:
    """The .gguf file a drag brings, if it brings exactly one."""
    urls = [u for u in mime.urls() if u.isLocalFile()] if mime.hasUrls() else []
    if len(urls) == 1 and urls[0].toLocalFile().lower().endswith(".gguf"):
        return urls[0].toLocalFile()
    return None
