#!/usr/bin/env python3
"""Weight types side by side: decode and prefill of one model built in several dtypes, interleaved in one run.

    python bench/dtypes.py [--model M] [--dtype q4 --dtype q8 --dtype f16] [--rounds 5] [--json FILE]
    python bench/dtypes.py --folder [LABEL=]ARTEFACTS_DIR --folder ...   (builds already made, e.g. by older code)

Builds (or finds) each dtype's artefacts, opens them all, then takes `rounds` rounds in which the memory read
bandwidth is measured (bench/bandwidth.py) and every build in turn prefills 512 tokens from an empty cache,
prefills up to 1000 and decodes 16 tokens: interleaving makes the builds share whatever else the machine does.
A round's floor is its bandwidth over each build's weights file plus the KV slots attended, so on a host whose
neighbours move the bandwidth the fraction of the floor is taken per round; medians are printed and written to
JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bandwidth import read_bandwidth  # noqa: E402
from machine import cpu_info  # noqa: E402

CONTEXT = 1000


def main() -> int:
    from engine.artefacts.store import ensure_artefacts
    from engine.checkpoint import resolve_model
    from engine.config import BuildSettings
    from engine.loader import open_folder

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", action="append", help="repeatable (default q4, q8, f16)")
    p.add_argument("--folder", action="append", help="repeatable: [LABEL=]DIR, artefact folders to compare instead "
                   "(labelled by their dtype unless LABEL is given)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "dtypes.json")
    a = p.parse_args()
    source = resolve_model(a.model)
    if a.folder:
        folders = dict(_labelled(f) for f in a.folder)
    else:
        folders = {d: ensure_artefacts(source, replace(BuildSettings(), dtype=d)) for d in a.dtype or ["q4", "q8", "f16"]}
    dtypes = list(folders)
    engines = {d: open_folder(f, source).engine for d, f in folders.items()}
    bandwidth = read_bandwidth()
    per_round: list[float] = []
    ids = np.random.RandomState(0).randint(0, next(iter(engines.values())).cfg.vocab_size, CONTEXT).tolist()
    prefill: dict[str, list[float]] = {d: [] for d in dtypes}
    decode: dict[str, list[float]] = {d: [] for d in dtypes}
    for _ in range(a.rounds):
        per_round.append(read_bandwidth(runs=3)["gb_per_s"])
        for d, eng in engines.items():
            eng.reset()
            t = time.perf_counter()
            eng.prefill(ids[:512])
            prefill[d].append(512 / (time.perf_counter() - t))
            eng.prefill(ids[512:])
            t = time.perf_counter()
            for token in ids[:16]:
                eng.decode(token)
            decode[d].append(16 / (time.perf_counter() - t))
    rows = []
    for d, eng in engines.items():
        cfg = eng.cfg
        kv = CONTEXT * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4
        weights = (folders[d] / "weights.irpa").stat().st_size
        floor = bandwidth["gb_per_s"] * 1e9 / (weights + kv)
        fractions = [tok_s * (weights + kv) / (gb * 1e9) for tok_s, gb in zip(decode[d], per_round)]
        rows.append({"dtype": d, "weights_bytes": weights, "kv_bytes_attended": kv,
                     "decode_tok_s": round(statistics.median(decode[d]), 2), "floor_tok_s": round(floor, 1),
                     "of_floor_per_round": round(statistics.median(fractions), 3),
                     "prefill_512_tok_s": round(statistics.median(prefill[d]), 1),
                     "decode_runs": [round(x, 2) for x in decode[d]], "prefill_runs": [round(x, 1) for x in prefill[d]]})
    print(f"read bandwidth {bandwidth['gb_per_s']:.1f} GB/s first, {statistics.median(per_round):.1f} GB/s over the "
          f"rounds ({min(per_round):.1f}-{max(per_round):.1f}); decode at {CONTEXT} of context, medians of {a.rounds}")
    print(f"{'build':10} {'weights MB':>10} {'decode tok/s':>12} {'floor':>7} {'of floor':>8} {'per round':>9} "
          f"{'prefill 512 tok/s':>17}")
    for r in rows:
        print(f"{r['dtype']:10} {r['weights_bytes'] / 1e6:10.1f} {r['decode_tok_s']:12.1f} {r['floor_tok_s']:7.1f} "
              f"{r['decode_tok_s'] / r['floor_tok_s']:8.0%} {r['of_floor_per_round']:9.0%} {r['prefill_512_tok_s']:17.1f}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"machine": cpu_info(), "model": source.name, "bandwidth": bandwidth,
                                  "bandwidth_per_round": per_round, "folders": {d: str(f) for d, f in folders.items()},
                                  "results": rows}, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


def _labelled(arg: str) -> tuple[str, Path]:
    """"LABEL=DIR" or "DIR" (labelled by the build's dtype)."""
    label, sep, folder = arg.rpartition("=")
    path = Path(folder)
    return (label if sep else json.loads((path / "manifest.json").read_text())["settings"]["dtype"]), path


if __name__ == "__main__":
    raise SystemExit(main())
