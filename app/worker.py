"""The engine on its own thread. The GUI talks to it only through queued signals, so it never waits on it.

Requests (GUI -> worker, queued, handled one at a time in order): load, configure, send, regenerate,
answer_from (an edited message, anywhere in the chat), switch_chat (another chat, or another
branch of this one), count (a draft's tokens, answered by counted), serve (a local-server request, posted
from the server's HTTP thread: it lines up with the window's requests), shutdown. Two calls are made
directly from the GUI thread because the worker is busy inside the engine when they matter: request_stop()
(the session's stop flag is thread-safe) and cancel_load() (a flag the build polls).

Events (worker -> GUI): the session's own typed events (engine/events.py), one signal per kind, each with
the Origin of the request it answers; plus progress(stage, fraction) and loaded(ModelInfo) for model loads and
error(kind, message); progress_detail(stage, detail) follows each progress with the stage's own words ("tensor 12
of 272"). The worker computes nothing about the cache: the session says it all.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.errors import BuildCancelled, EddyError, PromptTooLongError
from engine.events import Context, DecodeProgress, Done, Event, Prefill, PrefillProgress, Reasoning, Token
from engine.config import BuildSettings
from engine.run.session import ChatSession, ChatSettings, EventSink
from engine.remote import is_remote, open_remote
from engine.run.tools import Choice, ToolError, ToolPlan

from .worker_payloads import ChatConfig, ModelInfo

log = logging.getLogger(__name__)

# Error kinds: "load" (the model could not be opened or built), "cancelled" (the user cancelled a build),
# "too_long" (the message does not fit; nothing changed), "turn" (a reply failed),
# "rebuild" (restoring a chat into the cache failed), "settings" (a rejected setting).
TURN_ERRORS = ("turn", "too_long")
# The niceness of IREE's compute threads in the app. On a machine with as many cores as workers, the GUI thread
# (and the X server) otherwise waits in the run queue behind them while a chat is rebuilt or a reply streams;
# at a lower priority they still get every idle cycle, so the engine runs as fast when nothing else wants the CPU.
ENGINE_NICE = 10


def yield_to_gui() -> int:
    """Lowers the priority of this process's IREE worker threads (Linux names them iree-worker-N); how many."""
    import os

    lowered = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0  # not Linux: per-thread niceness is not offered there
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                if not f.read().startswith("iree-worker"):
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), ENGINE_NICE)
            lowered += 1
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return lowered


@dataclass(frozen=True)
class Origin:
    """Which request an event answers: a reply (its ticket) or a chat put back into the cache (its switch)."""
    ticket: int = -1
    switch: int = -1

    @property
    def rebuild(self) -> bool:
        return self.switch >= 0


