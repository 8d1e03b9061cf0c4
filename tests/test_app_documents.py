"""Documents in a message: what counts as text, and in the window a document longer than the window streaming
through it (progress, Cancel, the cut-off note), on the real compiled tiny-random module."""
from __future__ import annotations

import pytest

from conftest_app import TURN_TIMEOUT_MS, open_window, write_settings

from PySide6.QtCore import QMimeData, Qt, QUrl

from app.documents import MAX_DOCUMENT_BYTES, Document, DocumentError, as_message, read_document


def test_text_files_are_read_and_others_refused_with_a_reason(tmp_path):
    (tmp_path / "notes.md").write_text("# Notes\r\nsome *text*, ünïcödé\r\n", encoding="utf-8")
    doc = read_document(tmp_path / "notes.md")
    assert doc == Document("notes.md", "# Notes\nsome *text*, ünïcödé\n", doc.size)
    (tmp_path / "bom.csv").write_bytes("\ufeffa,b\n1,2\n".encode("utf-8"))
    assert read_document(tmp_path / "bom.csv").text == "a,b\n1,2\n"
    (tmp_path / "empty.txt").write_bytes(b"")
    assert read_document(tmp_path / "empty.txt").text == ""
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(DocumentError, match="“photo.png” is not a text file"):
        read_document(tmp_path / "photo.png")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DocumentError, match="not UTF-8 text"):
        read_document(tmp_path / "latin1.txt")
    with open(tmp_path / "huge.log", "wb") as f:
        f.truncate(MAX_DOCUMENT_BYTES + 1)  # sparse: refused by its size before a byte is read
    with pytest.raises(DocumentError, match=r"“huge.log” is 2.0 MB; Eddy attaches text files of up to 2.0 MB"):
        read_document(tmp_path / "huge.log")
    with pytest.raises(DocumentError, match="not a file"):
        read_document(tmp_path)
    with pytest.raises(DocumentError, match="Could not read|not a file"):
        read_document(tmp_path / "missing.txt")
    # The message: each document fenced under its name (a fence longer than any inside it), then the question.
    message = as_message([Document("a.py", "x = '```'\n", 10), Document("b.txt", "plain", 5)], "  Why?  ")
    assert message == "Document: a.py\n````py\nx = '```'\n````\n\nDocument: b.txt\n```txt\nplain\n```\n\nWhy?"


def test_the_reading_bar_keeps_its_width_as_the_counts_grow(qtbot):
    # Its minimum width must not grow with the numbers it shows (a narrow chat column would have to give way).
    from app.reading_bar import ReadingBar

    bar = ReadingBar()
    qtbot.addWidget(bar)
    bar.show_progress(0, 9)
    narrow = bar.minimumSizeHint().width()
    bar.show_progress(1_234_567, 9_876_543)
    assert bar.minimumSizeHint().width() == narrow
    assert bar.bar.text() == "1,234,567 of 9,876,543 tokens" and bar.isVisible()


