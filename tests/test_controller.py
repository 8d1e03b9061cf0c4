"""The controller on its own, handed an EngineHost stand-in: the engine's typed events go in, the models show
exactly what they say. No model is built; the engine's side of these events is tested in test_session.py and
the whole path in test_app_chat.py."""
from __future__ import annotations

import conftest_app  # noqa: F401  (headless Qt, pytest-qt present)
from PySide6.QtCore import QObject, Signal

from app.controller import ChatController
from app.worker import EngineWorker, Origin
from app.worker_payloads import ChatConfig, ModelInfo
from engine.config import BuildSettings
from engine.events import CacheStats, Context, DecodeProgress, Done, Prefill, Token


class RecordingHost(QObject):
    """EngineHost's interface without a thread or a model: requests are recorded; events come from a real
    (idle) EngineWorker's signals, emitted by the test."""

    stopped = Signal()
    idle = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.worker = EngineWorker()
        self.requests: list[tuple] = []
        self.tickets = 0
        self.latest_switch = 0
        self.running = True

    def _ticket(self, *request: object) -> int:
        self.tickets += 1
        self.requests.append(request)
        return self.tickets

    def load(self, *args: object) -> None:
        self.requests.append(("load",))

    def configure(self, chat: ChatConfig) -> None:
        self.requests.append(("configure",))

    def send(self, text: str) -> int:
        return self._ticket("send", text)

    def regenerate(self) -> int:
        return self._ticket("regenerate")

    def answer_from(self, history: list[dict], text: str) -> int:
        return self._ticket("answer_from", len(history), text)

    def switch_chat(self, history: list[dict]) -> None:
        self.latest_switch += 1
        self.requests.append(("switch", len(history)))

    def count(self, text: str) -> int:
        self.requests.append(("count", text))
        return len([r for r in self.requests if r[0] == "count"])

    def stop(self, ticket: int) -> None:
        self.requests.append(("stop", ticket))

    def cancel_load(self) -> None:
        pass

    def serve(self, runner: object, job: object) -> None:
        self.requests.append(("serve",))

    def shutdown(self) -> None:
        self.running = False
        self.stopped.emit()


def cache(position: int, evicted: int = 0) -> CacheStats:
    return CacheStats(4, 60, 64, min(position, 64), evicted, position)


def ready(qtbot, tmp_path) -> tuple[ChatController, RecordingHost]:
    host = RecordingHost()
    c = ChatController(tmp_path, host=host)
    c.start()
    host.worker.loaded.emit(ModelInfo("stand-in", "", BuildSettings(), window=0, device="cpu", seconds=0.0,
                                      built=False, cache=cache(0)))
    assert c.model_state == "ready" and host.requests[-1] == ("switch", 0)
    return c, host


def answer(host: RecordingHost, ticket: int, start: int, user: int, reply: list[str], first: int = 0,
           spans: tuple = (), left: tuple = (), cut: int = -1, evicted: int = 0) -> None:
    """What the session emits for one turn: the message's prefill and context, the tokens, context, done."""
    w, origin = host.worker, Origin(ticket=ticket)
    asked = (*spans, (start, start + user))
    w.prefill.emit(Prefill(user, 5.0, cache(start + user, evicted)), origin)
    w.context.emit(Context(first, asked, left, cut, (0, 0), cache(start + user, evicted)), origin)
    for piece in reply:
        w.token.emit(Token(piece), origin)
    w.decode_progress.emit(DecodeProgress(len(reply), 40.0), origin)
    end = start + user + len(reply)
    w.context.emit(Context(first, (*asked, (start + user, end)), left, cut, (0, 0), cache(end, evicted)), origin)
    w.done.emit(Done(len(reply), 25.0, 40.0, "eos", cache(end, evicted)), origin)


def test_a_turn_shows_what_the_engine_reported(qtbot, tmp_path):
    c, host = ready(qtbot, tmp_path)
    rates: list[tuple] = []
    c.live_rate.connect(lambda rate, n: rates.append((rate, n)))
    assert c.send("Hello") and host.requests[-1] == ("send", "Hello") and c.busy
    answer(host, 1, 0, 10, ["Hi", " there"])
    assert not c.busy and [(m.role, m.content) for m in c.chat.messages] == [("user", "Hello"), ("assistant", "Hi there")]
    assert [m.span for m in c.chat.messages] == [(0, 10), (10, 12)] and not any(m.pending for m in c.chat.messages)
    assert c.cache.position == 12 and rates[0] == (40.0, 2)
    row = c.store.turns(c.chat.conversation_id)[0]
    assert (row.prefill_tokens, row.tokens, row.tok_s, row.cache["position"]) == (10, 2, 40.0, 12)
    # Regenerate asks the engine's session, which holds the conversation: no history is sent. An edit sends
    # the messages before the one edited: the session goes back to there (or rebuilds) itself.
    assert c.regenerate() and host.requests[-1] == ("regenerate",)
    answer(host, 2, 0, 10, ["Hey"])
    assert c.edit_resend("Hello again") and host.requests[-1] == ("answer_from", 0, "Hello again")


