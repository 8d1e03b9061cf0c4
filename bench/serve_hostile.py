"""What a hostile but ordinary client costs `eddy serve` and everyone else using it: the server's memory over
a run of megabyte prompts to /v1/completions and /health's latency meanwhile, and /health's latency while a long
reply is checked against the longest stop sequences allowed (4 of 256 characters).

    python bench/serve_hostile.py [--model tiny-random] [--prompts 5] [--words 1000000] [--json FILE]

The server is a real `eddy serve` process; its resident memory is read from /proc after each prompt.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402
from bench.serve import free_port, wait_ready  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog and then some more".split()


def rss_gb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--words", type=int, default=1_000_000, help="words per prompt (1M: about 5 MB)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import openai

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", args.model, "--port", str(port),
                               "--max-tokens", "2"], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server, 600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900, max_retries=0)
        rng = random.Random(0)
        rows = [{"prompt": 0, "bytes": 0, "seconds": 0.0, "rss_gb": round(rss_gb(server.pid), 3)}]
        for i in range(args.prompts):
            text = " ".join(rng.choice(WORDS) for _ in range(args.words))
            done = threading.Event()
            waits: list[float] = []
            poller = threading.Thread(target=_poll, args=(port, done, waits))
            poller.start()
            start = time.perf_counter()
            client.completions.create(model=args.model, prompt=text, max_tokens=2)
            seconds = time.perf_counter() - start
            done.set()
            poller.join()
            rows.append({"prompt": i + 1, "bytes": len(text), "seconds": round(seconds, 1),
                         "health_ms_max": round(max(waits, default=0.0), 1), "rss_gb": round(rss_gb(server.pid), 3)})
        # /health while a 2000-token reply is checked against the longest stops allowed.
        stops = [chr(0x4E00 + i) * 256 for i in range(4)]
        reply = threading.Thread(target=lambda: client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": "Tell me a long story"}], max_tokens=2000,
            temperature=0.8, stop=stops))
        reply.start()
        time.sleep(0.5)
        health = []
        while reply.is_alive() and len(health) < 50:
            start = time.perf_counter()
            _get(port)
            health.append((time.perf_counter() - start) * 1e3)
            time.sleep(0.05)
        reply.join()
    finally:
        server.terminate()
        server.wait(30)
    print("| prompt | bytes | seconds | slowest /health meanwhile (ms) | server RSS after (GB) |\n"
          "| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['prompt']} | {r['bytes']:,} | {r['seconds']} | {r.get('health_ms_max', '')} | {r['rss_gb']} |")
    health.sort()
    summary = {"health_calls": len(health), "health_ms_median": round(health[len(health) // 2], 1) if health else None,
               "health_ms_max": round(health[-1], 1) if health else None}
    print(f"/health during a reply checked against 4 stops of 256 characters: {summary}")
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_info(), "model": args.model, "prompts": rows, **summary},
                                        indent=1))
    return 0


def _poll(port: int, done: threading.Event, waits: list[float]) -> None:
    """/health's answer time, every 0.1 s until `done`: what other clients wait while the prompt is handled."""
    while not done.is_set():
        start = time.perf_counter()
        _get(port)
        waits.append((time.perf_counter() - start) * 1e3)
        done.wait(0.1)


def _get(port: int) -> None:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
        resp.read()


if __name__ == "__main__":
    sys.exit(main())
