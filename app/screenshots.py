"""Takes the README screenshots from the real app (a developer tool, not used by the app itself).

    xvfb-run -a -s "-screen 0 1600x1000x24" python -m app.screenshots main-window|first-run|settings|alternatives|system-prompt|tools OUT.png [--model M]
    EDDY_CACHE_DIR=$(mktemp -d) xvfb-run -a -s "-screen 0 1600x1000x24" python -m app.screenshots first-run OUT.png

Under an X server (Xvfb) the picture is the screen's own pixels, so it shows what a user would see,
dialogs included; with QT_QPA_PLATFORM=offscreen it falls back to the widgets' own rendering.

main-window chats with the model until the cache has evicted tokens and grabs the window while the last
reply streams (and OUT-marker.png with the "left the window" marker in view); first-run starts with an empty artefact cache and grabs the window with the build dialog.
search writes a few chats, types a word into the Ctrl+K search and grabs it (OUT-open.png: the hit opened, its
message highlighted); document attaches a text of about six windows, grabs the draft with its token count
(OUT-draft.png), the progress bar while it streams in (OUT-reading.png) and the answered chat scrolled to the
note where the model's view of it begins (OUT). alternatives asks two questions, writes the last reply twice
more and switches back to the second of the three (‹ 2/3 ›), then grabs the window once the engine has that
branch in its cache. local-server switches the Local server on, chats once in the window, sends one request
with the openai client and grabs the window: the address in the status bar, the server's row in the stats panel.
details opens a stored chat with a reply holding two code blocks (each with its Copy button), sends a question,
and while the reply streams scrolls back up to the code as a reader would: the "Follow the reply" button shows,
and the tooltip of the code's reply (its time, tokens and tok/s) is up.
system-prompt saves two presets, picks one for a new chat (pinned in the sinks) and chats twice: the header at the
top of the chat and the cache bar's pinned segment. tools opens a stored reply's thinking and has the model call
the echo MCP server's add tool (OUT-card.png: the card asking to run; OUT: after it ran and the reply followed).
models opens the model picker over GGUFs placed where a Hugging Face cache and Ollama keep them, and a cut one.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QEvent, QPoint, QTimer
from PySide6.QtGui import QColor, QCursor, QGuiApplication, QHelpEvent, QPainter, QPalette, QPixmap
from PySide6.QtWidgets import QApplication, QStyleFactory

from .main import main
from .main_window import MainWindow
from .settings import AppSettings, save_settings
from .settings_dialog import SettingsDialog
from .store import Store, TurnRow

PROMPTS = [
    "Hi! Who are you?",
    "What is a KV cache in a language model? Answer in a short paragraph.",
    "Write a Python function that checks whether a word is a palindrome.",
    "Explain attention sinks in StreamingLLM to a new engineer.",
    "Give three tips for writing clear commit messages, as a list.",
    "What is the difference between a process and a thread?",
    "Summarise our conversation so far in two sentences.",
    "Suggest a name for a small chat app that runs models locally.",
    "How do I read a file line by line in Python? Show code.",
    "What are the benefits of running a model on my own machine?",
    "Write a haiku about caches.",
]


def _save(pixmap: QPixmap, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not pixmap.save(str(path)):
        raise SystemExit(f"could not write {path}")
    print(f"saved {path}", flush=True)


def _on_screen() -> bool:
    return QGuiApplication.platformName() != "offscreen"


def _snapshot(window: MainWindow) -> QPixmap:
    """The window as the screen shows it (an X server's pixels), or as it renders itself offscreen."""
    if not _on_screen():
        return window.grab()
    g = window.frameGeometry()
    return window.screen().grabWindow(0, g.x(), g.y(), g.width(), g.height())


def _composite(window: MainWindow, dialog) -> QPixmap:
    """The window with the dialog centred over it (offscreen platforms have no compositor to do it)."""
    shot = window.grab()
    over = dialog.grab()
    painter = QPainter(shot)
    painter.fillRect(shot.rect(), QColor(0, 0, 0, 60))  # the window dimmed behind the dialog
    at = QPoint((shot.width() - over.width()) // 2, (shot.height() - over.height()) // 3)
    for i in range(8, 0, -1):  # a soft shadow
        painter.fillRect(over.rect().translated(at).adjusted(-i, -i + 3, i, i + 3), QColor(0, 0, 0, 10))
    painter.drawPixmap(at, over)
    painter.setPen(QColor(0, 0, 0, 90))
    painter.drawRect(over.rect().translated(at).adjusted(-1, -1, 0, 0))
    painter.end()
    return shot


def dark_palette() -> QPalette:
    """A dark theme like a desktop's, to check the app follows the palette (set at run time)."""
    pal = QPalette()
    for role, colour in ((QPalette.ColorRole.Window, "#2b2b2b"), (QPalette.ColorRole.WindowText, "#e6e6e6"),
                         (QPalette.ColorRole.Base, "#1f1f1f"), (QPalette.ColorRole.AlternateBase, "#272727"),
                         (QPalette.ColorRole.Text, "#e6e6e6"), (QPalette.ColorRole.Button, "#353535"),
                         (QPalette.ColorRole.ButtonText, "#e6e6e6"), (QPalette.ColorRole.Highlight, "#3d8fe0"),
                         (QPalette.ColorRole.HighlightedText, "#ffffff"), (QPalette.ColorRole.Link, "#6fb0ff"),
                         (QPalette.ColorRole.PlaceholderText, "#8a8a8a"), (QPalette.ColorRole.ToolTipBase, "#353535"),
                         (QPalette.ColorRole.ToolTipText, "#e6e6e6")):
        pal.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, role, QColor("#7a7a7a"))
    return pal


def main_window(out: Path, model: str | None, max_turns: int, grab_after: int, dark: bool = False) -> int:
    """Chats until the cache has evicted tokens, then grabs the window while the next reply streams."""
    def drive(window: MainWindow) -> None:
        if dark:
            QApplication.setStyle(QStyleFactory.create("Fusion"))
            QApplication.setPalette(dark_palette())
        window.resize(1360, 860)
        c = window.controller
        state = {"sent": 0, "grab_turn": None, "grabbed": False}

        def grab() -> None:
            if not state["grabbed"]:
                state["grabbed"] = True
                window.chat_view.flush()
                QApplication.processEvents()  # paint the flushed text before the screen is read
                _save(_snapshot(window), out)
                # A second picture with the "left the window" marker in view ("Show where" in the panel).
                window.chat_view.scroll_to_marker()
                marker_out = out.with_name(out.stem + "-marker.png")

                def second() -> None:
                    _save(_snapshot(window), marker_out)
                    window.close()

                QTimer.singleShot(150, second)

        def send_next() -> None:
            if state["grabbed"]:
                return
            if state["grab_turn"] is None and (c.cache.evicted > 0 or state["sent"] >= max_turns - 1):
                state["grab_turn"] = state["sent"] + 1
            if state["grab_turn"] is not None and state["sent"] >= state["grab_turn"]:
                grab()  # the grab turn ended before enough tokens streamed: take it as it is
                return
            c.send(PROMPTS[state["sent"] % len(PROMPTS)])
            state["sent"] += 1

        def on_rate(_rate: float, tokens: int) -> None:
            if state["sent"] == state["grab_turn"] and tokens >= grab_after:
                grab()

        c.model_state_changed.connect(lambda s: s == "ready" and QTimer.singleShot(200, send_next))
        c.turn_finished.connect(lambda _ev: QTimer.singleShot(100, send_next))
        c.live_rate.connect(on_rate)
        QTimer.singleShot(15 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=220, seed=1))  # the app's chat defaults, repeatable
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


