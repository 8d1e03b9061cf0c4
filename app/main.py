"""`eddy-gui [--model M] [--data-dir DIR] [--ask TEXT]` (and `python -m app`): the desktop app on qasync's event loop.

`--ask TEXT` is the headless one-shot mode (packaging smoke tests, scripts): the real window, controller and
engine worker start (offscreen unless QT_QPA_PLATFORM says otherwise), TEXT is sent as the first message of
a new chat, the reply streams to stdout, and the app exits 0 — or 1 with the error on stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from engine.events import Token

    from .main_window import MainWindow
    from .store import TurnRow

APP_NAME = "Eddy"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eddy-gui", description="Eddy: chat with local language models.")
    p.add_argument("--model", default=None,
                   help="smollm2-135m-instruct (default), tiny-random, a .gguf file or a Hugging Face folder "
                        "(for this run; the settings keep their own choice)")
    p.add_argument("--data-dir", default=None, help="keep chats and settings in this folder")
    p.add_argument("--ask", metavar="TEXT", default=None,
                   help="headless: send TEXT in a new chat, print the reply on stdout and exit (1 on error). "
                        "Without --data-dir the chat goes to a temporary folder that is removed afterwards.")
    return p.parse_args(argv)


def default_data_dir() -> Path:
    from PySide6.QtCore import QStandardPaths

    return Path(QStandardPaths.writableLocation(QStandardPaths.StandardLocation.AppDataLocation))


def _setup_logging(data_dir: Path) -> None:
    # Problems go to a log file in the data folder; the window shows the user-facing message.
    handler = logging.FileHandler(data_dir / "eddy.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _close_on_signals(window: "MainWindow") -> None:
    """Ctrl+C in the terminal or SIGTERM from the session close the window the orderly way."""
    from PySide6.QtCore import QTimer

    def close(*_: object) -> None:
        QTimer.singleShot(0, window.close)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, close)
    # Python runs signal handlers only between bytecodes; this timer gives it a chance while Qt idles.
    wake = QTimer(window)
    wake.start(300)
    wake.timeout.connect(lambda: None)


def main(argv: Sequence[str] | None = None, on_window: Callable[["MainWindow"], None] | None = None) -> int:
    """Runs the app until its window has closed; `on_window` (for scripted runs) gets the window first."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ask = None
    temp_dir: str | None = None
    if args.ask is not None:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # no display needed
        if not args.data_dir:
            temp_dir = args.data_dir = tempfile.mkdtemp(prefix="eddy-ask-")
        ask = _ask_class()(args.ask)
    try:
        code = _main(args, on_window, ask)
    finally:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return ask.code if ask is not None and code == 0 else code


def _main(args: argparse.Namespace, on_window: Callable[["MainWindow"], None] | None, ask) -> int:
    problem = _platform_problem()
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 1
    import qasync
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "eddy-gui"])
    app.setApplicationName(APP_NAME)  # the data folder is then ~/.local/share/Eddy (or the OS's equivalent)
    app.setDesktopFileName("eddy")
    # The window decides when the app ends: after the engine thread stopped and the chat was saved.
    app.setQuitOnLastWindowClosed(False)

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        _setup_logging(data_dir)
    except OSError as e:
        _fatal(f"Cannot use the data folder {data_dir}: {e.strerror or e}", ask is not None)
        return 1

    from .icons import logo
    from .main_window import MainWindow
    from .store import StoreError

    app.setWindowIcon(logo())
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    try:
        window = MainWindow(data_dir, args.model)
    except StoreError as e:
        _fatal(str(e), ask is not None)
        return 1
    _close_on_signals(window)
    if ask is not None:
        ask.attach(window)
    if on_window is not None:
        on_window(window)
    with loop:
        loop.run_until_complete(_run(window))
    window.controller.host.wait()  # already ended on the normal path; a safety net otherwise
    return 0


