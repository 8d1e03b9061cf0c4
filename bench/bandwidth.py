#!/usr/bin/env python3
"""The machine's memory read bandwidth as a decode step sees it: the floor that decode speeds are judged against.

    python bench/bandwidth.py [--gb 1.0] [--threads 2] [--runs 7] [--json FILE]

Each of `threads` threads sums its own slice of one array of at least 1 GB (float32, pages touched first), all
at once; a run's figure is the bytes read over the slowest thread's time; the median of `runs` runs is printed
and written to JSON with the machine. numpy's reductions release the GIL, so the threads read in parallel, as
IREE's two worker threads do during a decode step.

A decode step cannot be faster than (every byte it reads) / (this bandwidth): the weights with their scales,
the LM head and the KV cache slots it attends. `floor_tokens_per_s(bytes_per_token)` gives that bound.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_info  # noqa: E402


def read_bandwidth(gb: float = 1.0, threads: int = 2, runs: int = 7) -> dict:
    """{"gb_per_s": median, "runs": [...], ...}: `threads` threads reading `gb` GB between them."""
    n = int(gb * 1e9) // 4 // threads * threads
    data = np.ones(n, dtype=np.float32)  # written once, so every page is resident before timing
    parts = np.split(data, threads)
    figures: list[float] = []
    for _ in range(runs + 1):  # the first run warms caches and page tables; it is dropped
        times = [0.0] * threads
        barrier = threading.Barrier(threads)

        def read(i: int) -> None:
            barrier.wait()
            start = time.perf_counter()
            parts[i].sum(dtype=np.float32)
            times[i] = time.perf_counter() - start

        workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        figures.append(data.nbytes / max(times) / 1e9)
    figures = figures[1:]
    return {"gb_per_s": statistics.median(figures), "runs": figures, "bytes": data.nbytes, "threads": threads}


def floor_tokens_per_s(bytes_per_token: float, gb_per_s: float) -> float:
    """The fastest decode the bandwidth allows when each token reads `bytes_per_token` bytes."""
    return gb_per_s * 1e9 / bytes_per_token


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="array size in GB (at least 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if a.gb < 1.0:
        p.error("--gb must be at least 1: a smaller array is read partly from the CPU's caches")
    result = {"machine": cpu_info(), **read_bandwidth(a.gb, a.threads, a.runs)}
    print(f"read bandwidth, {a.threads} threads over {result['bytes'] / 1e9:.2f} GB: "
          f"{result['gb_per_s']:.1f} GB/s (median of {a.runs}; runs {', '.join(f'{r:.1f}' for r in result['runs'])})")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