def first_run(out: Path, model: str) -> int:
    def drive(window: MainWindow) -> None:
        window.resize(1180, 760)

        def on_progress(stage: str, fraction: float) -> None:
            dialog = window.progress_dialog
            if dialog is not None and stage == "compiling" and fraction > 0.7 and not getattr(drive, "done", False):
                drive.done = True
                _save(_snapshot(window) if _on_screen() else _composite(window, dialog), out)
                window.controller.cancel_load()
                QTimer.singleShot(500, window.close)

        window.controller.load_progress.connect(on_progress)

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    return main(["--data-dir", str(data), "--model", model], on_window=drive)


def settings(out: Path, model: str | None) -> int:
    """The Settings dialog once the model has loaded: the defaults in force, one value of the user's own."""
    def drive(window: MainWindow) -> None:
        window.resize(1180, 760)

        def opened() -> None:
            dialog = next(w for w in QApplication.topLevelWidgets() if isinstance(w, SettingsDialog) and w.isVisible())

            def grab() -> None:
                _save(_snapshot(window) if _on_screen() else _composite(window, dialog), out)
                dialog.reject()
                QTimer.singleShot(300, window.close)

            QTimer.singleShot(800, grab)

        def ready(state: str) -> None:
            if state == "ready" and not getattr(drive, "done", False):
                drive.done = True
                QTimer.singleShot(300, opened)
                QTimer.singleShot(0, window.open_settings)  # modal: runs its own loop until grab() closes it

        window.controller.model_state_changed.connect(ready)

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(top_k=20))
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


