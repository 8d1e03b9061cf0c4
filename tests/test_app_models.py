"""Issue 44, item 1: the model picker on the real window and the real tiny-random module. It lists a built model,
GGUFs found where other apps keep them (a Hugging Face hub cache and an Ollama store made here), and a file Eddy
cannot run, greyed with why; switching to another model (a server's, so nothing is built) keeps the chat; Ctrl+O
opens a model file."""
from __future__ import annotations

import json
import os

import conftest_app  # noqa: F401  (headless Qt, pytest-qt)
from conftest_app import LOAD_TIMEOUT_MS, open_window, send_text, write_settings
from conftest_tokenizer_helper import gguf_path
from PySide6.QtCore import Qt
from test_remote import server  # noqa: F401  (a real `eddy serve` on tiny-random, the remote model here)
from test_serve import KEY


def _stores(tmp_path, monkeypatch):
    real = gguf_path()
    hub = tmp_path / "hf" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF" / "snapshots" / "abc123"
    hub.mkdir(parents=True)
    os.symlink(real, hub / "smollm2-135m-instruct-q4_1.gguf")
    ollama = tmp_path / "ollama"
    digest = "0" * 63 + "1"
    (ollama / "blobs").mkdir(parents=True)
    os.symlink(real, ollama / "blobs" / f"sha256-{digest}")
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": real.stat().st_size}]}))
    extra = tmp_path / "mine"
    extra.mkdir()
    (extra / "cut.gguf").write_bytes(real.read_bytes()[: 1 << 20])  # a download that stopped at 1 MiB
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    return extra


def test_the_picker_lists_built_found_and_refused_models_and_a_switch_keeps_the_chat(qtbot, tmp_path, monkeypatch,
                                                                                      server):  # noqa: F811
    extra = _stores(tmp_path, monkeypatch)
    data = tmp_path / "data"
    write_settings(data, api_key=KEY, max_new_tokens=6, model_folders=str(extra))  # a folder of the user's own
    window = open_window(qtbot, data)
    c, picker = window.controller, window.model_picker
    qtbot.waitUntil(lambda: any(ch.label == "cut" for ch in picker.choices), timeout=30_000)
    by_label = {ch.label: ch for ch in picker.choices}
    assert by_label["tiny-random"].detail == "built" and picker.currentText().startswith("tiny-random")
    assert by_label["smollm2:135m"].runnable and "ollama" in by_label["smollm2:135m"].detail
    hf = [ch for ch in picker.choices if "hf-cache" in ch.detail]
    assert hf and hf[0].runnable and "llama" in hf[0].detail
    # Builds are kept per model name and content: this one is not built, and its first build is estimated from
    # what this machine's builds took.
    assert "first build about" in hf[0].detail and " min" in hf[0].detail
    cut = by_label["cut"]
    row = picker.choices.index(cut)
    assert not cut.runnable and cut.reason and not (picker.items.item(row).flags() & Qt.ItemFlag.ItemIsEnabled)

    send_text(qtbot, window, "Remember the word apple.")
    assert len(c.chat.messages) == 2
    c.switch_model(server)  # a model that needs no build: the chat stays and goes on with it
    qtbot.waitUntil(lambda: c.model_state == "ready" and c.model_info is not None and c.model_info.remote, timeout=LOAD_TIMEOUT_MS)
    assert [m.role for m in c.chat.messages] == ["user", "assistant"]
    send_text(qtbot, window, "Which word?")
    assert len(c.chat.messages) == 4 and c.chat.messages[-1].extra["model"] == "tiny-random"
    assert c.settings.recent_models.split("|")[:2] == [server, "tiny-random"]  # listed first next time

    # Ctrl+O: the file chosen is the model now; one that cannot run says why, and the chat is still there.
    monkeypatch.setattr("app.main_window.QFileDialog.getOpenFileName", lambda *a, **k: (str(extra / "cut.gguf"), ""))
    notices = []
    c.notice.connect(lambda kind, text, action: notices.append(text))
    qtbot.keyClick(window, Qt.Key.Key_O, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: c.model_state == "failed", timeout=LOAD_TIMEOUT_MS)
    assert c.settings.model == str(extra / "cut.gguf") and any("truncated" in n for n in notices)
    c.switch_model("tiny-random")
    qtbot.waitUntil(lambda: c.model_state == "ready", timeout=LOAD_TIMEOUT_MS)
    assert len(c.chat.messages) == 4

    # A .gguf dropped on the window is the model now too (the cut one again: it says why it cannot run).
    from PySide6.QtCore import QMimeData, QPointF, QUrl
    from PySide6.QtGui import QDropEvent

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(extra / "cut.gguf"))])
    window.dropEvent(QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                                Qt.KeyboardModifier.NoModifier))
    qtbot.waitUntil(lambda: c.model_state == "failed", timeout=LOAD_TIMEOUT_MS)
    assert c.settings.model == str(extra / "cut.gguf")


def test_a_model_whose_shape_is_built_offers_a_build_of_its_weights_only():
    """A fine-tune of a model built here builds by taking that module (engine.artefacts.store.takes_a_built_module,
    tests/test_build_process.py): the picker says so, with the time its weights take, where another model gets the
    whole build's estimate."""
    from pathlib import Path

    from app.model_picker import BuildTimes, choices
    from engine.discover import FoundModel

    times = BuildTimes(fixed_s=60.0, per_byte_s=1e-8)
    found = [FoundModel(Path(f"/models/{n}.gguf"), "folder", n, "llama", 800_000_000, "Q4_K_M", "1.2B", True)
             for n in ("tuned", "other")]
    detail = {c.label: c.detail for c in choices([], [], found, "", set(), times, {"/models/tuned.gguf"})}
    assert "weights only, about 13 s" in detail["tuned"] and "first build" not in detail["tuned"]
    assert "first build about 1 min" in detail["other"]
