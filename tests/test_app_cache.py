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


def test_the_build_dialog_shows_the_stages_running_side_by_side_and_the_time_left(qtbot):
    from app.progress_dialog import BuildProgressDialog

    dialog = BuildProgressDialog("tiny-random")
    qtbot.addWidget(dialog)
    dialog.set_progress("exporting", 0.1)
    dialog.set_detail("exporting", "tracing 16 layers")
    dialog.set_progress("saving weights", 0.2)
    dialog.set_detail("saving weights", "tensor 7 of 14, 6.5 MB of 13 MB")
    # The weights are written while the export runs: both lines are running, both stages' words show.
    assert dialog.stage_labels["exporting"].text().startswith("<b>▶")
    assert dialog.stage_labels["saving weights"].text().startswith("<b>▶")
    assert dialog.stage_labels["loading weights"].text().startswith("✓")
    assert dialog.stage_labels["compiling"].text().startswith("○")
    assert dialog.detail.text() == "tracing 16 layers · tensor 7 of 14, 6.5 MB of 13 MB"
    dialog.set_detail("exporting", "done in 0:17")
    dialog.set_progress("compiling", 0.6)
    dialog.set_detail("compiling", "iree-compile running for 0:03 (about 0:08 expected)")
    assert dialog.stage_labels["exporting"].text() == "✓  Exporting the StreamingLLM graph (0:17)"
    assert dialog.detail.text() == "tensor 7 of 14, 6.5 MB of 13 MB · iree-compile running for 0:03 (about 0:08 expected)"
    dialog.set_progress("saving weights", 0.5)  # a late report with a smaller fraction: the bar never goes back
    assert dialog.bar.value() == 600
    dialog._started -= 30  # 30 s in at 60 %: 20 s left
    dialog._show_elapsed()
    assert dialog.elapsed.text() == "0:30 elapsed · about 0:20 left"


def test_a_first_build_shows_the_compile_in_the_dialog_and_cancels_there(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data, window=44)  # settings never built: the first start compiles
    window = open_window(qtbot, data, wait_ready=False)
    details: list[tuple[str, str]] = []
    window.controller.host.worker.progress_detail.connect(lambda s, d: details.append((s, d)))
    qtbot.waitUntil(lambda: window.progress_dialog is not None, timeout=TURN_TIMEOUT_MS)
    dialog = window.progress_dialog
    # The weights file is written beside the export and the compiler: its tensors may be counted before the
    # compiler starts or while it runs.
    qtbot.waitUntil(lambda: "compiling" in dialog.started_stages and "compiling" not in dialog.finished_stages
                    and "iree-compile" in dialog.detail.text()
                    and any(s == "saving weights" and d.startswith("tensor ") for s, d in details), timeout=180_000)
    qtbot.mouseClick(dialog.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.controller.model_state == "failed", timeout=60_000)
    assert window.progress_dialog is None and "cancelled" in window.notice.label.text()


def test_settings_lists_the_model_cache_and_deletes_a_build_but_not_the_one_in_use(qtbot, tmp_path, tiny):
    from app.settings_dialog import SettingsDialog

    data = tmp_path / "data"
    write_settings(data)
    window = open_window(qtbot, data)  # loads the tiny entry: the one in use
    in_use = window.controller.model_info.folder
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