SEARCH_CHATS = {
    "Trip to Lisbon": ["What should I see in Lisbon in two days?",
                       "Start in Alfama, take tram 28 up to the castle, and end the day at a miradouro.",
                       "Where can I hear fado?", "In Alfama and Mouraria: small taverns where fado is sung live."],
    "Sourdough starter": ["My starter smells of nail varnish. Is it dead?",
                          "No: it is hungry. Feed it more often, at a warmer spot, and the smell goes."],
    "Python packaging": ["How do I ship a Python app with its own interpreter?",
                         "Build a wheel, then bundle it with an embedded interpreter, e.g. in a Flatpak."],
}


def _stored_chats(data: Path) -> None:
    store = Store.open(data)
    for title, texts in SEARCH_CHATS.items():
        conv = store.create_conversation(title)
        for seq, text in enumerate(texts):
            store.append_message(conv, seq, "user" if seq % 2 == 0 else "assistant", text)
    store.close()


def search(out: Path, model: str | None, window_size: int | None) -> int:
    """The Ctrl+K search over stored chats, then the hit opened in its chat."""
    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)

        def typed() -> None:
            popup = window.search_popup
            popup.live.run()
            QTimer.singleShot(300, lambda: (_save(_snapshot(window), out), popup._open_current(),
                                            QTimer.singleShot(400, opened)))

        def opened() -> None:
            _save(_snapshot(window), out.with_name(out.stem + "-open.png"))
            window.close()

        def ready(state: str) -> None:
            if state == "ready" and not getattr(drive, "done", False):
                drive.done = True
                window.open_search()
                window.search_popup.field.setText("fado")
                QTimer.singleShot(300, typed)

        window.controller.model_state_changed.connect(ready)

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(**({"window": window_size} if window_size else {})))
    _stored_chats(data)
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


