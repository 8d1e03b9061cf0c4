"""The app's logic: chats, the store and the engine worker glued together. No widgets here.

Every user action arrives as a method call; everything the views show lives in the models (ChatModel,
ConversationListModel, TurnStatsModel) or comes out as a signal. What the cache holds is the engine's to
say (its typed events); saving that fails is retried by the SaveQueue (app/saving.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from PySide6.QtCore import QObject, Signal

from engine.events import CacheStats, Context, DecodeProgress, Done, Prefill, PrefillProgress, Reasoning, Token
from engine.run.generation import ChatDefaults

from .branches import ChatTree, Node
from .documents import Document, DocumentError, as_message, read_document
from .local_server import LocalServer, ServedTurn, ServerConfig
from .models import ChatModel, ConversationListModel, DraftModel, Message, TurnStatsModel
from .saving import SaveQueue
from .settings import AppSettings, load_settings, save_settings
from .system_prompts import SystemPrompts
from .tool_cards import MCP_FILE, ToolCards, load_servers
from .store import ConversationRow, MessageRow, SearchHit, Store, StoreError, TurnRow
from .transcript import to_json, to_markdown
from .worker import TURN_ERRORS, EngineHost, Origin
from .worker_payloads import ChatConfig, ModelInfo

log = logging.getLogger(__name__)

NEW_CHAT_TITLE = "New chat"


@dataclass
class InFlight:
    """The reply being generated."""
    ticket: int
    conversation_id: int
    user_index: int
    reply_index: int
    user_text: str
    documents: tuple[Document, ...] = ()  # attached to the message: back into the draft if the turn fails
    new_from: int = -1  # the first message the turn added (its user message, or a regenerated reply's index)
    stat_row: int = -1
    prefill: Prefill | None = None
    thinking: tuple[float, float] = (0.0, 0.0)  # monotonic times of its first and last thinking token


class ChatController(QObject):
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

    # --- tools ---------------------------------------------------------------------------------------------

    def start_tools(self) -> None:
        """(Re)starts the MCP servers of the data folder's mcp.json; a problem with the file is a notice."""
        specs, self.tools_problem = load_servers(self.data_dir)
        if self.tools_problem:
            self.notice.emit("warning", f"No tools from MCP servers: {self.tools_problem}", "")
        self.tools.start(specs)

    def mcp_servers(self) -> tuple[str, list]:
        """(the data folder's mcp.json text, the servers' statuses) for the settings dialog."""
        try:
            text = (self.data_dir / MCP_FILE).read_text(encoding="utf-8")
        except OSError:
            text = ""
        return text, self.tools.host.status()

    def set_mcp_servers(self, text: str) -> None:
        """Keeps `text` (checked JSON, or "" for none) as mcp.json and restarts the servers if it changed."""
        path = self.data_dir / MCP_FILE
        if text.strip() == self.mcp_servers()[0].strip():
            return
        try:
            if text.strip():
                path.write_text(text.strip() + "\n", encoding="utf-8")
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            self.notice.emit("error", f"Could not save the MCP servers to {path}: {e.strerror or e}", "")
            return
        self.start_tools()

    def _keep_allowed_tools(self) -> None:
        tools = replace(self.settings.tools, allowed_tools=",".join(sorted(self.tools.allowed)))
        self.settings = replace(self.settings, tools=tools)
        save_settings(self.data_dir, self.settings)

    def _on_tools_changed(self) -> None:
        self.tools_changed.emit()
        if self.model_state == "ready":
            self.host.configure(self._chat_config())  # the model is told of the tools there are now

    def tool_action(self, index: int, action: str) -> None:
        """A tool card's button: "run", "always", "deny" or "stop"."""
        self.tools.act(index, action)
        self.busy_changed.emit()

    def _on_tool_calls(self, ticket: int, calls: list) -> None:
        index = self._last_reply
        if self._closing or not 0 <= index < len(self.chat.messages):
            return
        reply = self.chat.messages[index]
        reply.extra = {**reply.extra, "tool_calls": list(calls)}
        self.chat.changed.emit(index)
        self._save_card(reply)
        self.tools.offer(list(calls))
        self.busy_changed.emit()

    def _save_card(self, message: Message) -> None:
        """Writes a message's new text and extra (a card's result, a reply's calls) once it is on disk."""
        conv_id = self.chat.conversation_id
        if conv_id is None or message.id is None:
            return  # not on disk yet: it is written whole, as it is by then
        self._write(conv_id, lambda: self.store.update_message(message.id, message.content, message.extra))

    def _send_tool_results(self, results: list) -> None:
        if self._closing or self.model_state != "ready" or self.busy:
            return
        last = len(self.chat.messages) - 1
        self._start_turn(self.host.send_tool_results(results), last, "", after_tools=True)
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

    # --- turns ---------------------------------------------------------------------------------------------

    def send(self, text: str) -> bool:
        """Sends a user message, with the draft's documents before it; False (and nothing changes) if that
        is not possible right now."""
        question = text.strip()
        documents = tuple(self.draft.documents)
        if not (question or documents) or not self.can_send:
            return False
        message = as_message(list(documents), question) if documents else question
        self._ensure_conversation(question or ", ".join(d.name for d in documents))
        user = self.chat.append(Message("user", message, pending=True))
        self._save_message(user)
        self.tools.new_user_turn()
        self._start_turn(self.host.send(message), user, question, documents)
        self.draft.set_documents([])
        return True

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

    def regenerate(self, index: int | None = None) -> bool:
        """Answers the user message before reply `index` (default: the last reply) again: the new reply is
        shown, the earlier ones stay as its alternatives, each with the branch that went on from it."""
        msgs = self.chat.messages
        index = len(msgs) - 1 if index is None else index
        if (not self.can_send or not 1 <= index < len(msgs) or msgs[index].role != "assistant"
                or msgs[index - 1].role != "user"):
            return False
        user = index - 1
        text = msgs[user].content
        # The last reply is decoded again from the cache as it is; an earlier one first takes the cache back
        # to its user message (a rewind when the cache still holds it, else a rebuild, as a branch switch).
        ticket = self.host.regenerate() if index == len(msgs) - 1 else self.host.answer_from(self.chat.history(user), text)
        self.chat.update(user, pending=True)
        self._start_turn(ticket, user, text, regenerate=True)
        return True

    def last_user_text(self) -> str | None:
        i = self.last_user_index()
        return None if i is None else self.chat.messages[i].content

    def last_user_index(self) -> int | None:
        return next((i for i in range(len(self.chat.messages) - 1, -1, -1) if self.chat.messages[i].role == "user"), None)

    def edit_resend(self, new_text: str) -> bool:
        """Edits the last user message (see edit_message)."""
        user = self.last_user_index()
        return user is not None and self.edit_message(user, new_text)

    def edit_message(self, index: int, new_text: str) -> bool:
        """Sends `new_text` in place of user message `index` and answers it: a new branch from there. The
        branch it replaces stays in the chat, one switch away. False (and nothing changes) if not possible."""
        new_text = new_text.strip()
        msgs = self.chat.messages
        if not new_text or not self.can_send or not 0 <= index < len(msgs) or msgs[index].role != "user":
            return False
        history = self.chat.history(index)
        self._ensure_conversation(new_text)
        user = self.chat.branch(index, Message("user", new_text, pending=True))
        self._save_message(user)
        self._start_turn(self.host.answer_from(history, new_text), user, new_text)
        return True

    # --- branches ------------------------------------------------------------------------------------------

    def switch_alternative(self, index: int, step: int) -> bool:
        """Shows the alternative `step` places from message `index` (-1: the previous one) and the branch
        under it, and puts that branch into the model's cache. Refused while a reply is being written."""
        if self.busy or self._closing:
            self.notice.emit("info", "Wait for the reply to finish, or stop it, before switching to another "
                             "alternative.", "")
            return False
        if not 0 <= index < len(self.chat.messages):
            return False
        node = self.chat.switch(index, step)
        if node is None:
            return False
        self._save_choice(node)
        self._sync_engine()
        return True

    def delete_alternative(self, index: int) -> bool:
        """Deletes message `index`, one of several alternatives, and the branch that went on from it; the
        alternative chosen before it is shown and put into the model's cache. Refused while a reply is being
        written, and for a message without alternatives (nothing would be left to show in its place)."""
        if self.busy or self._closing:
            self.notice.emit("info", "Wait for the reply to finish, or stop it, before deleting an alternative.", "")
            return False
        if not 0 <= index < len(self.chat.messages) or self.chat.alternatives(index)[1] < 2:
            return False
        conv_id, message = self.chat.conversation_id, self.chat.messages[index]
        self.chat.remove(index)
        if conv_id is not None and message.id is not None:
            # The rows under it go with it (parent_id ON DELETE CASCADE), and so do their search entries.
            self._write(conv_id, lambda: self.store.delete_message(message.id))
        self._sync_engine()
        return True

    def fork_chat(self, index: int) -> bool:
        """Copies the chat as shown, up to and with message `index`, into a new chat, and opens it."""
        if self.busy or self._closing:
            self.notice.emit("info", "Wait for the reply to finish, or stop it, before forking the chat.", "")
            return False
        if not 0 <= index < len(self.chat.messages):
            return False
        copies = [Message(m.role, m.content, meta=dict(m.meta), extra=dict(m.extra))
                  for m in self.chat.messages[: index + 1]]
        title = _title_from(f"{self.chat.title} (fork)")
        prompt = self.prompts.chat_prompt  # the fork keeps the chat's own system prompt (None: the default)
        self._leave_current()
        self.chat.load(None, title, copies)
        self.turns.set_rows([])
        self._ensure_conversation(title)
        conv_id = self.chat.conversation_id

        def write() -> None:
            rows = [(m.role, m.content, i - 1 if i else None, 0, m.extra) for i, m in enumerate(copies)]
            for message, mid in zip(copies, self.store.replace_tree(conv_id, title, rows)):
                message.id = mid

        self._write(conv_id, write)
        self.conversation_opened.emit()
        before = self.prompts.effective
        if prompt is not None:
            self.prompts.set_chat_prompt(prompt)
        if self.prompts.effective == before:  # else the prompt's change has put the chat into the cache already
            self._sync_engine()
        return True

    def _save_choice(self, node: Node[Message]) -> None:
        conv_id, message = self.chat.conversation_id, node.item
        if conv_id is not None and message.id is not None:
            self._write(conv_id, lambda: self.store.choose_message(message.id, node.rank))

    def stop(self) -> None:
        if self._turn is not None:
            self.host.stop(self._turn.ticket)

    def _start_turn(self, ticket: int, user_index: int, text: str, documents: tuple[Document, ...] = (),
                    regenerate: bool = False, after_tools: bool = False) -> None:
        """`after_tools`: the reply to tools' results (`user_index` is the last card): a failure takes only it."""
        message = Message("assistant", "", streaming=True, pending=True)
        reply = self.chat.branch(user_index + 1, message) if regenerate else self.chat.append(message)
        self._turn = InFlight(ticket, self.chat.conversation_id, user_index, reply, text, documents,
                              new_from=reply if regenerate or after_tools else user_index)
        self.busy_changed.emit()

    def _end_turn(self) -> None:
        self._turn = None
        self.busy_changed.emit()
        pending, self._after_idle = self._after_idle, []
        for action in pending:
            action()

    def _when_idle(self, action: Callable[[], None], stop: bool = True) -> None:
        """Runs `action` once the reply in progress ends (asking it to stop, unless `stop` is False)."""
        if not self.busy:
            action()
            return
        self._after_idle.append(action)
        if stop:
            self.stop()

    # --- engine events (typed, from engine/events.py; the engine says where everything is) -------------

    def _current(self, origin: Origin) -> bool:
        """Whether an event answers the request in progress, or the latest chat switch (not an older one)."""
        if origin.rebuild:
            return origin.switch == self.host.latest_switch
        return self._turn is not None and origin.ticket == self._turn.ticket

    def _on_prefill(self, ev: Prefill, origin: Origin) -> None:
        if not self._current(origin):
            return
        if origin.rebuild:
            if ev.new_tokens:
                row = TurnRow("rebuild", ev.new_tokens, ev.ms, cache=ev.cache.to_dict())
                self.turns.append(row)
                conv_id = self.chat.conversation_id
                if conv_id is not None:
                    self._write(conv_id, lambda: self.store.add_turn(conv_id, row), stats_only=True)
                self.rebuilt.emit(ev)
            return
        turn = self._turn
        turn.prefill = ev
        turn.stat_row = self.turns.append(TurnRow("turn", ev.new_tokens, ev.ms), live=True)
        self.turn_prefilled.emit(ev)

    def _on_prefill_progress(self, ev: PrefillProgress, origin: Origin) -> None:
        self._on_cache(ev.cache)
        if not origin.rebuild and self._current(origin):
            self.reading.emit(ev.done, ev.total)

    def _on_token(self, ev: Token, origin: Origin) -> None:
        if self._current(origin):
            self.chat.add_text(self._turn.reply_index, ev.text)

    def _on_reasoning(self, ev: Reasoning, origin: Origin) -> None:
        if not self._current(origin):
            return
        turn = self._turn
        now = time.monotonic()
        turn.thinking = (turn.thinking[0] or now, now)
        self.chat.add_reasoning(turn.reply_index, ev.text)

    def _on_decode_progress(self, ev: DecodeProgress, origin: Origin) -> None:
        if not self._current(origin):
            return
        self.live_rate.emit(ev.tok_s, ev.tokens)
        if self._turn.stat_row >= 0:
            self.turns.update(self._turn.stat_row, tokens=ev.tokens, tok_s=ev.tok_s)

    def _on_done(self, ev: Done, origin: Origin) -> None:
        if not self._current(origin):
            return
        turn = self._turn
        prefill = turn.prefill or Prefill(0, 0.0, ev.cache)
        meta = {"tokens": ev.tokens, "tok_s": ev.tok_s, "stop_reason": ev.stop_reason,
                "prefill_tokens": prefill.new_tokens, "prefill_ms": prefill.ms}
        reply = self.chat.messages[turn.reply_index]
        if self.model_info is not None and self.model_info.model:
            reply.extra = {**reply.extra, "model": self.model_info.model}  # which model wrote it (hover, export)
        if turn.thinking[0]:
            # Stored with the message: how long it thought, from its first thinking token to its last.
            reply.extra = {**reply.extra, "thinking_ms": round((turn.thinking[1] - turn.thinking[0]) * 1e3)}
        self.chat.update(turn.reply_index, streaming=False, pending=False, meta=meta)
        if turn.stat_row >= 0:
            self.turns.update(turn.stat_row, tokens=ev.tokens, decode_ms=ev.ms, tok_s=ev.tok_s,
                              stop_reason=ev.stop_reason, live=False)
        conv_id = turn.conversation_id
        saved = self._save_message(turn.reply_index)
        message_id = self.chat.messages[turn.reply_index].id if saved else None
        row = TurnRow("turn", prefill.new_tokens, prefill.ms, ev.tokens, ev.ms, ev.tok_s, ev.stop_reason,
                      ev.cache.to_dict(), message_id)
        self._write(conv_id, lambda: self.store.add_turn(conv_id, row), stats_only=True)
        self.live_rate.emit(ev.tok_s, ev.tokens)
        self.turn_finished.emit(row)
        self._last_reply = turn.reply_index
        self._end_turn()

    def _on_cache(self, cache: CacheStats) -> None:
        self.cache = cache
        self.cache_changed.emit(cache)

    def _on_context(self, ctx: Context, origin: Origin) -> None:
        if self._current(origin):  # not a rebuild for a chat that is no longer open
            self.chat.apply_context(ctx)
            self._on_cache(ctx.cache)

    def _on_error(self, kind: str, message: str) -> None:
        if kind in TURN_ERRORS:
            turn = self._turn
            if turn is None:
                return
            # Nothing of the failed turn stays in the model's session, so what it added leaves the chat too (what
            # was shown before, an earlier alternative, is shown again) and a message it sent goes back to the
            # input box to be edited or sent again.
            if turn.stat_row >= 0:
                self.turns.update(turn.stat_row, live=False, stop_reason="error")
            added = self.chat.messages[turn.new_from]
            self.chat.remove(turn.new_from)
            conv_id = turn.conversation_id
            if added.id is not None:
                self._write(conv_id, lambda: self.store.delete_message(added.id))
            if not self.chat.messages:
                self._forget_empty_chat()
            if turn.documents and not self.draft.documents:
                self.draft.set_documents(list(turn.documents))
            if turn.new_from == turn.user_index:
                self.restore_input.emit(turn.user_text)
            self.notice.emit("error", message, "")
            # The session went back to before the turn; an earlier alternative shown again must be put back.
            shown_again = len(self.chat.messages) > turn.new_from
            self._end_turn()
            if shown_again:
                self._sync_engine()
        elif kind == "load":
            self._set_model_state("failed")
            self.notice.emit("error", f"The model could not be loaded: {message}", "settings")
        elif kind == "cancelled":
            self._set_model_state("failed")
            self.notice.emit("warning", "Building the model was cancelled. Eddy needs the compiled model to chat.",
                             "retry_load")
        else:
            self.notice.emit("warning", message, "")

    def _forget_empty_chat(self) -> None:
        """A new chat whose first message failed is not kept as an empty chat in the list."""
        conv_id = self.chat.conversation_id
        if conv_id is None:
            return
        try:
            if conv_id >= 0:
                self.store.delete_conversation(conv_id)
        except StoreError:
            return  # it stays in the list, empty: harmless
        self.saves.forget(conv_id)
        self.conversations.remove(conv_id)
        self.chat.conversation_id, self.chat.title = None, NEW_CHAT_TITLE
        self.current_changed.emit()

    # --- saving --------------------------------------------------------------------------------------------

    def _read(self, fn: Callable, fallback):
        try:
            return fn()
        except StoreError as e:
            self.notice.emit("error", str(e), "")
            return fallback

    def _ensure_conversation(self, first_text: str) -> None:
        if self.chat.conversation_id is not None:
            row = self.conversations.rows[self.conversations.row_of(self.chat.conversation_id)] \
                if self.conversations.row_of(self.chat.conversation_id) >= 0 else None
            if row is not None:
                self.conversations.upsert(replace(row, updated=time.time()))
            return
        title = _title_from(first_text)
        self.chat.title = title
        try:
            conv_id = self.store.create_conversation(title)
        except StoreError as e:
            conv_id = self._next_temp_id  # not on disk yet: saved under a real id once the store works
            self._next_temp_id -= 1
            self.saves.mark(conv_id, e)
        self.chat.conversation_id = conv_id
        now = time.time()
        self.conversations.upsert(ConversationRow(conv_id, title, now, now))
        self.current_changed.emit()

    def _save_message(self, index: int) -> bool:
        conv_id = self.chat.conversation_id
        node = self.chat.nodes[index]
        message = node.item

        def write() -> None:
            parent = node.parent.item.id if node.parent is not None else None
            if node.parent is not None and parent is None:
                # Its parent never reached the disk: the whole chat is written, in order, once it can be.
                raise StoreError("Could not save the message: the one before it is not saved yet.")
            message.id = self.store.add_message(conv_id, parent, index, message.role, message.content, node.rank,
                                                message.extra)

        return self._write(conv_id, write)

    def _write(self, conv_id: int, fn: Callable[[], object], stats_only: bool = False) -> bool:
        """One store write for a chat; if the chat is already behind on disk, writes it whole instead."""
        if conv_id in self.saves:
            return False if stats_only else self.saves.flush(conv_id)
        try:
            fn()
            return True
        except StoreError as e:
            # Statistics are not worth a retry, and a chat that is not open has nothing unsaved in memory
            # (a failed rename just keeps the old title); the open conversation is kept and retried.
            if stats_only or conv_id != self.chat.conversation_id:
                self.notice.emit("warning", str(e), "")
            else:
                self.saves.mark(conv_id, e)
            return False

    def _on_saved_under(self, temp_id: int, real_id: int) -> None:
        """A chat first kept under a temporary id is on disk now: everything that names it follows."""
        if self._turn is not None and self._turn.conversation_id == temp_id:
            self._turn.conversation_id = real_id
        i = self.conversations.row_of(temp_id)
        if i >= 0:
            self.conversations.upsert(replace(self.conversations.rows[i], id=real_id), to_top=False)
        if self.chat.conversation_id == temp_id:
            self.chat.conversation_id = real_id
            self.current_changed.emit()

    def retry_saves(self) -> bool:
        """Tries to write every unsaved chat now; True if none is left."""
        return self.saves.retry()

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

    # --- the local server ----------------------------------------------------------------------------------

    @property
    def server_address(self) -> str | None:
        """Where the local server answers, while it is on."""
        return self.local_server.address

    @property
    def waiting_for_server(self) -> bool:
        """A window turn is queued behind a server request (its message waits, the window is not frozen)."""
        return self.server_busy and self._turn is not None and self._turn.prefill is None

    def _server_config(self) -> ServerConfig | None:
        """What the server should be running with now; None: it should be off."""
        s = self.settings
        info = self.model_info
        if not s.server.serve or self.model_state != "ready" or self._closing or info is None:
            return None
        if info.remote:
            return None  # a remote model's server is already a server: clients can use it directly
        return ServerConfig(s.server.server_port, s.server.server_key, str(info.model),
                            self.chat_defaults, s.chat.pin_system, s.chat.max_new_tokens)

    def _sync_server(self) -> None:
        """Starts, stops or restarts the local server to match the settings and the model."""
        want, server = self._server_config(), self.local_server
        if server.running:
            if server.config != want:
                server.stop()  # stopped follows once the port is free; then this runs again
                self.server_changed.emit()
            return
        session = self.host.worker.session
        if want is None or session is None:
            return
        try:
            server.start(session, want)
        except OSError as e:
            # Refused clearly, and the switch goes off: it would fail the same way at every start.
            self.notice.emit("error", f"The local server could not start: {e.strerror or e}. Choose another port "
                             "in Settings.", "settings")
            self.settings = replace(self.settings, server=replace(self.settings.server, serve=False))
            try:
                save_settings(self.data_dir, self.settings)
            except Exception as e2:  # QSettings reports no errors; be safe anyway
                log.warning("could not save the settings: %s", e2)
        self.server_changed.emit()

    def _on_server_request(self) -> None:
        self.server_busy = True
        self.server_changed.emit()

    def _on_served(self, served: ServedTurn) -> None:
        self.server_busy = False
        p, d = served.prefill, served.done
        if p is not None:
            # Its own kind of row: the request's prefill beside what its conversation's cache already held.
            row = TurnRow("server", p.new_tokens, p.ms, d.tokens if d else 0, d.ms if d else 0.0,
                          d.tok_s if d else 0.0, d.stop_reason if d else "stopped", (d or p).cache.to_dict(),
                          reused=p.cache.position - p.new_tokens)
            self.turns.append(row)
            self.server_turn.emit(row)
        self._on_cache(served.window_cache)  # the window's conversation is back in the cache: the bar shows it
        self.server_changed.emit()

    def _on_server_stopped(self, problem: str) -> None:
        self.server_busy = False
        if problem and not self._closing:
            self.notice.emit("warning", f"{problem[:1].upper()}{problem[1:]}.", "")
        self.server_changed.emit()
        if self._closing:
            self._close_when_done()
        elif not problem:
            self._sync_server()  # a restart (new port, key or model) starts once the old one has let go


def _title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 48 else line[:47].rstrip() + "…"


def _tree_of(rows: list[MessageRow], turns: Sequence[TurnRow] = ()) -> ChatTree[Message]:
    # A stored reply gets back the stats its turn saved (the same meta _on_done gives a reply just written).
    stats = {t.message_id: t for t in turns if t.kind == "turn" and t.message_id is not None}

    def message(r: MessageRow) -> Message:
        t = stats.get(r.id)
        meta = {"tokens": t.tokens, "tok_s": t.tok_s, "stop_reason": t.stop_reason, "prefill_tokens": t.prefill_tokens,
                "prefill_ms": t.prefill_ms} if t is not None and r.role == "assistant" else {}
        return Message(r.role, r.content, id=r.id, meta=meta, created=r.created, extra=r.extra)

    return ChatTree.of(rows, lambda r: r.id, lambda r: r.parent_id, lambda r: r.chosen, message)
