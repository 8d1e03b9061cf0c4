#!/usr/bin/env python3
"""Eddy's and llama.cpp's decode at one context, their samples alternated in one process: for a figure bound by
memory bandwidth on a shared host, whose bandwidth moves in bands over minutes (docs/BENCHMARKS.md), pairs of
samples taken seconds apart keep a band change out of the ratio, where bench/peers.py's peers run one after
the other.

    python bench/decode_pair.py --gguf FILE [--folder EDDY_BUILD] [--context 1000] [--tokens 32] [--pairs 8]

Both open the same GGUF (Eddy: a q4 build of it, built into the artefact cache if missing, or the build in
--folder); both prefill the same `--context` token ids once, then each sample decodes `--tokens` greedy tokens from
that state (Eddy restores its snapshot, llama.cpp drops the cells after it). Prints each pair and the medians, and
writes JSON (--json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402
from bench.peers import EddyPeer, LlamaPeer  # noqa: E402


def eddy_tok_s(eddy: EddyPeer, context: int, tokens: int) -> float:
    """One sample: back to the kept `context` tokens (EddyPeer.keep), then `tokens` greedy steps; tokens a second."""
    logits = eddy.back_to(context)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = eddy.step(eddy.argmax(logits))
    return tokens / (time.perf_counter() - start)


def alternated(first: Callable[[], float], second: Callable[[], float], pairs: int) -> Iterator[tuple[float, float]]:
    """(first's sample, second's sample) `pairs` times, which one runs first alternating pair by pair so that
    neither always follows the other's traffic; one unrecorded pass of each first pages the weights in."""
    first(), second()
    for i in range(pairs):
        if i % 2 == 0:
            x = first()
            yield x, second()
        else:
            y = second()
            yield first(), y


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--folder", type=Path, help="an Eddy build of the GGUF to open instead of building one")
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import numpy as np

    eddy = EddyPeer("q4", model=str(a.gguf), folder=a.folder)
    llama = LlamaPeer(a.gguf)
    ids = [int(i) for i in np.random.RandomState(0).randint(100, 40000, a.context)]
    eddy.keep(ids)
    llama.keep(ids)
    greedy = llama.sampler(None)

    def llama_sample() -> float:
        llama.back_to(a.context)
        start = time.perf_counter()
        llama.decode_loop(greedy, a.tokens)
        return a.tokens / (time.perf_counter() - start)

    pairs = []
    for i, (e, l) in enumerate(alternated(lambda: eddy_tok_s(eddy, a.context, a.tokens), llama_sample, a.pairs)):
        pairs.append({"eddy_tok_s": round(e, 2), "llama_tok_s": round(l, 2), "ratio": round(e / l, 3)})
        print(f"pair {i + 1}: eddy {e:.2f} tok/s, llama.cpp {l:.2f} tok/s, ratio {e / l:.3f}", flush=True)
    med = {k: statistics.median(p[k] for p in pairs) for k in ("eddy_tok_s", "llama_tok_s", "ratio")}
    print(f"medians: eddy {med['eddy_tok_s']:.2f}, llama.cpp {med['llama_tok_s']:.2f}, ratio {med['ratio']:.3f} "
          f"(decode {a.tokens} tokens at {a.context}, greedy, {a.pairs} pairs)")
    if a.json:
        a.json.write_text(json.dumps({"machine": cpu_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                      "gguf": str(a.gguf), "context": a.context, "tokens": a.tokens,
                                      "pairs": pairs, "medians": med, "llama": llama.info()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
