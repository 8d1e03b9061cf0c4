"""`eddy serve` on the real compiled tiny-random module, over real HTTP on a free loopback port: the official
`openai` client for the API, raw HTTP for the bad inputs."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, TINY_SETTINGS

openai = pytest.importorskip("openai")
KEY = "test-key"


class Served:
    def __init__(self, engine, server, thread, port: int) -> None:
        self.engine, self.server, self.thread, self.port = engine, server, thread, port
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            auth: bool = True) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {KEY}"} if auth else {}), **(headers or {})}
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else {}

    def idle(self) -> None:
        """Until the engine thread has nothing running or queued."""
        deadline = time.monotonic() + 30
        while (self.engine._running is not None or self.engine.waiting) and time.monotonic() < deadline:
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(session, conversations: int = 3, **settings) -> Served:
    """A real `eddy serve` app over `session` on a free loopback port, on a thread of its own; stop() ends it."""
    import uvicorn

    from engine.serve.app import ServerSettings, create_app
    from engine.serve.worker import EngineThread

    engine = EngineThread(session, conversations=conversations)
    app = create_app(engine, ServerSettings("tiny-random", KEY, **settings))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return Served(engine, server, thread, port)


def stop(served: Served) -> None:
    served.server.should_exit = True
    served.thread.join(10)
    served.engine.close()


@pytest.fixture(scope="module")
def served(tiny):
    from engine.loader import open_model

    model = open_model("tiny-random", TINY_SETTINGS)  # its own engine: other tests' turns never touch its cache
    s = serve(model.chat(), defaults=model.chat_defaults, max_tokens=8, queue_timeout=2.0, body_limit=1024 * 1024,
              read_timeout=2.0)
    yield s
    stop(s)


def ask(served: Served, messages: list[dict], **kw) -> dict:
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return served.client.chat.completions.create(model="tiny-random", messages=messages, **kw).to_dict()


def test_models_health_and_a_reply_streamed_or_not(served):
    assert [m.id for m in served.client.models.list()] == ["tiny-random"]
    status, _, health = served.raw("GET", "/health", auth=False)
    assert status == 200 and health["status"] == "ok"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]
    whole = ask(served, messages, max_tokens=6)
    choice = whole["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    t = whole["timings"]
    assert t["prompt_n"] > 0 and t["predicted_n"] == whole["usage"]["completion_tokens"] > 0
    assert whole["usage"]["prompt_tokens"] == t["cache_n"] + t["prompt_n"]
    assert set(t["cache"]) == {"sinks", "window", "capacity", "used", "evicted", "position", "pinned"}
    # The same request streamed: the same greedy text, piece by piece, the timings in the last chunk.
    stream = served.client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=6,
                                                   temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [c.to_dict() for c in stream]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"] and len(chunks) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["timings"]["predicted_n"] == t["predicted_n"] and chunks[-1]["usage"]["completion_tokens"] > 0
    # Asked again word for word, the reply is regenerated from where the question began: nothing else is fed.
    assert chunks[-1]["timings"]["reuse"] == "rewind" and chunks[-1]["timings"]["cache_n"] > 0


def test_a_conversation_resent_in_full_prefills_only_each_turns_new_tokens(served):
    tok = served.engine.session.tokenizer
    messages = [{"role": "system", "content": "You count."}]
    position = 0
    for turn in range(30):
        messages.append({"role": "user", "content": f"turn {turn}"})
        out = ask(served, messages)
        t = out["timings"]
        if turn:
            # Everything the cache held is reused; only this turn (what the template adds for it) and the
            # closing of the last reply (its stop token and what follows it) are new.
            assert t["reuse"] == "extend" and t["cache_n"] == position, (turn, t)
            new = tok.chat_delta(messages[:-1], messages[-1:], add_generation_prompt=True)
            assert len(new) <= t["prompt_n"] <= len(new) + 2, (turn, t)
        position = t["cache"]["position"]
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    assert t["cache"]["evicted"] > 0  # the conversation slid far past the 64-token cache, never refused


def test_an_edit_in_the_middle_rebuilds_and_still_answers(served):
    messages = [{"role": "user", "content": "first question"}]
    for question in ("second question", "third question"):
        messages += [{"role": "assistant", "content": ask(served, messages)["choices"][0]["message"]["content"]},
                     {"role": "user", "content": question}]
    ask(served, messages)
    edited = [*messages[:2], {"role": "user", "content": "a different second question"}]
    out = ask(served, edited)
    assert out["timings"]["reuse"] in ("rewind", "rebuild") and out["timings"]["predicted_n"] > 0


def test_two_clients_taking_turns_keep_their_own_caches(served):
    a = [{"role": "system", "content": "You are client A."}]
    b = [{"role": "system", "content": "You are client B."}]
    for turn in range(4):
        for chat in (a, b):
            chat.append({"role": "user", "content": f"turn {turn}"})
            out = ask(served, chat)
            if turn:
                assert out["timings"]["reuse"] == "extend", (turn, out["timings"])
            chat.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})


def test_a_message_longer_than_the_window_streams_through_and_says_what_was_evicted(served):
    text = " ".join(f"item{i}" for i in range(3 * TINY_SETTINGS.window))
    out = ask(served, [{"role": "user", "content": text}])
    t = out["timings"]
    assert t["prompt_n"] > 3 * TINY_SETTINGS.window and t["prompt_evicted"] > 2 * TINY_SETTINGS.window
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stop_sequence_cuts_the_reply(served):
    # A tiny random model writes odd text, some of it blank: take a prompt whose reply shows something.
    for prompt in ("Hello", "Say something long", "Count to ten", "Name a colour"):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        full = ask(served, messages, max_tokens=12)["choices"][0]["message"]["content"]
        if full.strip():
            break
    stop = full.strip()[:2]
    assert stop
    cut = ask(served, messages, max_tokens=12, stop=[stop, "never appears"])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == full[: full.find(stop)]


def test_raw_completions_reuse_the_prompt_they_extend(served):
    first = served.client.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=4,
                                             temperature=0).to_dict()
    assert first["choices"][0]["text"] and first["object"] == "text_completion"
    again = served.client.completions.create(model="tiny-random", prompt="Once upon a time there was",
                                             max_tokens=4, temperature=0).to_dict()
    assert again["timings"]["cache_n"] >= 4 and again["timings"]["reuse"] in ("extend", "rewind")


def test_a_client_that_disconnects_mid_stream_frees_the_engine(served):
    messages = [{"role": "user", "content": "Tell me everything"}]
    stream = served.client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4000,
                                                   temperature=0.8, stream=True)
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 3:
            break
    stream.close()
    served.idle()
    assert served.engine.pool.last.stop_reason == "stopped" and served.engine.pool.last.tokens < 4000
    assert ask(served, [{"role": "user", "content": "still there?"}])["timings"]["predicted_n"] > 0


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"\xff\xfe{}", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": "tiny-random", "messages": "hello"}).encode(), 422, "messages"),
    (json.dumps({"model": "tiny-random", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny-random", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 422,
     "messages.0.role"),
    (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
     422, "temperature"),
    (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), 400, "n"),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (json.dumps({"model": "tiny-random", "messages": [{"role": "assistant", "content": "x"}]}).encode(), 400,
     "messages"),
])
def test_bad_requests_get_openai_shaped_errors(served, body, status, param):
    got, _, reply = served.raw("POST", "/v1/chat/completions", body)
    assert got == status and reply["error"]["message"] and reply["error"]["param"] == param, reply


def _read_response(sock: socket.socket) -> str:
    """One whole HTTP response, headers and the Content-Length bytes of its body: one recv may return the headers
    alone (the body comes in a second packet)."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(body) >= length:
                return data.decode()
        chunk = sock.recv(4096)
        if not chunk:  # closed: what came is all there is
            return data.decode()
        data += chunk