def test_the_marker_follows_the_engine_and_stale_events_are_ignored(qtbot, tmp_path):
    c, host = ready(qtbot, tmp_path)
    for i in range(3):
        c.send(f"message {i}")
        spans = tuple((j * 20, j * 20 + 20) for j in range(2 * i))
        answer(host, i + 1, 40 * i, 10, ["x"] * 10, spans=spans)
    assert c.chat.forgotten() == 0
    # The engine says the first message left the window and the third is cut by the horizon.
    c.send("message 3")
    spans = tuple((j * 20, j * 20 + 20) for j in range(6))
    answer(host, 4, 120, 10, ["x"] * 10, spans=spans, left=(0, 1), cut=2, evicted=50)
    assert c.chat.forgotten() == 2 and c.chat.partly_forgotten(2) and not c.chat.partly_forgotten(3)
    assert c.chat.evicted == 50 and c.chat.sinks == 4
    # A rebuild for a chat opened since (an older switch) changes nothing; the latest one does.
    c.new_chat()
    stale = Origin(switch=host.latest_switch - 1)
    host.worker.context.emit(Context(3, ((0, 5),), (), -1, (0, 0), cache(5)), stale)
    assert c.chat.context is None and c.chat.forgotten() == 0
    host.worker.prefill.emit(Prefill(0, 0.0, cache(0)), Origin(switch=host.latest_switch))
    assert [r.kind for r in c.turns.rows] == []  # an empty chat's rebuild is no row
    # Events for a ticket other than the turn in progress are not this turn's.
    c.send("new chat")
    host.worker.token.emit(Token("late"), Origin(ticket=1))
    assert c.chat.messages[-1].content == ""


def test_the_draft_shows_the_latest_count_and_documents_go_into_the_message(qtbot, tmp_path):
    c, host = ready(qtbot, tmp_path)
    doc = tmp_path / "notes.txt"
    doc.write_text("alpha beta\n")
    assert c.attach(doc) and c.draft.tokens is None
    c.count_draft("What is it?")
    c.count_draft("What is it about?")
    assert host.requests[-1] == ("count", "Document: notes.txt\n```txt\nalpha beta\n```\n\nWhat is it about?")
    host.worker.counted.emit(1, 7)  # the answer for the older draft: not shown
    assert c.draft.tokens is None
    host.worker.counted.emit(2, 9)
    assert c.draft.tokens == 9
    assert c.send("What is it about?") and host.requests[-1][0] == "send" and "alpha beta" in host.requests[-1][1]
    assert c.chat.title == "What is it about?" and not c.draft.documents
    # A turn that fails gives the documents back to the draft and the question back to the input.
    restored: list[str] = []
    c.restore_input.connect(restored.append)
    host.worker.error.emit("turn", "it failed")
    assert [d.name for d in c.draft.documents] == ["notes.txt"] and restored == ["What is it about?"]


def contents(c: ChatController) -> list[str]:
    return [m.content for m in c.chat.messages]


def test_alternatives_switches_and_failures_keep_every_branch(qtbot, tmp_path):
    c, host = ready(qtbot, tmp_path)
    c.send("Hello")
    answer(host, 1, 0, 10, ["A"])
    assert c.regenerate()
    answer(host, 2, 0, 10, ["B"])
    assert contents(c) == ["Hello", "B"] and c.chat.alternatives(1) == (2, 2) and c.chat.alternatives(0) == (1, 1)
    # A regenerate that fails takes only its own reply away: the one shown before is back, and the engine
    # (whose session went back to before the question) is given that branch.
    assert c.regenerate()
    host.worker.error.emit("turn", "it failed")
    assert not c.busy and contents(c) == ["Hello", "B"] and c.chat.alternatives(1) == (2, 2)
    assert host.requests[-1] == ("switch", 2)
    # While a reply is being written nothing switches.
    c.send("More")
    notices: list[tuple] = []
    c.notice.connect(lambda *n: notices.append(n))
    assert not c.switch_alternative(1, -1) and not c.fork_chat(0)
    assert contents(c) == ["Hello", "B", "More", ""] and notices[0][0] == "info" and host.requests[-1][0] == "send"
    answer(host, 4, 12, 5, ["C"])
    # A switch is one engine request with the branch now shown; the branch under a reply comes back as left.
    assert c.switch_alternative(1, -1) and contents(c) == ["Hello", "A"] and host.requests[-1] == ("switch", 2)
    assert not c.switch_alternative(1, -1) and host.requests[-1] == ("switch", 2)  # nothing before the first
    assert c.switch_alternative(1, +1) and contents(c) == ["Hello", "B", "More", "C"]
    assert host.requests[-1] == ("switch", 4)
    conv = c.chat.conversation_id
    assert [m.content for m in c.store.messages(conv)] == contents(c)
    # A database that refuses writes: the chat stays whole in memory and is written later, every branch.
    c.store.conn.execute("PRAGMA query_only=ON")
    assert c.switch_alternative(1, -1)
    assert c.saves.pending == 1 and notices[-1][0] == "error" and "read-only" in notices[-1][1]
    assert c.edit_message(0, "Hi") and host.requests[-1] == ("answer_from", 0, "Hi")
    answer(host, 5, 0, 8, ["D"])
    assert contents(c) == ["Hi", "D"] and c.chat.alternatives(0) == (2, 2)
    c.store.conn.execute("PRAGMA query_only=OFF")
    assert c.retry_saves()
    assert sorted(m.content for m in c.store.tree(conv)) == ["A", "B", "C", "D", "Hello", "Hi", "More"]
    assert [m.content for m in c.store.messages(conv)] == ["Hi", "D"]
    # Reopened, each branch comes back as it was last shown.
    c.open_chat(conv)
    c.new_chat()
    c.open_chat(conv)
    assert contents(c) == ["Hi", "D"]
    assert c.switch_alternative(0, -1) and contents(c) == ["Hello", "A"]
    # A search hit in a branch not shown shows that branch, and reveals the message.
    revealed: list[int] = []
    c.message_revealed.connect(revealed.append)
    (hit,) = c.search("More")
    c.open_hit(hit)
    assert contents(c) == ["Hello", "B", "More", "C"] and revealed == [2] and host.requests[-1] == ("switch", 4)
    assert [m.content for m in c.store.messages(conv)] == contents(c)
