"""Helpers for the desktop-app tests: a real MainWindow on the compiled tiny-random module, headless.

Imported by the tests/test_app*.py modules (not a conftest of its own, so the shared conftest stays as is).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Headless by default (CI has no display); an explicit QT_QPA_PLATFORM wins.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from conftest import TINY_SETTINGS  # noqa: E402

LOAD_TIMEOUT_MS = 120_000  # the first window may have to compile tiny-random (~30 s on 2 cores)
TURN_TIMEOUT_MS = 30_000


def write_settings(data_dir: Path, **overrides: object) -> None:
    """settings.ini with the tests' build settings, so every window reuses the one compiled module."""
    # Plain greedy decoding (as chosen by a user) keeps replies repeatable from run to run.
    values = {"settings_version": 2, "sinks": TINY_SETTINGS.sinks, "window": TINY_SETTINGS.window,
              "dtype": TINY_SETTINGS.dtype, "device": TINY_SETTINGS.device, "max_chunk": TINY_SETTINGS.max_chunk,
              "max_new_tokens": 20, "temperature": 0.0, "repeat_penalty": 1.0}
    values.update(overrides)
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = ["[General]"] + [f"{k}={v}" for k, v in values.items()]
    (data_dir / "settings.ini").write_text("\n".join(lines) + "\n")


def open_window(qtbot, data_dir: Path, model: str = "tiny-random", wait_ready: bool = True):
    from app.main_window import MainWindow

    window = MainWindow(data_dir, model)
    qtbot.addWidget(window, before_close_func=lambda w: close_window(qtbot, w))
    window.show()
    if wait_ready:
        qtbot.waitUntil(lambda: window.controller.model_state in ("ready", "failed"), timeout=LOAD_TIMEOUT_MS)
        assert window.controller.model_state == "ready", window.notice.label.text()
        wait_idle(qtbot, window)
    return window


def wait_idle(qtbot, window) -> None:
    """Until the engine thread has handled everything queued so far (e.g. a chat's cache rebuild) and the
    GUI has seen every event it sent before that."""
    host = window.controller.host
    with qtbot.waitSignal(host.idle, timeout=TURN_TIMEOUT_MS):
        host.ping()


def close_window(qtbot, window) -> None:
    if not window.is_closed:
        with qtbot.waitSignal(window.closed, timeout=TURN_TIMEOUT_MS):
            window.close()
    assert not window.controller.host.running


def send_text(qtbot, window, text: str):
    """Types `text` into the input, presses Enter and waits for the reply to finish; returns its TurnRow."""
    from PySide6.QtCore import Qt

    window.compose.setFocus()
    qtbot.keyClicks(window.compose, text)
    with qtbot.waitSignal(window.controller.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    return blocker.args[0]


def last_reply(window) -> str:
    return window.controller.chat.messages[-1].content