def test_auth_size_paths_and_stalled_bodies(served):
    ok = json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode()
    assert served.raw("POST", "/v1/chat/completions", ok, auth=False)[0] == 401
    assert served.raw("POST", "/v1/chat/completions", ok, headers={"Authorization": "Bearer nope"})[0] == 401
    status, _, reply = served.raw("POST", "/v1/chat/completions", b"x" * (2 * 1024 * 1024))
    assert status == 413 and "MB" in reply["error"]["message"]
    assert served.raw("GET", "/v1/nothing-here")[0] == 404
    # Half a body, then silence: an error once the read times out, and the server goes on.
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\":")
        answer = _read_response(sock)
    assert answer.startswith("HTTP/1.1 408") and "did not arrive" in answer
    assert served.raw("POST", "/v1/chat/completions", ok)[0] == 200


def test_a_request_that_waits_too_long_gets_a_503(served):
    from engine.serve.worker import Job

    release = threading.Event()

    async def block() -> None:
        served.engine.submit(Job(asyncio.get_running_loop(), lambda engine, emit: release.wait(30)))

    runner = asyncio.new_event_loop()  # the blocking job's events go nowhere: only the engine thread matters
    try:
        runner.run_until_complete(block())
        ok = json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}]}).encode()
        status, headers, reply = served.raw("POST", "/v1/chat/completions", ok)
    finally:
        release.set()
    served.idle()
    runner.close()
    assert status == 503 and headers.get("retry-after") == "5" and "busy" in reply["error"]["message"]
    assert served.raw("POST", "/v1/chat/completions", ok)[0] == 200


def test_eddy_serve_refuses_other_hosts_without_a_key():
    run = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--host", "0.0.0.0", "--model", "tiny-random"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--api-key" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("port, words", [(None, "already in use"), ("70000", "not a port number")])
def test_eddy_serve_refuses_a_busy_or_impossible_port_in_a_sentence(port, words):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = port or str(busy.getsockname()[1])
        run = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--port", port, "--model", "tiny-random"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and words in run.stderr, run.stderr
    # Said before anything else: no address announced, no traceback, nothing left over from a model.
    assert "Traceback" not in run.stderr and "http://" not in run.stderr and "nanobind" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