class EngineWorker(QObject):
    progress = Signal(str, float)
    progress_detail = Signal(str, str)  # stage, what it is at: right after each progress (the dialog shows it)
    loaded = Signal(object)            # ModelInfo (app/worker_payloads.py)
    prefill = Signal(object, object)   # each engine event kind with its Origin
    prefill_progress = Signal(object, object)
    token = Signal(object, object)
    reasoning = Signal(object, object)  # a reasoning model's thinking, beside the reply's tokens
    decode_progress = Signal(object, object)
    done = Signal(object, object)
    context = Signal(object, object)
    error = Signal(str, str)           # kind, message for the user
    counted = Signal(int, int)         # answers count(seq, text): seq, the text's tokens
    # After a reply's done: the tool calls it made, as OpenAI's dicts (ticket, [call, ...]), the calls' text
    # kept out of its tokens.
    tool_calls = Signal(int, object)
    pong = Signal(int)                 # answers ping(): every request queued before it has been handled
    finished = Signal()

    def __init__(self) -> None:
        super().__init__()
        self._model: Any = None
        self._session: ChatSession | None = None
        self._chat_settings = ChatSettings()
        self._chat = ChatConfig()  # the last one told (its tools and tool_choice are applied per turn)
        # Loads are numbered; a cancel covers every load up to the one current when it was asked for, so
        # it can neither be lost (load not started yet) nor leak into a later load.
        self._cancelled_through = 0
        # Tickets name generation requests; a stop names the one it is meant for, so a stop that arrives
        # late (after its reply ended) never cuts the next reply short, and one that arrives before its
        # request starts still stops it.
        self._ticket = -1
        self._stop_ticket = -1
        self._latest_switch = 0
        self._signals: dict[type, Signal] = {
            Prefill: self.prefill, PrefillProgress: self.prefill_progress, Token: self.token, Reasoning: self.reasoning,
            DecodeProgress: self.decode_progress, Done: self.done, Context: self.context,
        }

    # --- called from the GUI thread --------------------------------------------------------------------

    @property
    def session(self) -> ChatSession | None:
        """The loaded model's session, for the local server to run its jobs on (on this worker's thread)."""
        return self._session

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
    def load(self, seq: int, model: str, build: BuildSettings, chat: ChatConfig) -> None:
        from engine.gpu import device_name, runnable
        from engine.loader import open_model

        def cancelled() -> bool:
            return self._cancelled_through >= seq

        self._session = self._model = None  # free the old module before building or loading the new one
        if cancelled():
            self.error.emit("cancelled", "Loading the model was cancelled.")
            return
        built = False

        def progress(stage: str, fraction: float, detail: str = "") -> None:
            nonlocal built
            built = True
            self.progress.emit(stage, float(fraction))
            self.progress_detail.emit(stage, detail)

        start = time.perf_counter()
        if is_remote(model):
            self._load_remote(model, chat, start)
            return
        try:
            chat.chat_settings()  # a bad value fails before a long build
            settings, device_note = runnable(build)
            self._model = open_model(model or None, settings, progress, cancelled)
            self._chat_settings = chat.chat_settings(self._model.chat_defaults)
            self._chat = chat
            self._session = self._model.chat(self._chat_settings)
            self._session.settings = self._with_tools()
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
        yield_to_gui()  # the new module's device brought its own worker threads
        engine = self._model.engine
        self.loaded.emit(ModelInfo(
            model=self._model.source.name if self._model.source else model,
            folder=str(self._model.folder),
            build=engine.settings,
            window=engine.settings.window,
            device=device_name(engine.settings) + (f" ({device_note})" if device_note else ""),
            seconds=round(time.perf_counter() - start, 2),
            built=built,
            cache=engine.stats,
            chat_defaults=self._model.chat_defaults,
        ))

    def _load_remote(self, url: str, chat: ChatConfig, start: float) -> None:
        """A model on an OpenAI-compatible server (engine/remote.py): nothing to build, its context is the window."""
        try:
            self._model = open_remote(url, chat.api_key or None, chat.context or None)
            self._chat_settings = chat.chat_settings(self._model.chat_defaults)
            self._chat = chat
            self._session = self._model.chat(self._chat_settings)
        except (EddyError, ValueError) as e:
            self.error.emit("load", str(e))
            return
        info = self._model.info
        self.loaded.emit(ModelInfo(
            model=info.model, folder=url, build=None, window=info.context,
            device=f"remote · {self._model.source.url}" + ("" if info.context_known else " (context assumed)"),
            seconds=round(time.perf_counter() - start, 2), built=False, cache=self._session.stats,
            chat_defaults=self._model.chat_defaults,
        ))

    @Slot(object)
    def configure(self, chat: ChatConfig) -> None:
        try:
            self._chat_settings = chat.chat_settings(self._model.chat_defaults if self._model else None)
        except ValueError as e:
            self.error.emit("settings", str(e))
            return
        self._chat = chat
        if self._session is not None:
            self._session.settings = self._with_tools()

    @Slot(int, str)
    def send(self, ticket: int, text: str) -> None:
        # tool_choice "required" (or a named function) forces a call in the reply to the user's message, not
        # in the ones after its results (or the loop would never end).
        self._turn(ticket, lambda session, on_event: session.answer(text, on_event),
                   force=self._chat.tool_choice != "auto")

    @Slot(int, object)
    def send_tool_results(self, ticket: int, results: list) -> None:
        """Answers after tools' results ({"role": "tool", "content", "tool_call_id"} each, in call order)."""
        def run(session: ChatSession, on_event: EventSink) -> object:
            shaped = self._plan().messages(list(results))
            return session.answer(shaped[-1], on_event, before=shaped[:-1])

        self._turn(ticket, run)

    @Slot(int)
    def regenerate(self, ticket: int) -> None:
        self._turn(ticket, lambda session, on_event: session.regenerate(on_event))

    @Slot(int, object, str)
    def answer_from(self, ticket: int, history: list, text: str) -> None:
        """Answers `text` as the message after `history` (the chat up to an edited message): the session goes
        back to there, or rebuilds it, before the turn; only the turn's own events are sent."""
        def run(session: ChatSession, on_event: EventSink) -> object:
            session.follow(self._plan().messages(history))  # its prefill is not the turn's: its own events follow
            return session.answer(text, on_event)

        self._turn(ticket, run)

    @Slot(int, object)
    def switch_chat(self, seq: int, history: list) -> None:
        """Puts a chat, or another branch of the open one (its user and assistant messages), into the cache:
        the session keeps what it already holds of it, or rebuilds it with what fits."""
        session = self._session
        if seq < self._latest_switch or session is None:
            return
        origin = Origin(switch=seq)
        try:
            session.follow(self._plan().messages(history), lambda event: self._forward(event, origin))
        except Exception as e:
            log.exception("rebuilding the cache failed")
            self.error.emit("rebuild", f"Could not restore the chat into the model's cache: {e}")

    @Slot(int, str)
    def count(self, seq: int, text: str) -> None:
        """How many tokens `text` is as a message's content (the draft shows it before it is sent)."""
        session = self._session
        if session is None:
            return
        try:
            self.counted.emit(seq, session.count_tokens(text))
        except Exception:  # a count is only a hint: never an error for the user
            log.exception("counting a draft's tokens failed")

    @Slot(object, object)
    def serve(self, runner: Any, job: Any) -> None:
        """A local-server request (app/local_server.py WorkerRunner), between the window's turns."""
        try:
            runner.run_between(job)
        except Exception:  # the window's conversation stays as the runner left it; the app must go on
            log.exception("a local-server request failed on the engine thread")

    @Slot(int)
    def ping(self, n: int) -> None:
        self.pong.emit(n)

    @Slot()
    def shutdown(self) -> None:
        self._session = self._model = None  # free the IREE context on the thread that made it
        self.finished.emit()

    # --- internals -------------------------------------------------------------------------------------------

    def _plan(self) -> ToolPlan:
        """The window's tools (from its MCP servers) as this model's template takes them."""
        tools = list(self._chat.tools)
        tokenizer = self._session.model_tokenizer if self._session is not None else None
        if tokenizer is None:  # a remote model: no tools through Eddy's templates (the server's are its own)
            return ToolPlan.make("", [], Choice("none"))
        source = tokenizer.template_source
        return ToolPlan.make(source, tools, Choice("auto" if tools else "none"))

    def _with_tools(self, force: bool = False) -> ChatSettings:
        """The chat settings with the tools told to the model: in the template's own way or the system prompt;
        `force`: the reply must be calls (a grammar holds it to them)."""
        plan = self._plan()
        if not plan.active:
            return self._chat_settings
        base = self._chat_settings
        grammar = None
        if force:
            try:
                plan.choice = Choice.read(self._chat.tool_choice, plan.tools)
            except ToolError:
                plan.choice = Choice("required")  # a named tool that has gone: any of the others
            grammar = plan.grammar(self._session.tokenizer.special_id)
        return replace(base, system_prompt=plan.system(base.system_prompt), template_extras=plan.extras() or None,
                       grammar=grammar)

    def _turn(self, ticket: int, run: Callable[[ChatSession, EventSink], object], force: bool = False) -> None:
        session = self._session
        if session is None:
            self.error.emit("turn", "No model is loaded.")
            return
        self._ticket = ticket
        origin = Origin(ticket=ticket)
        plan = self._plan()
        stream = plan.stream()
        calls: list = []
        if force and plan.active:
            session.settings = self._with_tools(force=True)

        def on_event(event: Event) -> None:
            if self._stop_ticket == ticket:
                session.stop()
            if stream is not None and isinstance(event, Token):
                # A call's text never shows as the reply's: the calls come after done, on their own signal.
                text = stream.push(event.text)
                if text:
                    self._forward(Token(text), origin)
                return
            if stream is not None and isinstance(event, Done):
                tail, found = stream.finish()
                if tail:
                    self._forward(Token(tail), origin)
                calls.extend(c.to_openai() for c in plan.named(found))
            self._forward(event, origin)

        try:
            run(session, on_event)
            if calls:
                self.tool_calls.emit(ticket, calls)
        except PromptTooLongError as e:
            self.error.emit("too_long", str(e))
        except Exception as e:
            # The session keeps the chat as it was before this message and rebuilds the cache next turn.
            log.exception("a turn failed")
            self.error.emit("turn", str(e) if isinstance(e, EddyError) else f"Generation failed: {e!r}")
        finally:
            self._ticket = -1
            if force:
                session.settings = self._with_tools()

    def _forward(self, event: Event, origin: Origin) -> None:
        self._signals[type(event)].emit(event, origin)