def document(out: Path, model: str | None, window_size: int | None) -> int:
    """A document of about six windows attached, counted, streamed in, answered; the cut-off note in view."""
    folder = Path(tempfile.mkdtemp(prefix="eddy-doc-"))

    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)
        c = window.controller
        state = {"reading": False}

        def ready(s: str) -> None:
            if s != "ready" or getattr(drive, "done", False):
                return
            drive.done = True
            w = c.model_info.window
            lines = [f"{i + 1}. Step {i + 1} of the procedure: check the valve, note the pressure, and log it."
                     for i in range(max(20, w * 6 // 20))]
            path = folder / "procedure.md"
            path.write_text("# Maintenance procedure\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
            window.attach_paths([path])
            window.compose.setPlainText("What is the last step?")
            c.draft.changed.connect(counted)

        def counted() -> None:
            if c.draft.tokens and not c.busy and not state.get("drafted"):
                state["drafted"] = True

                def shot() -> None:
                    _save(_snapshot(window), out.with_name(out.stem + "-draft.png"))
                    window.submit(window.compose.toPlainText())

                QTimer.singleShot(300, shot)  # the count painted first

        def reading(done: int, total: int) -> None:
            if not state["reading"] and done >= total // 2:
                state["reading"] = True
                QApplication.processEvents()
                _save(_snapshot(window), out.with_name(out.stem + "-reading.png"))

        def finished(_row) -> None:
            window.chat_view.flush()
            QApplication.processEvents()
            window.stats.context_label.linkActivated.emit("#marker")  # "Show where" in the panel
            QTimer.singleShot(300, lambda: (_save(_snapshot(window), out), window.close()))

        c.model_state_changed.connect(ready)
        c.reading.connect(reading)
        c.turn_finished.connect(finished)
        QTimer.singleShot(10 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=60, seed=1, **({"window": window_size} if window_size else {})))
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


def alternatives(out: Path, model: str | None) -> int:
    """A reply written three times, the second shown: its ‹ 2/3 › switcher, and the cache rebuilt for it."""
    questions = ["Hi! Who are you?", "Suggest a name for a small chat app that runs models locally."]

    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)
        c = window.controller
        state = {"turns": 0}

        def ready(s: str) -> None:
            if s == "ready" and not getattr(drive, "done", False):
                drive.done = True
                QTimer.singleShot(200, lambda: c.send(questions[0]))

        def finished(_row) -> None:
            state["turns"] += 1
            n = state["turns"]
            if n == 1:
                QTimer.singleShot(100, lambda: c.send(questions[1]))
            elif n in (2, 3):
                QTimer.singleShot(100, c.regenerate)
            else:
                QTimer.singleShot(100, switch)

        def switch() -> None:
            c.host.idle.connect(shot)
            c.switch_alternative(len(c.chat.messages) - 1, -1)
            c.host.ping()  # idle comes once the engine has followed the branch

        def shot() -> None:
            window.chat_view.flush()
            window.chat_view.scroll_to_bottom()
            QTimer.singleShot(300, lambda: (_save(_snapshot(window), out), window.close()))

        c.model_state_changed.connect(ready)
        c.turn_finished.connect(finished)
        QTimer.singleShot(10 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=90))  # sampled with a fresh seed: three different replies
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


def local_server(out: Path, model: str | None, build: dict[str, object]) -> int:
    """The Local server on: a window turn, then one request from the openai client, its own row in the stats."""
    import socket
    import threading

    with socket.socket() as probe:  # a free loopback port for this run
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)
        c = window.controller

        def ready(s: str) -> None:
            if s == "ready" and not getattr(drive, "done", False):
                drive.done = True
                QTimer.singleShot(200, lambda: c.send(PROMPTS[0]))

        def request() -> None:  # on a thread of its own: the window goes on painting meanwhile
            import openai

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            client.chat.completions.create(model=c.model_info.model, max_tokens=40, messages=[
                {"role": "system", "content": "You are a coding assistant in an editor."},
                {"role": "user", "content": "Write a one-line docstring for a function that adds two numbers."}])

        def finished(_row) -> None:
            threading.Thread(target=request, daemon=True).start()

        def served(_row) -> None:
            window.chat_view.flush()
            QTimer.singleShot(400, lambda: (_save(_snapshot(window), out), window.close()))

        c.model_state_changed.connect(ready)
        c.turn_finished.connect(finished)
        c.server_turn.connect(served)
        QTimer.singleShot(10 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=60, serve=True, server_port=port, **build))
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)

