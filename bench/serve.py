"""Time to first token per turn of a growing conversation through `eddy serve`, with the official `openai`
client's own clock, as a client that resends the whole conversation every request sees it; and the same
conversation against llama.cpp's server (llama-cpp-python's `python -m llama_cpp.server`) on the same GGUF
with a context the size of Eddy's cache, when llama_cpp is installed.

    python bench/serve.py [--turns 200] [--max-tokens 24] [--wire] [--json docs/benchmarks/serve.json]

Each turn is one streamed request with greedy decoding; the TTFT is from sending the request to the first
content chunk. The table gives turns 1, 2, 10, 50, 100, 200 (the summary: medians of the five turns around each) and the
last turns' TTFT over turns 2-6 (target <= 1.3), beside it what the openai client itself spends per request,
with Eddy's `timings` (tokens evaluated, reused, how) beside it; errors are counted, never fatal.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402

SHOWN = (1, 2, 10, 50, 100, 200, 500)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout:.0f} s")


def request_messages(messages: list[dict], wire: bool) -> dict:
    """The messages argument of `create`. With `wire`, the already wire-format messages go in `extra_body`, which
    the client merges into the JSON after its request transform: the body is byte for byte the same (the slot
    stays in place, empty), but the client no longer walks every message against its parameter types with the
    GIL held, a cost that grows with the conversation (about 150 ms at 400 messages here) and that no server
    can save. The workaround hermes-agent and litellm use (NousResearch/hermes-agent#111723, BerriAI/litellm#29769)."""
    return {"messages": [], "extra_body": {"messages": messages}} if wire else {"messages": messages}


def converse(base_url: str, model: str, turns: int, max_tokens: int, wire: bool = False) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}]
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me one short fact about the number {turn}."})
        start = time.perf_counter()
        first = None
        text, timings, error = [], {}, None
        try:
            stream = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                                                    **request_messages(messages, wire))
            for chunk in stream:
                data = chunk.to_dict()
                delta = (data.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta and first is None:
                    first = time.perf_counter()
                if delta:
                    text.append(delta)
                timings = data.get("timings") or timings
        except Exception as e:  # a peer past its context fails here: count it, go on
            error = f"{type(e).__name__}: {str(e)[:120]}"
        if error is None and first is None:
            # llama.cpp's server past its context: 200 OK, then the stream ends without a token (its log has
            # "Requested tokens exceed context window"); without streaming the same request is a 400.
            error = "empty stream: no content"
        row_client = client_cost(messages, model, wire) if turn in SHOWN else None
        rows.append({"turn": turn, "ttft_ms": round(((first or time.perf_counter()) - start) * 1e3, 1),
                     "client_ms": row_client,
                     "error": error, "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n"),
                     "reuse": timings.get("reuse"), "position": (timings.get("cache") or {}).get("position")})
        messages.append({"role": "assistant", "content": "".join(text)})
    return rows


def client_cost(messages: list[dict], model: str, wire: bool = False) -> float:
    """What the openai client itself spends before a request leaves (it walks every message unless `wire`),
    timed against a port nobody listens on: the part of the client's TTFT no server can save."""
    from openai import OpenAI

    dead = OpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="none", max_retries=0, timeout=5)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        try:
            dead.chat.completions.create(model=model, max_tokens=1, temperature=0, stream=True,
                                         **request_messages(messages, wire))
        except Exception:
            pass
        best = min(best, (time.perf_counter() - start) * 1e3)
    return round(best, 1)


def run_eddy(args: argparse.Namespace) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--model", args.model]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, args.start_timeout)
        return converse(f"http://127.0.0.1:{port}/v1", args.model, args.turns, args.max_tokens, args.wire)
    finally:
        proc.terminate()
        proc.wait(30)


