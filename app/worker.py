"""The engine on its own thread. The GUI talks to it only through queued signals, so it never waits on it.

Requests (GUI -> worker, queued, handled one at a time in order): load, configure, send, regenerate,
edit_resend, switch_chat, shutdown. Two calls are made directly from the GUI thread because the worker is
busy inside the engine when they matter: request_stop() (the session's stop flag is thread-safe) and
cancel_load() (a flag the build polls).

Events (worker -> GUI): progress(stage, fraction), loaded(info), prefill(event), token(text), done(event),
cache(stats), context(spans), error(kind, message), finished().
"""
from __future__ import annotations

import logging
import time
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.errors import BuildCancelled, EddyError, PromptTooLongError
from engine.events import Context, Done, Event, Prefill, PrefillProgress, Token
from engine.run.generation import ChatDefaults, sampling_params
from engine.run.session import ChatSettings

from .history import fit_history

log = logging.getLogger(__name__)

# Error kinds: "load" (the model could not be opened or built), "cancelled" (the user cancelled a build),
# "too_long" (the message does not fit the window; nothing changed), "turn" (a reply failed),
# "rebuild" (restoring a chat into the cache failed), "settings" (a rejected setting).
TURN_ERRORS = ("turn", "too_long")


class EngineWorker(QObject):
    progress = Signal(str, float)
    loaded = Signal(object)      # {"model", "folder", "settings", "seconds", "built", "cache", "chat_defaults"}
    prefill = Signal(object)     # the engine's prefill event, plus "kind" ("turn" or "rebuild") and "ticket"
    token = Signal(str)
    done = Signal(object)        # the engine's done event, plus "reply" (the whole text) and "ticket"
    cache = Signal(object)       # CacheStats as a dict
    context = Signal(object)     # {"first": i, "spans": [[start, end], ...], "left": [...]} after each prefill
    error = Signal(str, str)     # kind, message for the user
    pong = Signal(int)           # answers ping(): every request queued before it has been handled
    finished = Signal()

    def __init__(self) -> None:
        super().__init__()
        self._model: Any = None
        self._session: Any = None
        self._chat_settings = ChatSettings()
        # Loads are numbered; a cancel covers every load up to the one current when it was asked for, so
        # it can neither be lost (load not started yet) nor leak into a later load.
        self._cancelled_through = 0
        # Tickets name generation requests; a stop names the one it is meant for, so a stop that arrives
        # late (after its reply ended) never cuts the next reply short, and one that arrives before its
        # request starts still stops it.
        self._ticket = -1
        self._stop_ticket = -1
        self._latest_switch = 0
        self._first = 0  # index in the GUI's history of the first message the session holds

    # --- called from the GUI thread --------------------------------------------------------------------

    def request_stop(self, ticket: int) -> None:
        self._stop_ticket = ticket
        session = self._session
        if session is not None and self._ticket == ticket:
            session.stop()

    def cancel_load(self, through: int) -> None:
        self._cancelled_through = max(self._cancelled_through, through)

    def note_switch(self, seq: int) -> None:
        """Only the latest chat switch matters: earlier queued ones are skipped."""
        self._latest_switch = seq

    # --- requests (run on the worker thread) ---------------------------------------------------------------

    @Slot(int, str, object, object)
    def load(self, seq: int, model: str, build: dict, chat: dict) -> None:
        from engine.config import BuildSettings
        from engine.loader import open_model

        def cancelled() -> bool:
            return self._cancelled_through >= seq

        self._session = self._model = None  # free the old module before building or loading the new one
        if cancelled():
            self.error.emit("cancelled", "Loading the model was cancelled.")
            return
        built = False

        def progress(stage: str, fraction: float) -> None:
            nonlocal built
            built = True
            self.progress.emit(stage, float(fraction))

        start = time.perf_counter()
        try:
            _chat_settings(chat, None)  # a bad value fails before a long build
            self._model = open_model(model or None, BuildSettings(**build), progress, cancelled)
            self._chat_settings = _chat_settings(chat, self._model.chat_defaults)
            self._session = self._model.chat(self._chat_settings)
        except EddyError as e:
            was_cancelled = cancelled() or isinstance(e, BuildCancelled)
            self.error.emit("cancelled" if was_cancelled else "load", str(e))
            return
        except (ValueError, OSError) as e:
            self.error.emit("load", f"{type(e).__name__}: {e}")
            return
        except Exception as e:  # the build runs torch and a compiler: anything can fail, the app must not
            log.exception("loading the model failed")
            self.error.emit("load", f"Unexpected error while loading the model: {e!r}")
            return
        engine = self._model.engine
        self.loaded.emit({
            "model": self._model.source.name if self._model.source else model,
            "folder": str(self._model.folder),
            "settings": engine.settings.to_dict(),
            "seconds": round(time.perf_counter() - start, 2),
            "built": built,
            "cache": engine.stats.to_dict(),
            "chat_defaults": self._model.chat_defaults.to_dict(),
        })

    @Slot(object)
    def configure(self, chat: dict) -> None:
        try:
            self._chat_settings = _chat_settings(chat, self._model.chat_defaults if self._model else None)
        except ValueError as e:
            self.error.emit("settings", str(e))
            return
        if self._session is not None:
            self._session.settings = self._chat_settings

    @Slot(int, str)
    def send(self, ticket: int, text: str) -> None:
        self._generate(ticket, text)

    @Slot(int, object, str)
    def regenerate(self, ticket: int, history: list, user_text: str) -> None:
        """Answers `user_text` again after `history` (the chat before that user message)."""
        if self._rebuild(history, reserve=user_text, tag={"ticket": ticket, "switch": -1}):
            self._generate(ticket, user_text)
        else:
            self.error.emit("turn", "The chat could not be restored into the model's cache.")

    @Slot(int, object, str)
    def edit_resend(self, ticket: int, history: list, new_text: str) -> None:
        # The cache holds the old message's tokens, so it is rebuilt exactly as for a regenerate.
        self.regenerate(ticket, history, new_text)

    @Slot(int, object)
    def switch_chat(self, seq: int, history: list) -> None:
        if seq < self._latest_switch:
            return
        self._rebuild(history, tag={"ticket": -1, "switch": seq})

    @Slot(int)
    def ping(self, n: int) -> None:
        self.pong.emit(n)

    @Slot()
    def shutdown(self) -> None:
        self._session = self._model = None  # free the IREE context on the thread that made it
        self.finished.emit()

    # --- internals -------------------------------------------------------------------------------------------

    def _generate(self, ticket: int, text: str) -> None:
        session = self._session
        if session is None:
            self.error.emit("turn", "No model is loaded.")
            return
        self._ticket = ticket
        before = list(session.messages)
        final: dict = {}

        def on_event(event: Event) -> None:
            if self._stop_ticket == ticket:
                session.stop()
            if isinstance(event, Token):
                self.token.emit(event.text)
            elif isinstance(event, Prefill):
                self.prefill.emit({**event.to_dict(), "kind": "turn", "ticket": ticket, "switch": -1})
                self.cache.emit(event.cache.to_dict())
            elif isinstance(event, PrefillProgress):  # a long message streaming in: the cache bar moves
                self.cache.emit(event.cache.to_dict())
            elif isinstance(event, Context):
                self._forward_context(event, {"ticket": ticket, "switch": -1})
            elif isinstance(event, Done):
                final.update(event.to_dict())

        try:
            result = session.send(text, on_event)
        except PromptTooLongError as e:
            self.error.emit("too_long", str(e))
            return
        except Exception as e:
            log.exception("a turn failed")
            # The cache may hold half a turn: put the chat back as it was before this message.
            self._rebuild_quietly(before)
            self.error.emit("turn", str(e) if isinstance(e, EddyError) else f"Generation failed: {e!r}")
            return
        finally:
            self._ticket = -1
        stats = session.engine.stats.to_dict()
        self.done.emit({"event": "done", "tokens": result.tokens, "ms": round(result.decode_ms, 2), "tok_s": 0.0,
                        "stop_reason": result.stop_reason, "cache": stats, **final, "reply": result.text,
                        "prefill_tokens": result.prefill_tokens, "prefill_ms": round(result.prefill_ms, 2),
                        "ticket": ticket})
        self.cache.emit(stats)

    def _rebuild(self, history: list, reserve: str = "", tag: dict | None = None) -> bool:
        """Clears the cache and prefills the recent part of `history` that fits; says if it worked.

        `tag` ({"ticket", "switch"}) goes into the events so the GUI can tell which request they answer."""
        tag = tag or {"ticket": -1, "switch": -1}
        session = self._session
        if session is None:
            return False
        engine, tokenizer = session.engine, session.tokenizer
        try:
            budget = engine.settings.capacity - (len(tokenizer.encode_text(reserve)) + 8 if reserve else 0)
            fitted = fit_history(tokenizer, self._chat_settings.system_prompt, list(history), max(0, budget))
            self._first = fitted.first
            event = session.resume(fitted.messages, fitted.ids)
            if fitted.ids:
                self.prefill.emit({**event.to_dict(), "kind": "rebuild", **tag})
        except Exception as e:
            log.exception("rebuilding the cache failed")
            session.reset()
            self.error.emit("rebuild", f"Could not restore the chat into the model's cache: {e}")
            self.cache.emit(engine.stats.to_dict())
            return False
        self._forward_context(session.context(), tag)
        self.cache.emit(engine.stats.to_dict())
        return True

    def _forward_context(self, context: Context, tag: dict) -> None:
        """The session's message spans in the GUI's numbering: its history has no system message, and the
        session holds the part from `_first` on (what the last rebuild kept)."""
        session = self._session
        skip = 1 if session is not None and session.messages and session.messages[0].get("role") == "system" else 0
        first = self._first + context.dropped
        spans = [list(span) for span in context.spans[skip:]]
        left = [first + i - skip for i in context.left if i >= skip]
        self.context.emit({"first": first, "spans": spans, "left": left, **tag})

    def _rebuild_quietly(self, history: list[dict]) -> None:
        rest = history[1:] if history and history[0].get("role") == "system" else history
        try:
            self._rebuild(rest)
        except Exception:  # already reported by _rebuild
            pass