CODE_REPLY = """Here is a small function that ignores case and anything that is not a letter or a digit:

```python
def is_palindrome(word: str) -> bool:
    letters = [c.lower() for c in word if c.isalnum()]
    return letters == letters[::-1]
```

For example, `is_palindrome("Racecar")` is `True`. From a shell:

```bash
python -c 'from pal import is_palindrome; print(is_palindrome("level"))'
```"""

DETAILS_CHAT = [
    ("user", "Write a Python function that checks whether a word is a palindrome."),
    ("assistant", CODE_REPLY),
    ("user", "What is a KV cache in a language model? Answer in a short paragraph."),
    ("assistant", "A KV cache keeps the keys and values that attention computed for the tokens already read, so "
                  "each new token only computes its own instead of the whole conversation's again. It is why a "
                  "reply's second token comes much faster than the first.\n\nIts size grows with the "
                  "conversation, which is why Eddy keeps a window of recent tokens plus a few attention sinks."),
    ("user", "Explain attention sinks in StreamingLLM to a new engineer."),
    ("assistant", "The first few tokens of a sequence collect a large share of attention whatever they say: the "
                  "model uses them as a place to put attention it does not need elsewhere. Evict them and the "
                  "output falls apart; keep them (the sinks) with a sliding window of recent tokens and the model "
                  "keeps talking sensibly however long the chat grows."),
]


def details(out: Path, model: str | None) -> int:
    """A reply with code blocks and their Copy buttons, scrolled back to while the next reply streams (the
    scroll-to-bottom button shows), with the reply's tooltip (time, tokens, tok/s) up."""
    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)
        c = window.controller
        state = {"shot": False}

        def ready(s: str) -> None:
            if s == "ready" and not getattr(drive, "done", False):
                drive.done = True
                QTimer.singleShot(300, lambda: c.send("Give three tips for writing clear commit messages, as a list."))

        def on_rate(_rate: float, tokens: int) -> None:
            if tokens >= 25 and not state["shot"]:
                state["shot"] = True
                view = window.chat_view
                view.flush()
                reply = view.widgets[1]
                view.verticalScrollBar().setValue(max(0, reply.geometry().top() - 40))  # the reader scrolls up
                QTimer.singleShot(300, lambda: hover(reply))

        def hover(reply) -> None:
            # The pointer rests on the reply's text: Qt asks that view for a tooltip, as a real hover does.
            viewport = reply.body.viewport()
            at = QPoint(viewport.width() // 2, viewport.height() - 6)  # its last line: the tip falls below the code
            QCursor.setPos(viewport.mapToGlobal(at))

            def ask() -> None:  # once the pointer's own move and enter events are through (they hide tooltips)
                QApplication.sendEvent(viewport, QHelpEvent(QEvent.Type.ToolTip, at, viewport.mapToGlobal(at)))
                QTimer.singleShot(400, shot)

            QTimer.singleShot(400, ask)

        def shot() -> None:
            QApplication.processEvents()
            _save(_snapshot(window), out)
            c.stop()
            QTimer.singleShot(300, window.close)

        c.model_state_changed.connect(ready)
        c.live_rate.connect(on_rate)
        # Never hang a script, but leave a first start room to compile the default model (over ten minutes on a
        # busy two-core machine).
        QTimer.singleShot(30 * 60 * 1000, window.close)

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=300, seed=1))
    store = Store.open(data)
    conv = store.create_conversation("Palindromes, caches and sinks")
    ids = [store.append_message(conv, seq, role, text) for seq, (role, text) in enumerate(DETAILS_CHAT)]
    for i in (1, 3, 5):  # each reply's turn, as the app stores it: the tooltip shows its speed
        store.add_turn(conv, TurnRow("turn", 24 + i, 30.0 + i, 80 + 10 * i, 1800.0, 46.0 + i, "eos", message_id=ids[i]))
    store.close()
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


