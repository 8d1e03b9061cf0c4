#!/usr/bin/env python3
"""What decode's 4-bit copy of the LM head changes in the logits a q4 build samples from (engine/exporter/model.py,
coarse_head): at each step, the logits decode returns (the REFINED_ROWS likeliest made again from the 8-bit head,
the rest as the 4-bit copy gave them) against the 8-bit head's logits for every token (the module's refine over the
whole vocabulary, from the same hidden state).

    python bench/coarse_head.py GGUF [--context 1000] [--steps 20] [--json FILE]

Prints and writes: the KL divergence of the returned logits' softmax from the 8-bit head's (temperature 1, nats a
token), the 8-bit head's probability held by its 64 likeliest tokens, and how often the best tokens agree. Random
weights (bench/peers.py's size GGUFs) spread the probability thinly over the vocabulary, which puts most of it in
the 4-bit tail: their KL is a ceiling; a trained model's probability sits in its few likeliest tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    from engine.config import REFINED_ROWS, BuildSettings
    from engine.loader import open_model

    eng = open_model(str(a.gguf), BuildSettings(dtype="q4")).engine
    if not eng.module.refines:
        raise SystemExit(f"{a.gguf.name}: its q4 build reads the 8-bit head in decode (no coarse head)")
    vocab = eng.cfg.vocab_size
    ids = np.random.default_rng(1).integers(0, vocab, a.context + a.steps).tolist()
    eng.prefill(ids[:a.context])
    every = (np.arange(-(-vocab // REFINED_ROWS) * REFINED_ROWS) % vocab).reshape(-1, REFINED_ROWS)
    kl, mass, agree = [], [], 0
    for token in ids[a.context:]:
        got = eng.decode(token)
        head = np.concatenate([eng.module.refine(chunk) for chunk in every])[:vocab]
        want, have = softmax(head), softmax(got)
        kl.append(float((want * (np.log(want) - np.log(have))).sum()))
        mass.append(float(np.sort(want)[-REFINED_ROWS:].sum()))
        agree += int(got.argmax() == head.argmax())
    out = {"machine": cpu_info(), "gguf": str(a.gguf), "context": a.context, "steps": a.steps,
           "refined_rows": REFINED_ROWS, "kl_nats_median": float(np.median(kl)), "kl_nats_max": max(kl),
           "likeliest_mass_median": float(np.median(mass)), "best_token_agrees": agree}
    print(f"{a.gguf.name}: KL {out['kl_nats_median']:.5f} nats a token (median; max {out['kl_nats_max']:.5f}), "
          f"the {REFINED_ROWS} likeliest hold {out['likeliest_mass_median']:.4f} of the 8-bit head's probability, "
          f"best token the same in {agree} of {a.steps} steps")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