def _platform_problem() -> str | None:
    """Missing X11 libraries or no screen, said before QApplication, where Qt would abort without naming them."""
    try:
        gui = sys.modules.get("PySide6.QtGui")
        if gui is not None and gui.QGuiApplication.instance() is not None:
            return None  # a platform is loaded already (an embedding script, a test): nothing left to check
        from .qt_check import startup_problem

        return startup_problem()
    except Exception:  # the check is a courtesy: if it breaks, Qt starts (or fails) as before
        return None


def _ask_class():
    """AskRun is a QObject (its slots then run on the GUI thread, in order); built once PySide6 is imported."""
    from PySide6.QtCore import QObject, Slot

    class AskRun(QObject):
        """--ask: sends one message once the model is ready, streams the reply to stdout, then closes the window."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text
            self.code = 1  # until a reply has finished
            self.sent = False
            self.first_token_s: float | None = None
            self.window: "MainWindow | None" = None

        def attach(self, window: "MainWindow") -> None:
            from PySide6.QtCore import Qt

            self.window = window
            c = window.controller
            c.model_state_changed.connect(self._on_state)
            c.notice.connect(self._on_notice)
            c.turn_finished.connect(self._on_finished)
            # The window's start-up notice about a damaged database was shown before this run was attached.
            if c.store.salvage is not None:
                print(f"eddy-gui: {c.store.salvage.level}: {c.store.salvage.notice()}", file=sys.stderr, flush=True)
            # Queued: printed on this (GUI) thread, in order, as the tokens arrive.
            c.host.worker.token.connect(self._on_token, Qt.ConnectionType.QueuedConnection)

        @Slot(str)
        def _on_state(self, state: str) -> None:
            c = self.window.controller
            if state == "ready" and not self.sent:
                self.sent = True
                c.new_chat()
                if not c.send(self.text):
                    self._fail("the message could not be sent")
            elif state == "failed":
                self._fail(None)  # the controller's notice, printed next, says why

        @Slot(str, str, str)
        def _on_notice(self, level: str, text: str, _action: str) -> None:
            print(f"eddy-gui: {level}: {text}", file=sys.stderr, flush=True)
            if level == "error":
                self._fail(None)

        @Slot(object, object)
        def _on_token(self, ev: Token, _origin: object) -> None:
            if self.first_token_s is None:
                self.first_token_s = seconds_since_process_start()
            sys.stdout.write(ev.text)
            sys.stdout.flush()

        @Slot(object)
        def _on_finished(self, turn: TurnRow) -> None:
            sys.stdout.write("\n")
            sys.stdout.flush()
            if self.first_token_s is not None:
                print(f"eddy-gui: first token {self.first_token_s:.2f} s after the process started; "
                      f"{turn.tokens} tokens", file=sys.stderr, flush=True)
            self.code = 0 if self.window.controller.chat.messages[-1].content.strip() else 1
            if self.code:
                print("eddy-gui: error: the reply was empty", file=sys.stderr, flush=True)
            self._close()

        def _fail(self, message: str | None) -> None:
            if message:
                print(f"eddy-gui: error: {message}", file=sys.stderr, flush=True)
            self.code = 1
            self._close()

        def _close(self) -> None:
            from PySide6.QtCore import QTimer

            window = self.window
            if window is not None and not window.is_closed:
                QTimer.singleShot(0, window.close)

    return AskRun


def seconds_since_process_start() -> float | None:
    """From /proc (10 ms resolution; psutil's create_time rounds the boot time to whole seconds)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _fatal(message: str, headless: bool) -> None:
    """A start-up failure: a dialog, or (--ask, where nobody could close one) a line on stderr."""
    if headless:
        print(f"eddy-gui: error: {message}", file=sys.stderr, flush=True)
        return
    from PySide6.QtWidgets import QMessageBox

    QMessageBox.critical(None, APP_NAME, message)


async def _run(window: "MainWindow") -> None:
    """The app's life: show the window, then wait until it has stopped the engine and saved everything."""
    closed = asyncio.Event()
    window.closed.connect(closed.set)
    window.show()
    await closed.wait()


if __name__ == "__main__":
    sys.exit(main())