def _chat_settings(chat: dict, defaults: ChatDefaults | None) -> ChatSettings:
    """AppSettings.chat_dict() over the loaded model's sampling defaults (Eddy's own before a model loads)."""
    sampling = sampling_params(defaults or ChatDefaults(), chat.get("overrides"), chat.get("seed"))
    return ChatSettings(system_prompt=chat.get("system_prompt") or None,
                        max_new_tokens=int(chat.get("max_new_tokens", 512)), sampling=sampling,
                        pin_system=bool(chat.get("pin_system")))


class EngineHost(QObject):
    """Owns the worker thread; the GUI side's handle on the engine (every method returns at once)."""

    _load = Signal(int, str, object, object)
    _configure = Signal(object)
    _send = Signal(int, str)
    _regenerate = Signal(int, object, str)
    _edit_resend = Signal(int, object, str)
    _switch = Signal(int, object)
    _ping = Signal(int)
    _shutdown = Signal()

    stopped = Signal()  # the worker thread has ended (after shutdown())
    idle = Signal()     # answers ping(), on the GUI thread, after every event the worker sent before it

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("eddy-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._configure.connect(self.worker.configure)
        self._send.connect(self.worker.send)
        self._regenerate.connect(self.worker.regenerate)
        self._edit_resend.connect(self.worker.edit_resend)
        self._switch.connect(self.worker.switch_chat)
        self._ping.connect(self.worker.ping)
        # Relayed through this GUI-thread object, so it arrives after the events queued before it.
        self.worker.pong.connect(self._on_pong)
        self._shutdown.connect(self.worker.shutdown)
        self.worker.finished.connect(self.thread.quit)
        self.thread.finished.connect(self.stopped)
        self._tickets = 0
        self._switches = 0
        self._loads = 0
        self._shutting_down = False
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread.isRunning()

    def load(self, model: str, build: dict, chat: dict) -> None:
        self._loads += 1
        self._load.emit(self._loads, model, build, chat)

    def configure(self, chat: dict) -> None:
        self._configure.emit(chat)

    def send(self, text: str) -> int:
        self._tickets += 1
        self._send.emit(self._tickets, text)
        return self._tickets

    def regenerate(self, history: list[dict], user_text: str) -> int:
        self._tickets += 1
        self._regenerate.emit(self._tickets, history, user_text)
        return self._tickets

    def edit_resend(self, history: list[dict], new_text: str) -> int:
        self._tickets += 1
        self._edit_resend.emit(self._tickets, history, new_text)
        return self._tickets

    @property
    def latest_switch(self) -> int:
        return self._switches

    def switch_chat(self, history: list[dict]) -> None:
        self._switches += 1
        self.worker.note_switch(self._switches)
        self._switch.emit(self._switches, history)

    def ping(self) -> None:
        """`idle` follows once the worker has handled every request sent before (tests wait on it)."""
        self._ping.emit(0)

    def _on_pong(self, _n: int) -> None:
        self.idle.emit()

    def stop(self, ticket: int) -> None:
        self.worker.request_stop(ticket)

    def cancel_load(self) -> None:
        self.worker.cancel_load(self._loads)

    def shutdown(self) -> None:
        """Asks the worker to free the model and end its thread once its current request returns."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self.worker.cancel_load(self._loads)
        self.worker.request_stop(self._tickets)
        self._shutdown.emit()

    def wait(self, ms: int = 10000) -> bool:
        """Blocks until the thread ended: only for the very end of the process, after shutdown()."""
        return self.thread.wait(ms) if self.thread.isRunning() else True
