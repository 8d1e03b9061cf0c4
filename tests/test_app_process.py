"""The real app process (main() on qasync's loop): closing it while a reply streams exits cleanly."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from conftest_app import write_settings

ROOT = Path(__file__).resolve().parents[1]

# Drives the app as a user would: once the model is ready it sends a message, and once the reply streams
# it closes the window (or, with "signal", tells the test, which sends SIGTERM).
DRIVER = """
import sys
from app.main import main

how = sys.argv.pop(1)

def drive(window):
    c = window.controller
    c.model_state_changed.connect(lambda s: s == "ready" and c.send("Tell me a very long story"))
    def streaming(rate, tokens):
        if tokens >= 5 and not getattr(drive, "said", False):
            drive.said = True
            print("streaming", flush=True)
            if how == "close":
                window.close()
    c.live_rate.connect(streaming)

code = main(sys.argv[1:], on_window=drive)
print("torch imported:", "torch" in sys.modules, flush=True)
sys.exit(code)
"""


def run_app(data: Path, how: str, tiny) -> tuple[int, str, str]:
    write_settings(data, max_new_tokens=5000)  # a reply far longer than the test waits
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, how, "--model", "tiny-random", "--data-dir", str(data)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = ""
    if how == "signal":
        first = proc.stdout.readline()
        assert first.strip() == "streaming"
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, first + out, err


def check_clean_exit(data: Path, code: int, out: str, err: str) -> None:
    assert code == 0, err
    assert "QThread: Destroyed" not in err and "Traceback" not in err, err
    assert "streaming" in out
    assert "torch imported: False" in out  # a warm start runs without torch
    db = sqlite3.connect(data / "eddy.db")
    messages = db.execute("SELECT role, length(content) FROM messages ORDER BY seq").fetchall()
    turns = db.execute("SELECT kind, tokens, stop_reason FROM turns").fetchall()
    # The reply that was cut short was saved, with its statistics.
    assert [role for role, _ in messages] == ["user", "assistant"] and messages[1][1] > 0
    assert turns[-1][0] == "turn" and turns[-1][2] == "stopped" and 0 < turns[-1][1] < 5000


def test_closing_the_window_mid_reply_exits_cleanly(tmp_path, tiny):
    data = tmp_path / "data"
    check_clean_exit(data, *run_app(data, "close", tiny))


def test_sigterm_mid_reply_exits_cleanly(tmp_path, tiny):
    data = tmp_path / "data"
    check_clean_exit(data, *run_app(data, "signal", tiny))