def drop(window, path) -> None:
    """What a drop of a file from a file manager on the message box does."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    assert window.compose.canInsertFromMimeData(mime)
    window.compose.insertFromMimeData(mime)


@pytest.fixture
def window(qtbot, tmp_path, tiny):
    write_settings(tmp_path / "data")
    return open_window(qtbot, tmp_path / "data")


def test_a_document_five_windows_long_streams_through_and_is_answered(qtbot, window, tmp_path):
    c = window.controller
    lines = [f"Line {i:03}: the quick brown fox jumps over the lazy dog." for i in range(25)]
    path = tmp_path / "fox.txt"
    path.write_text("\n".join(lines) + "\n")
    drop(window, path)
    assert [d.name for d in c.draft.documents] == ["fox.txt"] and window.compose.toPlainText() == ""
    assert window.draft_bar.isVisible() and "fox.txt" in window.draft_bar.chip_buttons[0].text()
    qtbot.keyClicks(window.compose, "Which line comes last?")
    # Before sending: the engine counted the draft, and the bar says how much of it the model will see.
    qtbot.waitUntil(lambda: c.draft.tokens is not None and c.draft.tokens > 0, timeout=TURN_TIMEOUT_MS)
    window_size = c.model_info.window
    assert c.draft.tokens >= 5 * window_size
    summary = window.draft_bar.summary.text()
    assert f"Draft: {c.draft.tokens:,} tokens" in summary and f"only its last {window_size} tokens" in summary

    progress: list[tuple[int, int]] = []
    c.reading.connect(lambda done, total: progress.append((done, total)))
    shown: list[bool] = []
    c.reading.connect(lambda *_: shown.append(window.reading_bar.isVisible()))
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.compose, Qt.Key.Key_Return)
    done = blocker.args[0]
    assert done.tokens > 0 and done.stop_reason in ("eos", "length") and done.prefill_tokens > 5 * window_size
    # It streamed in chunks, each reported, and the bar showed it; it is gone now.
    assert len(progress) > 5 and all(a[0] < b[0] for a, b in zip(progress, progress[1:]))
    assert progress[-1][0] == progress[-1][1] == done.prefill_tokens and all(shown)
    assert not window.reading_bar.isVisible() and not c.draft.documents and not window.draft_bar.chip_buttons
    user, reply = c.chat.messages
    assert user.content == as_message([read_document(path)], "Which line comes last?") and reply.content
    assert [m.content for m in c.store.messages(c.chat.conversation_id)] == [user.content, reply.content]
    assert c.chat.title == "Which line comes last?"
    # Where the model's view begins: noted inside the message, with the text before it dimmed.
    window.chat_view.flush()
    seen, total = c.chat.seen_of(0)
    assert 0 < seen <= window_size < total
    widget = window.chat_view.widgets[0]
    assert "view begins about here" in widget.cut_note and f"last {seen:,} of this message's {total:,}" in widget.cut_note
    assert widget.cut_note in widget.body.toPlainText() and "sees the last" in widget.meta.text()
    before, after = widget.body.toPlainText().split(widget.cut_note)
    assert "Line 000" in before and "Which line comes last?" in after and "Line 024" in after
    # The panel says so too, and its "Show where" scrolls the note into view.
    assert "only the end of a long one" in window.stats.context_label.text()
    window.chat_view.scroll_to_bottom()
    window.stats.context_label.linkActivated.emit("#marker")
    bar = window.chat_view.verticalScrollBar()
    note_at = widget.geometry().top() + widget.cut_y()
    assert widget.cut_y() > 0 and bar.value() <= note_at < bar.value() + window.chat_view.viewport().height()


def test_cancel_mid_document_leaves_the_chat_usable_and_nothing_half_saved(qtbot, window, tmp_path):
    c = window.controller
    path = tmp_path / "long.md"
    path.write_text("word " * 3000)  # about fifty windows: reading it takes a while
    assert c.attach(path)
    with qtbot.waitSignal(c.reading, timeout=TURN_TIMEOUT_MS) as reading:
        assert c.send("Summarise it")
    total = reading.args[1]
    assert window.reading_bar.isVisible()
    with qtbot.waitSignal(c.turn_finished, timeout=TURN_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.reading_bar.cancel, Qt.MouseButton.LeftButton)
    done = blocker.args[0]
    assert done.stop_reason == "stopped" and done.tokens == 0
    assert 0 < done.prefill_tokens < total  # it stopped part-way through
    assert not c.busy and not window.reading_bar.isVisible()
    # The chat and the store agree: the whole message and an empty, stopped reply; nothing else.
    in_memory = [(m.role, m.content) for m in c.chat.messages]
    assert [r for r, _ in in_memory] == ["user", "assistant"] and in_memory[1][1] == ""
    assert in_memory[0][1].endswith("Summarise it") and "word " * 100 in in_memory[0][1]
    assert [(m.role, m.content) for m in c.store.messages(c.chat.conversation_id)] == in_memory
    assert c.chat.messages[1].meta["stop_reason"] == "stopped"
    # And the chat goes on: the next message is answered (the session rebuilt what fits).
    from conftest_app import send_text

    again = send_text(qtbot, window, "A short question")
    assert again.tokens > 0 and [m.role for m in c.chat.messages] == ["user", "assistant"] * 2
    assert [m.content for m in c.store.messages(c.chat.conversation_id)] == [m.content for m in c.chat.messages]


def test_binary_and_oversize_files_are_refused_in_the_window(qtbot, window, tmp_path):
    c = window.controller
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 10)
    drop(window, tmp_path / "image.png")
    assert not c.draft.documents and window.notice.isVisible() and window.notice.level == "error"
    assert "“image.png” is not a text file" in window.notice.label.text()
    with open(tmp_path / "big.txt", "wb") as f:
        f.truncate(3 * 1024 * 1024)
    window.attach_paths([tmp_path / "big.txt"])
    assert not c.draft.documents and "“big.txt” is 3.0 MB; Eddy attaches text files of up to 2.0 MB" in \
        window.notice.label.text()
    assert window.compose.toPlainText() == ""  # nothing was pasted as text either
    assert "2.0 MB" in window.attach_button.toolTip()
