#!/usr/bin/env python3
"""Two Eddy builds' decode alternated in one process: for a change to the decode program, whose effect on a shared
host is smaller than the host's bandwidth bands (docs/BENCHMARKS.md), pairs of samples seconds apart compare the
builds in the same band.

    python bench/decode_ab.py OLD_BUILD_FOLDER NEW_BUILD_FOLDER [--pairs 16] [--context 1000] [--tokens 32] [--json FILE]

Each folder is a build (an artefact folder: ~/.cache/eddy/artefacts/...). Both prefill the same `--context` token
ids once; each sample goes back to that state and decodes `--tokens` greedy tokens (bench/decode_pair.py's sample
and alternation). Prints each pair and the medians (ms a token, and of the pairs' old/new ratios), and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode_pair import alternated, eddy_tok_s  # noqa: E402
from bench.machine import cpu_info  # noqa: E402
from bench.peers import EddyPeer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import numpy as np

    ids = [int(i) for i in np.random.RandomState(0).randint(100, 40000, a.context)]
    peers = {"old": EddyPeer(folder=a.old), "new": EddyPeer(folder=a.new)}
    for peer in peers.values():
        peer.keep(ids)
    ms: dict[str, list[float]] = {"old": [], "new": []}
    def ms_a_token(name: str) -> Callable[[], float]:
        return lambda: 1000 / eddy_tok_s(peers[name], a.context, a.tokens)

    for i, (old, new) in enumerate(alternated(ms_a_token("old"), ms_a_token("new"), a.pairs)):
        ms["old"].append(old)
        ms["new"].append(new)
        print(f"pair {i + 1}: old {old:.2f} ms, new {new:.2f} ms, old/new {old / new:.3f}", flush=True)
    ratios = [o / n for o, n in zip(ms["old"], ms["new"])]
    print(f"medians: old {statistics.median(ms['old']):.2f} ms, new {statistics.median(ms['new']):.2f} ms a token; "
          f"median of the pairs' old/new {statistics.median(ratios):.3f} ({a.pairs} pairs, {a.tokens} greedy tokens at "
          f"{a.context})")
    if a.json:
        a.json.write_text(json.dumps({"machine": cpu_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                      "old": str(a.old), "new": str(a.new), "context": a.context,
                                      "tokens": a.tokens, "ms_per_token": ms, "pair_ratios_old_over_new": ratios},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
