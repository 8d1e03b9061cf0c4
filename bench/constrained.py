#!/usr/bin/env python3
"""What constrained decoding costs: the per-token mask on two vocabularies, and a reply's speed with and without.

1. The mask alone: llguidance (and xgrammar, when it is importable: its wheel needs torch, so it is measured
   here and never shipped) follows a JSON-schema reply of random allowed tokens on the default model's 49k
   vocabulary and on a 262k one (Gemma 3's, from --gguf-262k); median microseconds per token to compute the
   mask, and to apply it to a whole logits vector (which Eddy's sampler does only when its first draw is a
   token the grammar forbids).
2. The reply: the default model answers the same prompt free and held to a JSON schema (greedy, --tokens
   tokens, --repeats runs taken in turns); median decode tokens/s of each and their ratio.

    python bench/constrained.py [--tokens 96] [--repeats 7] [--gguf-262k FILE] [--json FILE]

Prints a table and writes JSON (default bench/results/constrained.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_info  # noqa: E402  (bench/machine.py, beside this script)

from engine.checkpoint import resolve_model, save_tokenizer  # noqa: E402
from engine.run.constraint import Grammar  # noqa: E402
from engine.run.tokenizer import Tokenizer  # noqa: E402

# Long enough that a reply fills --tokens before the grammar can end it.
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "price", "tags"]}, "minItems": 50}}, "required": ["items"]}
PROMPT = "List fifty things one might buy at a market, each with a price and some tags, as JSON."


def tokenizer_for(model: str, out: Path) -> Tokenizer:
    save_tokenizer(resolve_model(model), out)
    return Tokenizer.from_dir(out)


def mask_cost(tok: Tokenizer, steps: int = 400) -> dict:
    """Microseconds per token: llguidance's mask, Eddy's application of it, and xgrammar's mask if installed."""
    rng = np.random.default_rng(0)
    constraint = tok.grammars.follow(Grammar.json_schema(SCHEMA))
    logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
    compute, apply = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        constraint.compute()
        t1 = time.perf_counter()
        masked = constraint.mask(logits)  # only when the first draw is refused (Constraint's docstring)
        t2 = time.perf_counter()
        compute.append(t1 - t0)
        apply.append(t2 - t1)
        allowed = np.flatnonzero(np.isfinite(masked))
        token = int(allowed[rng.integers(allowed.size)])
        if token in tok.stop_ids:
            break
        constraint.accept(token)
    row = {"vocab": tok.vocab_size, "steps": len(compute),
           "llguidance_mask_us": round(statistics.median(compute) * 1e6, 1),
           "apply_us": round(statistics.median(apply) * 1e6, 1)}
    row["xgrammar_mask_us"] = _xgrammar(tok, steps)
    return row


def _xgrammar(tok: Tokenizer, steps: int) -> float | None:
    try:
        import xgrammar as xgr
    except Exception:  # not installed (it needs torch and triton): the row says so
        return None
    info = xgr.TokenizerInfo.from_huggingface(_hf(tok), vocab_size=tok.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        row = bitmask[0].numpy().view(np.uint32)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[: tok.vocab_size])
        token = int(allowed[rng.integers(allowed.size)])
        if token in tok.stop_ids or not matcher.accept_token(token):
            break
    return round(statistics.median(times) * 1e6, 1)


def _hf(tok: Tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok._tok)


def reply_speed(tokens: int, repeats: int) -> dict:
    from engine.loader import open_model
    from engine.run.generation import ChatDefaults  # noqa: F401  (greedy: SamplingParams() as it is)
    from engine.run.session import ChatSettings

    model = open_model("smollm2-135m-instruct")
    session = model.chat()
    grammar = Grammar.json_schema(SCHEMA)
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    produced: dict[str, list[int]] = {"free": [], "constrained": []}
    for _ in range(repeats):
        for kind in runs:
            session.settings = ChatSettings(max_new_tokens=tokens, grammar=grammar if kind == "constrained" else None)
            session.reset()
            result = session.answer(PROMPT)
            runs[kind].append(result.tokens / (result.decode_ms / 1e3))
            produced[kind].append(result.tokens)
    free, held = statistics.median(runs["free"]), statistics.median(runs["constrained"])
    return {"model": "smollm2-135m-instruct", "build": model.engine.settings.dtype,
            "tokens": tokens, "repeats": repeats, "free_tok_s": round(free, 1), "constrained_tok_s": round(held, 1),
            "constrained_over_free": round(held / free, 3),
            "tokens_generated": {k: statistics.median(v) for k, v in produced.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gguf-262k", type=Path, help="a GGUF with a 262k vocabulary (Gemma 3 270M's)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/constrained.json")
    args = ap.parse_args()

    masks = []
    with tempfile.TemporaryDirectory() as tmp:
        masks.append({"tokenizer": "SmolLM2 (default)", **mask_cost(tokenizer_for("smollm2-135m-instruct",
                                                                                Path(tmp) / "a"))})
        if args.gguf_262k:
            masks.append({"tokenizer": args.gguf_262k.name, **mask_cost(tokenizer_for(str(args.gguf_262k),
                                                                                    Path(tmp) / "b"))})
    print(f"{'tokenizer':34} {'vocab':>7} {'llguidance mask':>16} {'apply':>8} {'xgrammar mask':>14}")
    for r in masks:
        xg = f"{r['xgrammar_mask_us']:.1f} us" if r["xgrammar_mask_us"] is not None else "not installed"
        print(f"{r['tokenizer']:34} {r['vocab']:>7} {r['llguidance_mask_us']:>13.1f} us {r['apply_us']:>5.1f} us "
              f"{xg:>14}")
    speed = reply_speed(args.tokens, args.repeats)
    print(f"\ndefault model, {speed['tokens']} tokens, median of {speed['repeats']}: free {speed['free_tok_s']} tok/s, "
          f"JSON-schema {speed['constrained_tok_s']} tok/s, ratio {speed['constrained_over_free']}")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_info(), "masks": masks, "reply": speed}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
