"""The app's side of big builds: the build dialog shows each stage's own progress (tensors written, the
compiler's time) and Cancel works while it does; Settings lists the model cache with sizes and deletes builds,
never the one the app has loaded."""
from __future__ import annotations

import shutil

import conftest_app  # noqa: F401  (headless Qt, pytest-qt)
from conftest_app import TURN_TIMEOUT_MS, open_window, write_settings
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

FAKE_KEY = "fedcba9876543210fedc"


def test_the_build_dialog_shows_the_stage_detail_and_drops_a_stale_one(qtbot):
    from app.progress_dialog import BuildProgressDialog

    dialog = BuildProgressDialog("tiny-random")
    qtbot.addWidget(dialog)
    dialog.set_progress("saving weights", 0.55)
    dialog.set_detail("saving weights", "tensor 7 of 14, 6.5 MB of 13 MB")
    assert dialog.detail.text() == "tensor 7 of 14, 6.5 MB of 13 MB"
    assert dialog.stage_labels["saving weights"].text().startswith("<b>▶")
    dialog.set_progress("compiling", 0.6)
    assert dialog.detail.text() == ""  # the weights' count no longer applies
    dialog.set_detail("saving weights", "tensor 14 of 14, 13 MB of 13 MB")  # late: the stage has moved on
    assert dialog.detail.text() == ""
    dialog.set_detail("compiling", "iree-compile running for 0:03 (about 0:08 expected)")
    assert "iree-compile" in dialog.detail.text()
    assert dialog.stage_labels["saving weights"].text().startswith("✓")


def test_a_first_build_shows_the_compile_in_the_dialog_and_cancels_there(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data, window=44)  # settings never built: the first start compiles
    window = open_window(qtbot, data, wait_ready=False)
    details: list[tuple[str, str]] = []
    window.controller.host.worker.progress_detail.connect(lambda s, d: details.append((s, d)))
    qtbot.waitUntil(lambda: window.progress_dialog is not None, timeout=TURN_TIMEOUT_MS)
    dialog = window.progress_dialog
    qtbot.waitUntil(lambda: dialog.stage == "compiling" and dialog.detail.text().startswith("iree-compile"),
                    timeout=180_000)
    assert any(s == "saving weights" and d.startswith("tensor ") for s, d in details)
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.controller.model_state == "failed", timeout=60_000)
    assert window.progress_dialog is None and "cancelled" in window.notice.label.text()


def test_settings_lists_the_model_cache_and_deletes_a_build_but_not_the_one_in_use(qtbot, tmp_path, tiny):
    from app.settings_dialog import SettingsDialog

    data = tmp_path / "data"
    write_settings(data)
    window = open_window(qtbot, data)  # loads the tiny entry: the one in use
    in_use = window.controller.model_info["folder"]
    spare = tiny.folder.parent / f"tiny-random-f32-4+60-{FAKE_KEY}"
    shutil.copytree(tiny.folder, spare)
    dialog = SettingsDialog(window.controller.settings, window)
    qtbot.addWidget(dialog)
    section = dialog.cache
    names = [e.name for e in section.entries]
    assert spare.name in names and tiny.folder.name in names
    assert section.tree.topLevelItemCount() == len(names)
    assert section.total.text().startswith(f"{len(names)} cached build")
    assert "MB in " in section.total.text() and str(spare.parent) in section.total.text()
    row = names.index(tiny.folder.name)
    item = section.tree.topLevelItem(row)
    assert str(tiny.folder) == in_use and item.text(1).endswith("MB")
    assert item.text(0) == "tiny-random (in use)\nf32, 4 sinks + 60 window, chunk 16, cpu"

    section.select(tiny.folder.name)
    assert not section.delete_button.isEnabled() and "In use" in section.note.text()

    section.select(spare.name)
    assert section.delete_button.isEnabled()
    answered: list[str] = []

    def answer_yes() -> None:
        box = section.confirm
        if box is None:
            QTimer.singleShot(20, answer_yes)
            return
        answered.append(box.text())
        box.button(QMessageBox.StandardButton.Yes).click()

    QTimer.singleShot(0, answer_yes)
    qtbot.mouseClick(section.delete_button, Qt.MouseButton.LeftButton)
    assert answered and "Delete the compiled tiny-random" in answered[0]
    qtbot.waitUntil(lambda: not spare.exists() and section._deleting is None, timeout=TURN_TIMEOUT_MS)
    assert spare.name not in [e.name for e in section.entries]
    assert tiny.folder.is_dir() and QApplication.activeModalWidget() is None
