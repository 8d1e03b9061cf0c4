"""The app's logic: chats, the store and the engine worker glued together. No widgets here.

Every user action arrives as a method call; everything the views show lives in the models (ChatModel,
ConversationListModel, TurnStatsModel) or comes out as a signal. What the cache holds is the engine's to
say (its typed events); saving that fails is retried by the SaveQueue (app/saving.py).

ChatController holds the state and its signals, the model's loading, the settings, opening and searching chats,
the draft, export and closing. Its other jobs are mixed in, one module each: the turns and the engine's events
(controller_turns.py), alternatives and branches (controller_branches.py), tool calls (controller_tools.py),
the Local server (controller_server.py) and saving (controller_saving.py).
"""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from PySide6.QtCore import QObject, Signal

from engine.events import CacheStats
from engine.run.generation import ChatDefaults

from .branches import ChatTree
from .controller_branches import BranchHandling
from .controller_saving import NEW_CHAT_TITLE, ChatSaving
from .controller_server import LocalServerHandling
from .controller_tools import ToolCallHandling
from .controller_turns import InFlight, TurnHandling
from .documents import DocumentError, as_message, read_document
from .local_server import LocalServer
from .models import ChatModel, ConversationListModel, DraftModel, Message, TurnStatsModel
from .saving import SaveQueue
from .settings import AppSettings, load_settings, save_settings
from .system_prompts import SystemPrompts
from .tool_cards import ToolCards
from .store import MessageRow, SearchHit, Store, StoreError, TurnRow
from .transcript import to_json, to_markdown
from .worker import EngineHost
from .worker_payloads import ChatConfig, ModelInfo


