#!/usr/bin/env python3
"""How closely each engine follows the float model when both run one llama.cpp Q4_K_M file: the logits of Eddy's
q4 and q8 builds of the GGUF and of llama.cpp on it, against transformers' float32 model on the same weights.

    python bench/gguf_fidelity.py [--size llama-3.2-1b] [--layers 2] [--convert convert_hf_to_gguf.py] [--json FILE]

A random bf16 checkpoint of `--size`'s shape cut to `--layers` layers (bench/scale.py's writer) goes through
llama.cpp's own converter and quantiser (`--convert`: the vendor/llama.cpp folder of the llama-cpp-python sdist),
so its weights were never 4-bit: what the file's types cost, and what each engine adds to them, show. Q4_K_M keeps
some tensors in Q6_K (the LM head; `ffn_down` and `attn_v` in some layers: all of them in a model of two layers),
which a q4 build takes to 4 bits (its head to q8); llama.cpp runs them as they are. The same 120 token ids go
through each; the last 21 positions are compared (Eddy: a prefill of 100, then decode steps): the cosine of each
position's logits with the float model's, the error's RMS over the float logits' RMS, and how often the top token
agrees. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_info  # noqa: E402
from scale import build_gguf, write_checkpoint  # noqa: E402

TOKENS, FIRST = 120, 100


def compared(logits: list[np.ndarray], ref: np.ndarray, positions: list[int]) -> dict:
    cos = [float(lg @ ref[p] / np.linalg.norm(lg) / np.linalg.norm(ref[p])) for p, lg in zip(positions, logits)]
    err = np.mean([np.mean((lg - ref[p]) ** 2) for p, lg in zip(positions, logits)])
    return {"cosine_median": float(np.median(cos)), "cosine_min": float(min(cos)),
            "rel_rms_error": float(np.sqrt(err / np.mean(ref[positions] ** 2))),
            "top1_agrees": float(np.mean([int(np.argmax(lg)) == int(np.argmax(ref[p]))
                                          for p, lg in zip(positions, logits)]))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="llama-3.2-1b", help="a shape of engine/checkpoint/shapes.py")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--convert", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--work", type=Path, default=Path("/tmp/eddy-fidelity"), help="checkpoint, GGUF and builds")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gguf_fidelity.json")
    a = p.parse_args()

    import os

    import llama_cpp
    import torch
    import transformers
    from gguf import GGUFReader

    from engine.checkpoint.shapes import config
    from engine.config import BuildSettings

    work = a.work / f"{a.size}-{a.layers}"
    hf, gguf = work / "hf", work / "q4_k_m.gguf"
    if not gguf.exists():
        shutil.rmtree(work, ignore_errors=True)
        write_checkpoint(hf, config(a.size, a.layers))
        build_gguf(hf, "Q4_K_M", a.convert, gguf)
    os.environ["EDDY_CACHE_DIR"] = str(work / "cache")  # before the engine reads it: builds kept apart
    from engine.loader import open_model

    ids = np.random.RandomState(3).randint(0, 49152, TOKENS).tolist()  # the default model's tokenizer's range
    positions = list(range(FIRST - 1, TOKENS))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
    del model

    rows = {}
    llm = llama_cpp.Llama(str(gguf), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    rows["llama.cpp, the GGUF"] = compared([np.array(llm.scores[i], dtype=np.float64) for i in positions], ref,
                                           positions)
    del llm
    for dtype in ("q4", "q8"):
        eng = open_model(str(gguf), BuildSettings(dtype=dtype), progress=lambda *_: None).engine
        eng.reset()
        logits = [np.asarray(eng.prefill(ids[:FIRST]), dtype=np.float64).reshape(-1)]
        logits += [np.asarray(eng.decode(t), dtype=np.float64).reshape(-1) for t in ids[FIRST:]]
        rows[f"Eddy {dtype}, built from the GGUF"] = compared(logits, ref, positions)
    types: dict[str, int] = {}
    for t in GGUFReader(str(gguf)).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1

    print(f"{a.size}, {a.layers} layers, Q4_K_M ({types}); {cpu_info().get('Model name', '')}")
    print("| engine | cosine to float32 (median, min) | error RMS / logits RMS | top token agrees |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['cosine_median']:.5f}, {r['cosine_min']:.5f} | {r['rel_rms_error']:.4f} | "
              f"{r['top1_agrees']:.2f} |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"machine": cpu_info(), "size": a.size, "layers": a.layers, "gguf_types": types,
                                  "positions": positions, "engines": rows}, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