def system_prompt(out: Path, model: str | None, build: dict[str, object]) -> int:
    """A chat with its own system prompt, picked from a saved preset and pinned in the sinks: the header at the
    top of the chat, and the cache bar's pinned segment with the engine's count."""
    pirate = ("You are Captain Eddy, a friendly pirate. Answer every question in two short lines, in a pirate's "
              "voice, and never forget that you sail the seven seas.")

    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)
        c = window.controller
        state = {"turns": 0}

        def ready(s: str) -> None:
            if s == "ready" and not getattr(drive, "done", False):
                drive.done = True
                c.prompts.save_preset("Pirate captain", pirate)
                c.prompts.save_preset("Code reviewer", "You review Python code and point out bugs first.")
                c.prompts.pick("Pirate captain")
                QTimer.singleShot(300, lambda: c.send(PROMPTS[0]))

        def finished(_row) -> None:
            state["turns"] += 1
            if state["turns"] == 1:
                QTimer.singleShot(100, lambda: c.send(PROMPTS[3]))
            else:
                window.notice.hide()  # the build's "compiled and ready" is not what this shows
                window.chat_view.flush()
                QTimer.singleShot(400, lambda: (_save(_snapshot(window), out), window.close()))

        c.model_state_changed.connect(ready)
        c.turn_finished.connect(finished)
        QTimer.singleShot(10 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=50, pin_system=True, **build))
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


def models(out: Path, model: str | None) -> int:
    """The model picker open over the window: the built models, and GGUFs found where other apps keep them (a
    Hugging Face cache and an Ollama store made here with the default model's own file, and a cut one)."""
    import json
    import os

    from engine.checkpoint.source import default_gguf_path

    real = default_gguf_path()
    shop = Path(tempfile.mkdtemp(prefix="eddy-shot-stores-"))
    hub = shop / "hf" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF" / "snapshots" / "1"
    hub.mkdir(parents=True)
    os.symlink(real, hub / "SmolLM2-135M-Instruct.Q4_1.gguf")
    digest = "ab" * 32
    (shop / "ollama" / "blobs").mkdir(parents=True)
    os.symlink(real, shop / "ollama" / "blobs" / f"sha256-{digest}")
    manifest = shop / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}"}]}))
    (shop / "mine").mkdir()
    (shop / "mine" / "half-downloaded.gguf").write_bytes(real.read_bytes()[: 1 << 20])
    os.environ["HF_HUB_CACHE"] = str(shop / "hf" / "hub")
    os.environ["OLLAMA_MODELS"] = str(shop / "ollama")

    def drive(window: MainWindow) -> None:
        window.resize(1300, 820)
        window.catalog.folders = [shop / "mine"]

        def ready(state: str) -> None:
            if state == "ready" and not getattr(drive, "done", False):
                drive.done = True
                window.catalog.ready.connect(lambda *_: QTimer.singleShot(300, shown))
                window.refresh_models()

        def shown() -> None:
            picker = window.model_picker
            picker.showPopup()
            QTimer.singleShot(400, grab)

        def grab() -> None:
            picker = window.model_picker
            shot = window.grab()
            popup = picker.view().window()
            painter = QPainter(shot)
            painter.drawPixmap(picker.mapTo(window, QPoint(0, picker.height())), popup.grab())
            painter.end()
            picker.hidePopup()
            _save(shot, out)
            window.close()

        window.controller.model_state_changed.connect(ready)
        QTimer.singleShot(10 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(recent_models="tiny-random"))
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


THOUGHT = ("The user wants the sum of two numbers and has given me an add tool. Adding by hand would do, but "
           "the tool is exact and shows its work, so I will call it with a = 17 and b = 25 and report its answer.")