# The mixins come before QObject: their methods are found first, and QObject's __init__ is the one super() reaches.
class ChatController(TurnHandling, BranchHandling, ToolCallHandling, LocalServerHandling, ChatSaving, QObject):
    busy_changed = Signal()  # read .busy (no bool argument: PySide6 6.12.0 loses a reference to True per emit)
    model_state_changed = Signal(str)  # "none" | "loading" | "ready" | "failed"
    model_info_changed = Signal(object)  # ModelInfo (app/worker_payloads.py): a model has loaded
    load_progress = Signal(str, float)
    notice = Signal(str, str, str)     # level ("info" | "warning" | "error"), text, action ("" | "retry_load" | "settings" | "retry_save")
    cache_changed = Signal(object)     # CacheStats
    turn_prefilled = Signal(object)    # the Prefill of a turn's message
    reading = Signal(int, int)         # a message longer than the window streams in: tokens done, total
    rebuilt = Signal(object)           # the Prefill of a chat put back into the cache
    live_rate = Signal(float, int)     # decode tokens/s so far, tokens so far
    turn_finished = Signal(object)     # the turn's TurnRow, as stored
    restore_input = Signal(str)        # a message that was not sent goes back into the input box
    conversation_opened = Signal()
    message_revealed = Signal(int)     # scroll the open chat to this message and highlight it (a search hit)
    current_changed = Signal()         # the open chat got an id (first message saved) or lost it
    closed = Signal()                  # shutdown() finished: the engine thread has ended, the store is closed
    server_changed = Signal()          # the local server started, stopped, or began or ended a request
    server_turn = Signal(object)       # a local-server request's TurnRow (kind "server"; never stored)
    tools_changed = Signal()           # the MCP servers' status or tools changed

    def __init__(self, data_dir: Path, model_override: str | None = None, parent: QObject | None = None,
                 host: EngineHost | None = None) -> None:
        super().__init__(parent)
        self.data_dir = data_dir
        self.store = Store.open(data_dir)
        self.settings = load_settings(data_dir)
        self.model_override = model_override
        self.chat = ChatModel(self)
        self.conversations = ConversationListModel(self)
        self.turns = TurnStatsModel(self)
        self.draft = DraftModel(self)
        self._count_seq = 0
        self.model_state = "none"
        self.model_info: ModelInfo | None = None  # the model loaded last (None: none yet)
        self.cache = CacheStats(0, 0, 0, 0, 0, 0)
        self._turn: InFlight | None = None
        self._after_idle: list[Callable[[], None]] = []
        self._closing = False
        self._next_temp_id = -1
        self.saves = SaveQueue(self.store, lambda: (self.chat.conversation_id, self.chat.title, self.chat.tree), self)
        self.saves.failed.connect(lambda text: self.notice.emit("error", text, "retry_save"))
        self.saves.all_saved.connect(lambda: self.notice.emit("info", "All chats are saved again.", ""))
        self.saves.moved.connect(self._on_saved_under)

        self.conversations.rename_requested.connect(self.rename_chat)
        # The open chat's own system prompt (or Settings'), and the presets (app/system_prompts.py). Connected
        # before anything else: the engine must be given a chat's prompt before its cache is rebuilt.
        self.prompts = SystemPrompts(self.store, lambda: self.settings.system_prompt, self)
        self.conversation_opened.connect(lambda: self.prompts.open(self.chat.conversation_id))
        self.current_changed.connect(lambda: self.prompts.saved_as(self.chat.conversation_id))
        self.prompts.chat_prompt_changed.connect(self._on_chat_prompt)
        self.prompts.failed.connect(lambda text: self.notice.emit("warning", text, ""))
        self.host = host or EngineHost(self)  # a test may hand it one without a model
        w = self.host.worker
        w.progress.connect(self.load_progress)
        w.loaded.connect(self._on_loaded)
        w.prefill.connect(self._on_prefill)
        w.prefill_progress.connect(self._on_prefill_progress)
        w.counted.connect(self._on_counted)
        w.token.connect(self._on_token)
        w.reasoning.connect(self._on_reasoning)
        w.decode_progress.connect(self._on_decode_progress)
        w.done.connect(self._on_done)
        w.context.connect(self._on_context)
        w.error.connect(self._on_error)
        self.host.stopped.connect(self._on_engine_stopped)
        self._engine_stopped = False
        # The local server runs its requests on this same engine worker (app/local_server.py).
        self.local_server = LocalServer(self.host.serve, self)
        self.server_busy = False  # a server request is on the engine now
        self.local_server.request_started.connect(self._on_server_request)
        self.local_server.request_done.connect(self._on_served)
        self.local_server.stopped.connect(self._on_server_stopped)
        # Tools from MCP servers (app/tool_cards.py): offered to the model, each call a card in the chat.
        self.tools = ToolCards(self.chat, self._save_message, self._save_card, self)
        self.tool_choice = "auto"  # "required": a user's message is answered with calls (a grammar holds it)
        self.tools_problem = ""    # what is wrong with mcp.json, if anything
        self.tools.results_ready.connect(self._send_tool_results)
        self.tools.notice.connect(lambda kind, text: self.notice.emit(kind, text, ""))
        self.tools.changed.connect(self._on_tools_changed)
        self.tools.allowed = {t for t in self.settings.tools.allowed_tools.split(",") if t}
        self.tools.allowed_changed.connect(self._keep_allowed_tools)
        w.tool_calls.connect(self._on_tool_calls)
        self._last_reply = -1  # the index of the reply that ended last (its calls come after its done)

    # --- start-up ------------------------------------------------------------------------------------------

    def start(self, last_chat: int | None = None) -> None:
        """Shows the chat open when the app last closed (`last_chat`, if it still exists), else the most recent
        one, and starts loading the model (call once the views are connected)."""
        if self.store.salvage is not None:
            self.notice.emit(self.store.salvage.level, self.store.salvage.notice(), "")
        rows = self._read(self.store.conversations, [])
        self.conversations.set_rows(rows)
        if rows:
            self.open_chat(last_chat if any(r.id == last_chat for r in rows) else rows[0].id)
        else:
            self._show_new_chat()
        self.start_tools()
        self.load_model()

    # --- models --------------------------------------------------------------------------------------------

    def switch_model(self, spec: str) -> None:
        """Talks to another model from now on (a file, a folder, a built-in name or a server's URL): the chat
        stays and is put into the new model's cache; a model not built yet shows the build dialog."""
        spec, current = spec.strip(), self.model_spec
        if spec == current and self.model_state == "ready":
            return
        recent = [m for m in self.settings.recent_models.split("|") if m and m != spec]
        if current and current != spec:
            recent = [current, *[m for m in recent if m != current]]
        new = replace(self.settings, model=spec, recent_models="|".join(([spec] if spec else []) + recent)[:4000])
        self.model_override = None
        self.apply_settings(new)

    @property
    def model_spec(self) -> str:
        return self.model_override if self.model_override is not None else self.settings.model

    @property
    def busy(self) -> bool:
        return self._turn is not None

    @property
    def can_send(self) -> bool:
        return self.model_state == "ready" and not self.busy and not self._closing and not self.tools.busy

    # --- the model -----------------------------------------------------------------------------------------

    def load_model(self) -> None:
        if self._closing:
            return
        if self.busy:
            self._when_idle(self.load_model)
            return
        if self.model_state == "loading":
            self.host.cancel_load()  # a load for older settings would only be thrown away
        self._set_model_state("loading")
        s = self.settings
        self.host.load(self.model_spec, s.build_settings(), self._chat_config())

    def cancel_load(self) -> None:
        self.host.cancel_load()

    def _chat_config(self) -> ChatConfig:
        # The open chat's own system prompt, else Settings': what the engine is given for this chat; and the
        # tools of the MCP servers running now.
        return replace(self.settings.chat_config(), system_prompt=self.prompts.effective.strip() or None,
                       tools=tuple(self.tools.tools()), tool_choice=self.tool_choice)

    def _on_chat_prompt(self) -> None:
        # The chat's beginning changed: rebuild its cache with the new prompt, after the reply in progress ends.
        self._when_idle(self._sync_engine, stop=False)

    @property
    def chat_defaults(self) -> ChatDefaults:
        """The loaded model's sampling defaults (Eddy's own until a model has loaded)."""
        return self.model_info.chat_defaults if self.model_info is not None else ChatDefaults()

    def _set_model_state(self, state: str) -> None:
        self.model_state = state
        self.model_state_changed.emit(state)
        self._sync_server()  # it serves the loaded model only: off while another loads, back once ready

    def _on_loaded(self, info: ModelInfo) -> None:
        self.model_info = info
        self.model_state = "ready"
        # Queue the open chat's rebuild before anyone can react to "ready" with a send.
        self._sync_engine()
        self._set_model_state("ready")
        self.model_info_changed.emit(info)
        self._on_cache(info.cache)
        self.draft.set_window(info.window)
        if info.built:
            self.notice.emit("info", f"{info.model} is compiled and ready ({info.seconds:.0f} s). "
                             "Later starts reuse it.", "")

    def _sync_engine(self) -> None:
        """Puts the open chat into the model's cache (a rebuild; its prefill shows up as a ↻ turn)."""
        if self.model_state == "ready" and not self._closing and not self.busy:
            self.host.configure(self._chat_config())  # this chat's system prompt; queued before the switch
            self.host.switch_chat(self.chat.history())

    # --- settings ------------------------------------------------------------------------------------------

    def apply_settings(self, new: AppSettings) -> None:
        new.validate()
        old, self.settings = self.settings, new
        try:
            save_settings(self.data_dir, new)
        except Exception as e:  # QSettings reports no errors; be safe anyway
            self.notice.emit("warning", f"Could not save the settings: {e}", "")
        if old.needs_rebuild(new) or self.model_state in ("failed", "none"):
            if old.model != new.model:
                self.model_override = None  # an explicit choice replaces the --model of this run
            self.load_model()
            return
        self.tools.allowed = {t for t in new.tools.allowed_tools.split(",") if t}
        self.host.configure(self._chat_config())
        self._sync_server()
        if old.system_prompt != new.system_prompt:
            self.prompts.default_changed(old.system_prompt)  # a chat on the default rebuilds (_on_chat_prompt)

    # --- chats ---------------------------------------------------------------------------------------------

    def _show_new_chat(self) -> None:
        self.chat.load(None, NEW_CHAT_TITLE, [])
        self.turns.set_rows([])
        self.conversation_opened.emit()
        self._sync_engine()

    def new_chat(self) -> None:
        if self.busy:
            self._when_idle(self.new_chat)
            return
        if self.chat.conversation_id is None and not self.chat.messages:
            return  # already on an empty new chat
        self._leave_current()
        self._show_new_chat()

    def open_chat(self, conv_id: int) -> None:
        if conv_id == self.chat.conversation_id and self.chat.messages:
            return
        if self.busy:
            self._when_idle(lambda: self.open_chat(conv_id))
            return
        self._leave_current()
        snapshot = self.saves.reopen(conv_id)
        if snapshot is not None:
            title, tree = snapshot
            turns: list[TurnRow] = []
        else:
            row = self._read(lambda: self.store.conversation(conv_id), None)
            if row is None:
                self.notice.emit("error", "That chat could not be read.", "")
                return
            title = row.title
            turns = self._read(lambda: self.store.turns(conv_id), [])
            tree = _tree_of(self._read(lambda: self.store.tree(conv_id), []), turns)
        self.chat.load(conv_id, title, tree)
        self.turns.set_rows(turns)
        self.conversation_opened.emit()
        self._sync_engine()

    # --- search --------------------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Titles and messages of every saved chat that contain the words of `text` (any text is safe)."""
        return self._read(lambda: self.store.search(text, limit), [])

    def open_hit(self, hit: SearchHit) -> None:
        """Opens the hit's chat and reveals its message (a reply in another chat is stopped first)."""
        if hit.conversation_id != self.chat.conversation_id:
            if self.busy:
                self._when_idle(lambda: self.open_hit(hit))
                return
            self.open_chat(hit.conversation_id)
            if self.chat.conversation_id != hit.conversation_id:
                return  # it could not be read (the notice says so)
        if hit.message_id is None:
            return  # the title matched: the chat is open, at its end
        # By id: the chat in memory may have changed since the search ran, and the message may be in a branch
        # not shown, which is then shown (a reply in progress is stopped first).
        node = next((n for n in self.chat.tree.nodes() if n.item.id == hit.message_id), None)
        if node is None:
            return
        if node not in self.chat.nodes:
            if self.busy:
                self._when_idle(lambda: self.open_hit(hit))
                return
            for chosen in self.chat.show(node):
                self._save_choice(chosen)
            self._sync_engine()
        self.message_revealed.emit(self.chat.nodes.index(node))

    def _leave_current(self) -> None:
        self.saves.leave(self.chat.conversation_id, self.chat.title, self.chat.tree)

    def rename_chat(self, conv_id: int, title: str) -> None:
        title = title.strip()
        if not title:
            return
        if conv_id == self.chat.conversation_id:
            self.chat.title = title
        i = self.conversations.row_of(conv_id)
        if i >= 0:
            self.conversations.upsert(replace(self.conversations.rows[i], title=title), to_top=False)
        self._write(conv_id, lambda: self.store.rename_conversation(conv_id, title))

    def delete_chat(self, conv_id: int) -> None:
        if conv_id == self.chat.conversation_id and self.busy:
            self._when_idle(lambda: self.delete_chat(conv_id))
            return
        try:
            if conv_id >= 0:
                self.store.delete_conversation(conv_id)
        except StoreError as e:
            self.notice.emit("error", str(e), "")
            return
        self.saves.forget(conv_id)
        self.conversations.remove(conv_id)
        if conv_id == self.chat.conversation_id:
            if self.conversations.rows:
                self.open_chat(self.conversations.rows[0].id)
            else:
                self._show_new_chat()

    # --- the draft -----------------------------------------------------------------------------------------

    def attach(self, path: Path) -> bool:
        """Adds a text file to the draft; a file that is not text, or too large, is refused with a notice."""
        try:
            document = read_document(Path(path))
        except DocumentError as e:
            self.notice.emit("error", str(e), "")
            return False
        self.draft.add(document)
        return True

    def detach(self, index: int) -> None:
        self.draft.remove(index)

    def count_draft(self, text: str) -> None:
        """Asks the engine how many tokens the message would be (the draft shows it when the answer comes)."""
        documents = self.draft.documents
        message = as_message(documents, text.strip()) if documents else text.strip()
        if not message or self.model_state != "ready":
            self._count_seq = -1  # an answer still on its way is for an older draft
            self.draft.set_tokens(None if message else 0)
            return
        self._count_seq = self.host.count(message)

    def _on_counted(self, seq: int, tokens: int) -> None:
        if seq == self._count_seq:
            self.draft.set_tokens(tokens)

    # --- export --------------------------------------------------------------------------------------------

    def _pairs(self) -> list[tuple[str, str]]:
        """The branch shown, after the system prompt the model is given for it (when there is one)."""
        system = self.prompts.effective.strip()
        return [("system", system, {})] * bool(system) + [(m.role, m.content, m.extra) for m in self.chat.messages
                                                          if not m.streaming]

    def chat_markdown(self) -> str:
        return to_markdown(self.chat.title, self._pairs())

    def _tree_rows(self) -> list[dict]:
        nodes = [n for n in self.chat.tree.nodes() if not n.item.streaming]
        where = {node: i for i, node in enumerate(nodes)}
        shown = set(self.chat.nodes)
        return [{"id": where[n], "parent": where[n.parent] if n.parent is not None else None, "role": n.item.role,
                 "content": n.item.content, **n.item.extra, "shown": n in shown} for n in nodes]

    def export_chat(self, path: Path, fmt: str) -> None:
        """Writes the open chat as "markdown" (the branch shown) or "json" (that branch, and every branch as a
        tree); raises OSError with the reason if it cannot."""
        if fmt == "json":
            conv_id = self.chat.conversation_id
            turns = self._read(lambda: self.store.turns(conv_id), []) if conv_id is not None and conv_id >= 0 else []
            model = self.model_info.model if self.model_info is not None else None
            text = to_json(self.chat.title, self._pairs(), turns, model, self._tree_rows())
        else:
            text = self.chat_markdown()
        Path(path).write_text(text, encoding="utf-8")

    # --- closing -------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops any reply or build, lets the engine thread end, saves, then emits closed. Never blocks."""
        if self._closing:
            return
        self._closing = True
        self._after_idle.clear()
        # Off the GUI thread (a hung server takes seconds to end); not a daemon, so the process waits for it
        # and no server outlives the app.
        threading.Thread(target=self.tools.close, name="mcp-close").start()
        self.local_server.stop()  # first: a server request in progress ends within a token, freeing the engine
        self.host.shutdown()

    def _on_engine_stopped(self) -> None:
        # Every event the worker sent before it ended has been handled by now (queued in order), so the
        # stopped reply is already in the chat: write whatever is still unsaved, then close the store.
        self.saves.close()
        self.store.close()
        self._engine_stopped = True
        self._close_when_done()

    def _close_when_done(self) -> None:
        """closed follows once both the engine thread and the local server's thread (its port freed) ended."""
        if self._closing and self._engine_stopped and not self.local_server.running:
            self.closed.emit()

def _tree_of(rows: list[MessageRow], turns: Sequence[TurnRow] = ()) -> ChatTree[Message]:
    # A stored reply gets back the stats its turn saved (the same meta _on_done gives a reply just written).
    stats = {t.message_id: t for t in turns if t.kind == "turn" and t.message_id is not None}

    def message(r: MessageRow) -> Message:
        t = stats.get(r.id)
        meta = {"tokens": t.tokens, "tok_s": t.tok_s, "stop_reason": t.stop_reason, "prefill_tokens": t.prefill_tokens,
                "prefill_ms": t.prefill_ms} if t is not None and r.role == "assistant" else {}
        return Message(r.role, r.content, id=r.id, meta=meta, created=r.created, extra=r.extra)

    return ChatTree.of(rows, lambda r: r.id, lambda r: r.parent_id, lambda r: r.chosen, message)
