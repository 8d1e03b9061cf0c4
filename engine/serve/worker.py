"""The engine thread that requests queue on, in arrival order, one at a time.

JobRunner runs a job on the calling thread; EngineThread is `eddy serve`'s thread of its own that does, and
the desktop app runs the same jobs on its engine worker instead. HTTP handlers run on the asyncio loop; the model's session belongs to this thread. A job's events come back
to the loop through call_soon_threadsafe, so a handler awaits them without blocking other clients. Stopping a
job that has not started drops it; stopping the running one sets the session's stop flag, which the
generation loop reads before every token.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from ..events import Event
from ..run.session import ChatSession
from .conversations import ConversationPool

log = logging.getLogger(__name__)


class Job:
    """One request's work on the engine thread, seen from the asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, work: Callable[["JobRunner", Callable[[Event], None]], Any]):
        self.loop, self.work = loop, work
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.started = asyncio.Event()
        self.result: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()
        self.watcher: asyncio.Future | None = None  # the handler's task that stops it when its client leaves

    def emit(self, event: Event) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _call(self, fn: Callable, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: the server is going away, nobody is waiting
            pass

    def _settle(self, value: Any, error: BaseException | None) -> None:  # on the loop
        if self.result.done():
            return
        if error is not None:
            self.result.set_exception(error)
        else:
            self.result.set_result(value)


class JobRunner:
    """Runs jobs one at a time on whichever thread calls run(): the seam between the HTTP side and the engine.

    `eddy serve` runs them on its own EngineThread; the desktop app runs them on its engine worker's thread,
    between the window's turns (app/local_server.py). Either way the pool and the session belong to that one
    thread; submit() and stop() may be called from any thread."""

    def __init__(self, session: ChatSession, conversations: int = 4) -> None:
        self.session = session
        self.pool = ConversationPool(session, conversations)
        self._running: Job | None = None
        self._lock = threading.Lock()

    def submit(self, job: Job) -> Job:
        raise NotImplementedError

    @property
    def waiting(self) -> int:
        """Jobs submitted and not started yet (for /health)."""
        raise NotImplementedError

    def stop(self, job: Job) -> None:
        """Thread-safe: a queued job is dropped, the running one ends within one token."""
        job.cancelled.set()
        with self._lock:
            if self._running is job:
                self.session.stop()

    def run(self, job: Job) -> bool:
        """Runs one job on the calling thread (the engine's); False if it was dropped without running."""
        if job.cancelled.is_set():  # its client gave up before it started
            job._call(job.result.cancel)
            return False
        with self._lock:
            self._running = job
        job._call(job.started.set)
        try:
            value = job.work(self, self._stoppable(job))
            job._call(job._settle, value, None)
        except BaseException as e:  # reported to the handler, which answers the client
            if not isinstance(e, Exception):
                log.exception("engine job failed")
            job._call(job._settle, None, e)
        finally:
            with self._lock:
                self._running = None
        return True

    def _stoppable(self, job: Job) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            if job.cancelled.is_set():  # a stop that came before the session had cleared its flag
                self.session.stop()
            job.emit(event)
        return emit


class EngineThread(JobRunner):
    """`eddy serve`'s engine: a thread of its own that runs the jobs in arrival order."""

    def __init__(self, session: ChatSession, conversations: int = 4) -> None:
        super().__init__(session, conversations)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="eddy-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        self._jobs.put(job)
        return job

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def close(self, timeout: float = 10.0) -> None:
        """Ends the thread once the running job returns, and lets go of the model (its IREE context)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        self.pool = self.session = None  # type: ignore[assignment]

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.run(job)
