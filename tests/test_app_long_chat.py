"""A long chat in the view: it opens with its last bubbles and builds the older ones above them a slice at a time,
and a change of the model's window renders only the bubbles whose state changed."""
from __future__ import annotations

from app.chat_view import EAGER_MESSAGES, LAZY_FROM, ChatView
from app.models import ChatModel, Message
from engine.events import CacheStats, Context

N = 60


def _messages(n: int = N) -> list[Message]:
    return [Message("user" if i % 2 == 0 else "assistant",
                    f"Message {i}. " + "Some words to lay out over a few lines of the bubble. " * 6)
            for i in range(n)]


def _open(qtbot, messages: list[Message]) -> tuple[ChatModel, ChatView]:
    chat = ChatModel()
    view = ChatView(chat)
    qtbot.addWidget(view)
    view.resize(700, 500)
    view.show()
    chat.load(1, "Long", messages)
    return chat, view


def _context(n: int, forgotten: int) -> Context:
    spans = tuple((i * 10, i * 10 + 10) for i in range(n))
    return Context(first=0, spans=spans, left=tuple(range(forgotten)), cut=-1, system=(0, 0),
                   cache=CacheStats(sinks=4, window=100, capacity=104, used=104, evicted=forgotten * 10,
                                    position=n * 10))


def test_a_long_chat_opens_with_its_last_messages_and_builds_the_rest_above_them(qtbot):
    chat, view = _open(qtbot, _messages())
    # At once: only the last few, at the bottom of the view.
    assert view.top == N - EAGER_MESSAGES and len(view.widgets) == EAGER_MESSAGES
    assert view.widget(N - 1)._content.startswith(f"Message {N - 1}.") and view.widget(0) is None
    qtbot.waitUntil(lambda: view.top == 0, timeout=20_000)
    assert [w._content for w in view.widgets] == [m.content for m in chat.messages]
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.value() == bar.maximum() and bar.maximum() > 0, timeout=5_000)


def test_a_short_chat_is_built_at_once(qtbot):
    _, view = _open(qtbot, _messages(LAZY_FROM))
    assert view.top == 0 and len(view.widgets) == LAZY_FROM


def test_reading_above_while_older_bubbles_are_built_keeps_the_view_where_it_was(qtbot):
    chat, view = _open(qtbot, _messages())
    view._building.stop()  # paused while the user scrolls (on a quiet machine it is over in a blink)
    qtbot.waitUntil(lambda: view.verticalScrollBar().maximum() > 300, timeout=5_000)
    qtbot.wait(100)  # the last bubbles' heights settle once they are shown
    bar = view.verticalScrollBar()
    bar.setValue(bar.maximum() - 250)  # the user scrolls up a little, into the last messages
    read = next(w for w in view.widgets if w.geometry().bottom() >= bar.value())  # the bubble at the top
    y = read.mapTo(view.viewport(), read.rect().topLeft()).y()
    view._building.start()
    qtbot.waitUntil(lambda: view.top == 0, timeout=20_000)
    qtbot.wait(300)
    assert bar.value() > 0 and abs(read.mapTo(view.viewport(), read.rect().topLeft()).y() - y) <= 2


def test_a_hit_in_an_unbuilt_message_builds_it_and_the_marker_sits_where_the_engine_says(qtbot):
    chat, view = _open(qtbot, _messages())
    chat.apply_context(_context(N, forgotten=5))
    # The marker goes above message 5 once it is built; until then it is not shown at a wrong place.
    assert view.top > 5 and view.marker_index() == -1
    view.reveal(2)
    assert view.top == 0 and view.widget(2).flashing
    assert view.marker_index() == 5 and view.widget(4).forgotten and not view.widget(5).forgotten


def test_a_window_change_renders_again_only_what_changed(qtbot, monkeypatch):
    chat, view = _open(qtbot, _messages(20))
    chat.apply_context(_context(20, forgotten=0))
    laid_out: list[int] = []
    for i, w in enumerate(view.widgets):
        real = w.body.set_content
        monkeypatch.setattr(w.body, "set_content", lambda *a, i=i, real=real, **k: (laid_out.append(i), real(*a, **k)))
    chat.apply_context(_context(20, forgotten=3))  # three messages leave the window
    assert laid_out == [0, 1, 2] and view.marker_index() == 3
    laid_out.clear()
    chat.update(19, meta={"tokens": 7, "tok_s": 3.5}, span=(190, 200))  # a reply's stats arrive with its place
    assert laid_out == [19] and "7 tokens" in view.widget(19).meta.text()


def test_a_send_fills_bubbles_built_ahead_which_then_show_just_that_message(qtbot):
    chat, view = _open(qtbot, _messages(20))
    view.resize(700, 400)
    view.build_all()
    qtbot.waitUntil(lambda: set(view._spares) == {"user", "assistant"}, timeout=5_000)
    spares = dict(view._spares)
    assert not any(w.isVisible() for w in spares.values()) and not set(spares.values()) & set(view.widgets)
    built = len(view.widgets)
    passes: list[int] = []  # the bubbles there are after each pass that builds one
    view._tail.timeout.connect(lambda: passes.append(len(view.widgets)))
    chat.append(Message("user", "A new question, answered below."))
    chat.append(Message("assistant", "", streaming=True))
    # Not in the send's slot: a bubble a pass of the event loop, each one a spare built ahead, filled in.
    assert len(view.widgets) == built and view.widget(21) is None
    qtbot.waitUntil(lambda: len(view.widgets) == built + 2)
    assert passes == [built + 1, built + 2]
    assert view.widgets[-2:] == [spares["user"], spares["assistant"]]
    question, reply = view.widgets[-2:]
    assert question.body.toPlainText() == "A new question, answered below." and question.who.text() == "You"
    assert reply.who.text() == "Eddy" and reply.meta.text() == "writing…"
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: reply.isVisible() and bar.value() == bar.maximum(), timeout=5_000)
    # Laid out in the column, under the bubbles before them, as a bubble built for them would be.
    assert view.widgets[-3].geometry().bottom() < question.geometry().top() < reply.geometry().top()
    assert question.width() == view.widgets[-3].width() and not question.position.isVisible()
    # A new pair is built ahead for the next send; the ones in use stay.
    qtbot.waitUntil(lambda: len(view._spares) == 2, timeout=5_000)
    assert not set(view._spares.values()) & set(view.widgets)