def tools(out: Path, model: str | None) -> int:
    """A reasoning reply's folded "Thinking" block (a stored chat: the default model does not think) opened, and
    a tool card from the echo MCP server of tests/: the call forced by the grammar, run, and the reply after it."""
    echo = Path(__file__).resolve().parents[1] / "tests" / "mcp_echo_server.py"

    def drive(window: MainWindow) -> None:
        window.resize(1300, 900)
        c = window.controller

        def ready(state: str) -> None:
            if state == "ready" and not getattr(drive, "done", False):
                drive.done = True
                QTimer.singleShot(1500, ask)  # the MCP server's tools are listed by then

        def ask() -> None:
            name = next(t["function"]["name"] for t in c.tools.tools() if t["function"]["name"].endswith("add"))
            c.tool_choice = {"type": "function", "function": {"name": name}}
            c.host.configure(c._chat_config())
            c.send("What is 17 + 25? Use the add tool.")

        def finished(_row) -> None:
            if c.chat.messages[-1].role == "assistant" and c.chat.messages[-2].role == "tool":
                window.chat_view.flush()
                window.chat_view.widget(1).thinking_toggle.setChecked(True)  # the stored reply's thinking, opened
                QTimer.singleShot(600, lambda: (_save(_snapshot(window), out), window.close()))

        def card() -> None:
            last = c.chat.messages[-1] if c.chat.messages else None
            if last is not None and last.role == "tool" and last.extra.get("state") == "asking":
                c.tool_choice = "auto"
                c.host.configure(c._chat_config())
                window.chat_view.flush()
                _save(_snapshot(window), out.with_name(out.stem + "-card.png"))
                c.tool_action(len(c.chat.messages) - 1, "run")

        c.model_state_changed.connect(ready)
        c.turn_finished.connect(finished)
        c.busy_changed.connect(lambda: QTimer.singleShot(300, card))
        QTimer.singleShot(10 * 60 * 1000, window.close)  # never hang a script

    data = Path(tempfile.mkdtemp(prefix="eddy-shot-"))
    save_settings(data, AppSettings.of(max_new_tokens=120))
    (data / "mcp.json").write_text(f'{{"mcpServers": {{"echo": {{"command": "{sys.executable}", '
                                   f'"args": ["{echo}"]}}}}}}')
    store = Store.open(data)
    conv = store.create_conversation("Adding with a tool")
    store.append_message(conv, 0, "user", "Can you add numbers for me?")
    store.append_message(conv, 1, "assistant", "Yes: give me two numbers and I will add them with the add tool.",
                         extra={"reasoning": THOUGHT, "thinking_ms": 2400})
    store.close()
    return main(["--data-dir", str(data)] + (["--model", model] if model else []), on_window=drive)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["main-window", "first-run", "settings", "search", "document", "alternatives",
                                    "local-server", "details", "system-prompt", "tools", "models"])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--max-turns", type=int, default=14)
    p.add_argument("--dark", action="store_true", help="use a dark palette")
    p.add_argument("--grab-after", type=int, default=30, help="tokens of the last reply before the grab")
    p.add_argument("--window", type=int, default=None, help="the cache window to build (search, document)")
    a = p.parse_args()
    if a.what == "search":
        sys.exit(search(a.out, a.model, a.window))
    if a.what == "document":
        sys.exit(document(a.out, a.model, a.window))
    if a.what == "alternatives":
        sys.exit(alternatives(a.out, a.model))
    if a.what == "local-server":
        sys.exit(local_server(a.out, a.model, {"window": a.window} if a.window else {}))
    if a.what == "details":
        sys.exit(details(a.out, a.model))
    if a.what == "system-prompt":
        sys.exit(system_prompt(a.out, a.model, {"window": a.window} if a.window else {}))
    if a.what == "models":
        sys.exit(models(a.out, a.model))
    if a.what == "tools":
        sys.exit(tools(a.out, a.model))
    if a.what == "main-window":
        sys.exit(main_window(a.out, a.model, a.max_turns, a.grab_after, a.dark))
    if a.what == "settings":
        sys.exit(settings(a.out, a.model))
    sys.exit(first_run(a.out, a.model or "tiny-random"))