def run_llama(args: argparse.Namespace, gguf: Path, n_ctx: int) -> list[dict] | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", str(n_ctx),
           "--n_threads", str(os.cpu_count() or 2), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, args.start_timeout)
        return converse(f"http://127.0.0.1:{port}/v1", "local", args.turns, args.max_tokens, args.wire)
    finally:
        proc.terminate()
        proc.wait(30)


def summary(rows: list[dict]) -> dict:
    """TTFT at the shown turns, each the median of the five turns around it (one conversation cannot be
    repeated turn by turn, and a shared machine has hiccups), and the last turns' over turns 2-6."""
    by_turn = {r["turn"]: r for r in rows}

    def median_near(t: int, key: str = "ttft_ms") -> float | None:
        values = sorted(by_turn[u][key] for u in range(max(2, t - 2), t + 3) if u in by_turn and by_turn[u][key] is not None
                        and not by_turn[u]["error"])
        return values[len(values) // 2] if values else None

    out = {"turn_1": by_turn[1]["ttft_ms"] if 1 in by_turn else None}
    out.update({f"turn_{t}": median_near(t) for t in SHOWN[1:] if t in by_turn})
    last = rows[-1]["turn"] if rows else 0
    early, late = median_near(4), median_near(last - 2)
    if early and late:
        out["last_over_turn_2"] = round(late / early, 2)
        client = {t: by_turn[t]["client_ms"] for t in (2, last) if by_turn.get(t, {}).get("client_ms") is not None}
        if len(client) == 2:
            # The same ratio less what the client spends building each request (see client_cost).
            out["last_over_turn_2_server"] = round((late - client[last]) / (early - client[2]), 2)
    out["errors"] = sum(1 for r in rows if r["error"])
    out["answered"] = len(rows) - out["errors"]
    out["first_error_turn"] = next((r["turn"] for r in rows if r["error"]), None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--wire", action="store_true",
                   help="pass the messages through the client's extra_body (the same bytes, without its transform)")
    p.add_argument("--peer-only", action="store_true",
                   help="run only llama.cpp's server, keeping the Eddy rows of the --json file")
    args = p.parse_args()

    from engine.checkpoint import resolve_model
    from engine.config import BuildSettings

    results = {"machine": cpu_info(), "turns": args.turns, "max_tokens": args.max_tokens, "model": args.model,
               "client_messages": "extra_body (no client transform)" if args.wire else "typed"}
    if args.peer_only:
        results["eddy"] = json.loads(Path(args.json).read_text())["eddy"]
    else:
        results["eddy"] = {"rows": run_eddy(args)}
    results["eddy"]["summary"] = summary(results["eddy"]["rows"])
    source = resolve_model(args.model)
    if not args.no_peer and source.kind == "gguf":
        rows = run_llama(args, source.path, BuildSettings().capacity)
        results["llama.cpp"] = {"rows": rows, "summary": summary(rows)} if rows else "llama_cpp not installed"

    print(f"{'turn':>6} {'Eddy TTFT ms':>13} {'client ms':>10} {'prompt_n':>9} {'cache_n':>8} {'reuse':>7} "
          f"{'llama.cpp TTFT ms':>18}")
    peer = results.get("llama.cpp")
    peer_rows = {r["turn"]: r for r in peer["rows"]} if isinstance(peer, dict) else {}
    for r in results["eddy"]["rows"]:
        if r["turn"] in SHOWN or r["turn"] == args.turns:
            q = peer_rows.get(r["turn"])
            other = "" if q is None else (q["error"][:18] if q["error"] else f"{q['ttft_ms']:.1f}")
            print(f"{r['turn']:>6} {r['ttft_ms']:>13.1f} {r['client_ms'] or 0:>10.1f} {r['prompt_n'] or 0:>9} "
                  f"{r['cache_n'] or 0:>8} "
                  f"{r['reuse'] or '':>7} {other:>18}")
    print("Eddy:", json.dumps(results["eddy"]["summary"]))
    if isinstance(peer, dict):
        print("llama.cpp:", json.dumps(peer["summary"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
