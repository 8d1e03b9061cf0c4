"""The chat list and the open chat stay together: a message sent in a chat that is not at the top of the list
goes to that chat (which moves to the top, still selected), on the real compiled tiny-random module."""
from __future__ import annotations

from conftest_app import open_window, send_text, wait_idle, write_settings

from app.models import ConversationListModel
from app.store import Store


def test_a_message_sent_in_an_older_chat_stays_in_it_and_moves_it_to_the_top(qtbot, tmp_path, tiny):
    data = tmp_path / "data"
    write_settings(data)
    store = Store.open(data)
    older = store.create_conversation("Older chat")
    store.append_message(older, 0, "user", "About apples")
    store.append_message(older, 1, "assistant", "Apples are fruit.")
    newer = store.create_conversation("Newer chat")  # the most recent: the window opens with it
    store.append_message(newer, 0, "user", "About bananas")
    store.append_message(newer, 1, "assistant", "Bananas are fruit too.")
    store.close()
    window = open_window(qtbot, data)
    c = window.controller
    assert c.chat.conversation_id == newer and [r.id for r in c.conversations.rows] == [newer, older]

    # Open the older chat from the list, as a click on it does.
    window.chat_list.setCurrentIndex(window.proxy.index(1, 0))
    assert c.chat.conversation_id == older
    wait_idle(qtbot, window)
    opened: list[bool] = []
    c.conversation_opened.connect(lambda: opened.append(True))

    send_text(qtbot, window, "And pears?")
    # Still the older chat, with the message and its reply; the newer one untouched; no other chat was opened.
    assert c.chat.conversation_id == older and not opened
    assert [m.content for m in c.chat.messages][:3] == ["About apples", "Apples are fruit.", "And pears?"]
    assert [m.content for m in c.store.messages(older)][:3] == ["About apples", "Apples are fruit.", "And pears?"]
    assert len(c.store.messages(older)) == 4 and len(c.store.messages(newer)) == 2
    # It moved to the top of the list and is still the one selected there.
    assert [r.id for r in c.conversations.rows] == [older, newer]
    assert window.proxy.data(window.chat_list.currentIndex(), ConversationListModel.IdRole) == older
