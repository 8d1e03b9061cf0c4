"""`eddy-gui [--model M] [--data-dir DIR]` (and `python -m app`): the desktop app on qasync's event loop."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .main_window import MainWindow

APP_NAME = "Eddy"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eddy-gui", description="Eddy: chat with local language models.")
    p.add_argument("--model", default=None,
                   help="smollm2-135m-instruct (default), tiny-random, a .gguf file or a Hugging Face folder "
                        "(for this run; the settings keep their own choice)")
    p.add_argument("--data-dir", default=None, help="keep chats and settings in this folder")
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

    import qasync
    from PySide6.QtWidgets import QApplication, QMessageBox

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
        QMessageBox.critical(None, APP_NAME, f"Cannot use the data folder {data_dir}: {e.strerror or e}")
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
        QMessageBox.critical(None, APP_NAME, str(e))
        return 1
    _close_on_signals(window)
    if on_window is not None:
        on_window(window)
    with loop:
        loop.run_until_complete(_run(window))
    window.controller.host.wait()  # already ended on the normal path; a safety net otherwise
    return 0


async def _run(window: "MainWindow") -> None:
    """The app's life: show the window, then wait until it has stopped the engine and saved everything."""
    closed = asyncio.Event()
    window.closed.connect(closed.set)
    window.show()
    await closed.wait()


if __name__ == "__main__":
    sys.exit(main())