class EngineHost(QObject):
    """Owns the worker thread; the GUI side's handle on the engine (every method returns at once)."""

    _load = Signal(int, str, object, object)  # seq, model, BuildSettings, ChatConfig (app/worker_payloads.py)
    _configure = Signal(object)  # ChatConfig
    _send = Signal(int, str)
    _regenerate = Signal(int)
    _answer_from = Signal(int, object, str)
    _tool_results = Signal(int, object)
    _switch = Signal(int, object)
    _count = Signal(int, str)
    _ping = Signal(int)
    _serve = Signal(object, object)
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
        self._answer_from.connect(self.worker.answer_from)
        self._tool_results.connect(self.worker.send_tool_results)
        self._switch.connect(self.worker.switch_chat)
        self._count.connect(self.worker.count)
        self._ping.connect(self.worker.ping)
        self._serve.connect(self.worker.serve)
        # Relayed through this GUI-thread object, so it arrives after the events queued before it.
        self.worker.pong.connect(self._on_pong)
        self._shutdown.connect(self.worker.shutdown)
        self.worker.finished.connect(self.thread.quit)
        self.thread.finished.connect(self.stopped)
        self._tickets = 0
        self._switches = 0
        self._counts = 0
        self._loads = 0
        self._shutting_down = False
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread.isRunning()

    def load(self, model: str, build: BuildSettings, chat: ChatConfig) -> None:
        self._loads += 1
        self._load.emit(self._loads, model, build, chat)

    def configure(self, chat: ChatConfig) -> None:
        self._configure.emit(chat)

    def send(self, text: str) -> int:
        self._tickets += 1
        self._send.emit(self._tickets, text)
        return self._tickets

    def regenerate(self) -> int:
        """Answers the last user message again (the engine's session holds the conversation)."""
        self._tickets += 1
        self._regenerate.emit(self._tickets)
        return self._tickets

    def answer_from(self, history: list[dict], text: str) -> int:
        """Answers `text` after `history`, a start of the conversation (an edited message's branch)."""
        self._tickets += 1
        self._answer_from.emit(self._tickets, history, text)
        return self._tickets

    def send_tool_results(self, results: list[dict]) -> int:
        """Answers after the tools' results (the calls of the last reply, each answered)."""
        self._tickets += 1
        self._tool_results.emit(self._tickets, results)
        return self._tickets

    @property
    def latest_switch(self) -> int:
        return self._switches

    def switch_chat(self, history: list[dict]) -> None:
        self._switches += 1
        self.worker.note_switch(self._switches)
        self._switch.emit(self._switches, history)

    def count(self, text: str) -> int:
        """Asks how many tokens `text` is; the worker's counted(seq, n) answers with the seq returned here."""
        self._counts += 1
        self._count.emit(self._counts, text)
        return self._counts

    def ping(self) -> None:
        """`idle` follows once the worker has handled every request sent before (tests wait on it)."""
        self._ping.emit(0)

    def serve(self, runner: object, job: object) -> None:
        """Any thread (the local server's HTTP thread): runs `job` on the worker after what is queued before."""
        self._serve.emit(runner, job)

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
