"""The desktop app's local server: `eddy serve`'s HTTP side (engine/serve/app.py) over the window's own engine.

One engine, the app's. Each request's job runs on the app's engine worker thread (app/worker.py), queued with
the window's turns in arrival order. Around each job the window's conversation is snapshotted and put back
(ChatSession.snapshot/restore), so the window's chat goes on with no rebuild, and the server's own
conversations wait in its ConversationPool as snapshots (pool.park), so they keep their reuse too.

uvicorn runs in a Python thread of its own, with its own asyncio loop, on a socket bound here first: a port in
use is refused at once with the reason, before anything starts. Loopback only.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from PySide6.QtCore import QObject, Signal

from engine.events import CacheStats, Done, Event, Prefill
from engine.run.generation import ChatDefaults
from engine.run.session import ChatSession
from engine.serve.listen import listen
from engine.serve.protocol import APIError
from engine.serve.worker import Job, JobRunner

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # never another interface: the app offers no non-loopback host
CONVERSATIONS = 4   # client conversations whose caches are kept between requests (as `eddy serve`'s default)


@dataclass(frozen=True)
class ServedTurn:
    """What one request did, for the stats panel: its own figures, then the window's cache put back."""
    prefill: Prefill | None  # None: it ended before its prompt went in (stopped, or refused)
    done: Done | None
    window_cache: CacheStats  # the engine's stats once the window's conversation is back in it


@dataclass(frozen=True)
class ServerConfig:
    """Everything a running server was started with: a change to any of it restarts the server."""
    port: int
    key: str
    model_id: str
    defaults: ChatDefaults
    pin_system: bool
    max_tokens: int

    @property
    def address(self) -> str:
        return f"http://{HOST}:{self.port}/v1"


class WorkerRunner(JobRunner):
    """Runs the server's jobs on the app's engine worker thread, each between the window's turns.

    `post(runner, job)` hands a job to the worker thread (EngineHost.serve: a queued signal, so it lines up
    with the window's requests); the worker calls run_between(job) there. `on_start` and `on_done` are called on
    the worker thread (the LocalServer's signals, queued on to the GUI)."""

    def __init__(self, session: ChatSession, post: Callable[["WorkerRunner", Job | None], None],
                 on_start: Callable[[], None], on_done: Callable[[ServedTurn], None]) -> None:
        super().__init__(session, CONVERSATIONS)
        self._post, self._on_start, self._on_done = post, on_start, on_done
        self._pending: set[Job] = set()  # submitted and not finished (closing stops them all)
        self._closed = False
        self._prefill: Prefill | None = None
        self._done: Done | None = None

    # --- any thread ------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._closed:
                raise APIError(503, "the local server is stopping", kind="server_error",
                               headers={"Retry-After": "5"})
            self._pending.add(job)
        self._post(self, job)
        return job

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._pending) - (self._running is not None)

    def close(self) -> None:
        """Stops the running job within one token and drops the queued ones; the worker lets go of the model's
        session once it reaches this point of its queue (before a model load queued after it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        for job in pending:
            self.stop(job)
        self._post(self, None)

    # --- the engine worker's thread --------------------------------------------------------------------------

    def run_between(self, job: Job | None) -> None:
        """One server job with the window's conversation set aside and put back, exactly as it was."""
        if job is None:  # close() got here: nothing of the server is left to run on this session
            self.pool = self.session = None  # type: ignore[assignment]
            return
        try:
            session = self.session
            if job.cancelled.is_set() or session is None:
                if session is None:
                    job.cancelled.set()
                self.run(job)  # drops it: its client went away, or the server is stopping
                return
            window, window_settings = session.snapshot(), session.settings
            self._prefill = self._done = None
            self._on_start()
            try:
                self.run(job)
            finally:
                # The server's conversation waits in the pool as a snapshot; the window's goes back in, so
                # its next turn prefills only its own new tokens.
                self.pool.park()
                session.restore(window)
                session.settings = window_settings
                self._on_done(ServedTurn(self._prefill, self._done, session.engine.stats))
        finally:
            with self._lock:
                self._pending.discard(job)

    def _stoppable(self, job: Job) -> Callable[[Event], None]:
        emit = super()._stoppable(job)

        def recorded(event: Event) -> None:
            if isinstance(event, Prefill) and self._prefill is None:  # the request's own prompt
                self._prefill = event
            elif isinstance(event, Done):
                self._done = event
            emit(event)
        return recorded


class LocalServer(QObject):
    """Starts and stops uvicorn over a WorkerRunner; every method returns at once (the GUI never waits)."""

    request_started = Signal()       # a request's job began on the engine thread
    request_done = Signal(object)    # its ServedTurn
    stopped = Signal(str)            # the HTTP thread has ended and the port is free; "" or what went wrong
    # Relays from the engine and HTTP threads to this (GUI) thread.
    _thread_ended = Signal(str)

    def __init__(self, post: Callable[[WorkerRunner, Job | None], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._post = post
        self.config: ServerConfig | None = None
        self.runner: WorkerRunner | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._thread_ended.connect(self._on_thread_ended)

    @property
    def running(self) -> bool:
        """Until the HTTP thread has ended (stopping, it still holds the port)."""
        return self._thread is not None

    @property
    def address(self) -> str | None:
        """Where clients reach it, while it serves (None once asked to stop)."""
        return self.config.address if self.config is not None else None

    def start(self, session: ChatSession, config: ServerConfig) -> None:
        """Binds the port and starts serving; raises OSError with the reason for the user if it cannot."""
        import uvicorn

        from engine.serve.app import ServerSettings, create_app

        if self.running:
            raise RuntimeError("the local server is already running")
        sock = listen(HOST, config.port)
        runner = WorkerRunner(session, self._post, self.request_started.emit, self.request_done.emit)
        settings = ServerSettings(config.model_id, config.key or None, config.defaults, config.pin_system,
                                  config.max_tokens, queue_timeout=120.0)
        app = create_app(runner, settings)
        # A short graceful shutdown: a stopped job ends within one token, and nobody waits on a quitting app.
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop="asyncio", lifespan="off",
                                               timeout_graceful_shutdown=3))
        self.config, self.runner, self._server = config, runner, server

        def serve() -> None:
            problem = ""
            try:
                server.run(sockets=[sock])
            except BaseException as e:  # SystemExit too: uvicorn exits on a failed start-up
                problem = f"the local server stopped: {e!r}"
                log.exception("the local server failed")
            finally:
                sock.close()
            if not problem and not server.started:
                problem = "the local server could not start"
            self._thread_ended.emit(problem)

        self._thread = threading.Thread(target=serve, name="eddy-local-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Asks it to stop: requests in progress end within a token, and `stopped` follows once the port is free."""
        if self.runner is not None:
            self.runner.close()
        if self._server is not None:
            self._server.should_exit = True
        self.config = None

    def _on_thread_ended(self, problem: str) -> None:
        if self.runner is not None:
            self.runner.close()  # it ended on its own: nothing may still be queued for it on the engine
        self._thread = self._server = self.runner = None
        self.config = None
        self.stopped.emit(problem)
