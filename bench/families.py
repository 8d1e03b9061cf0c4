#!/usr/bin/env python3
"""Every family at the real config of a checkpoint people run (all its layers, random weights), built as a new user
builds it: one row a model, the way a family is declared supported in docs/MODELS.md.

    python bench/families.py [--model gemma-3-270m ...] [--dtype q4] [--llama-cpp Q4_K_M --convert PATH]
                             [--no-reuse] [--runs 3] [--json FILE]

For each model (default: each family's smallest popular checkpoint, plus Llama 3.1 8B) it writes a random bf16
safetensors checkpoint of that shape (bench/scale.py's writer: a tensor at a time, so an 8B fits) and then:

  * the time from choosing the model to its first token, as a user meets it: `eddy compile` in an empty artefact
    cache (its stages: loading, export, weights, compile; wall time and the peak memory of the whole build process
    tree, bench/scale.py's measure_build), then a new process that opens the build and answers a 16-token prompt
    with one token (open, first token). The total is the build's wall time plus that process's;
  * the same for a second checkpoint of the same shape with other weights (a fine-tune): its export is reused
    (`--no-reuse` skips it);
  * the built module's warm start, prefill of 512 tokens and decode at 1000 tokens of context (medians of
    `--runs`), and decode as a fraction of its floor (bench/scale.py);
  * with `--llama-cpp Q4_K_M`, llama.cpp on the same checkpoint in the same run (its converter and quantiser:
    bench/scale.py's build_gguf): its load time (the time llama.cpp takes from a GGUF file to ready), prefill and
    decode.

Results are appended to the JSON (default bench/results/families.json) after every model, and a rerun skips the
(model, dtype) rows it already holds. Checkpoints and builds are deleted afterwards (an 8B's are 16 + 5 GB).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bandwidth import read_bandwidth  # noqa: E402  (bench/, beside this script)
from machine import cpu_info  # noqa: E402
from scale import (build_gguf, decode_bytes, gguf_decode_bytes, kv_element_bytes, measure_build,  # noqa: E402
                   measure_llama_run, measure_run, write_checkpoint)

from engine import arch  # noqa: E402
from engine.checkpoint.shapes import CONFIGS, SMALLEST, config  # noqa: E402

DEFAULT_MODELS = [*SMALLEST.values(), "llama-3.1-8b"]

# A new process that opens a build and answers a 16-token prompt with one token: what follows the build before a
# new model's first token.
FIRST_TOKEN = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from pathlib import Path
from engine.loader import open_folder
eng = open_folder(Path(sys.argv[1])).engine
opened = time.perf_counter()
ids = np.random.RandomState(1).randint(0, eng.cfg.vocab_size, 16).tolist()
eng.decode(int(np.argmax(eng.prefill(ids))))
done = time.perf_counter()
print(json.dumps({"open_s": round(opened - t0, 2), "first_token_s": round(done - opened, 2)}))
"""


def first_token(folder: Path, cache: Path) -> dict:
    env = {**os.environ, "EDDY_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(folder)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"opening {folder} failed:\n{out.stderr[-2000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": round(time.perf_counter() - start, 2)}


def new_model(checkpoint: Path, dtype: str, cache: Path) -> tuple[Path, dict]:
    """The build and first token of a model Eddy has not built (an export of its shape may be kept)."""
    build = measure_build(checkpoint, dtype, ROOT, cache)
    folder = Path(build.pop("folder"))
    first = first_token(folder, cache)
    build.update(first, to_first_token_s=round(build["wall_s"] + first["process_s"], 1))
    return folder, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", choices=sorted(CONFIGS), help="repeatable (default: see above)")
    p.add_argument("--dtype", default="q4")
    p.add_argument("--llama-cpp", action="append", default=[], metavar="QUANT",
                   help="repeatable: also llama.cpp on a GGUF of the checkpoint in this type (e.g. Q4_K_M)")
    p.add_argument("--convert", type=Path, default=os.environ.get("LLAMA_CPP_CONVERT"),
                   help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERT)")
    p.add_argument("--no-reuse", action="store_true", help="skip the second build that reuses the export")
    p.add_argument("--from-gguf", metavar="QUANT", default="",
                   help="Eddy builds from llama.cpp's GGUF of the checkpoint in this type (e.g. Q4_K_M), as a user "
                        "who downloads a GGUF does, rather than from the safetensors (needs --convert)")
    p.add_argument("--runs", type=int, default=3, help="prefill and decode samples per build, medians (default 3)")
    p.add_argument("--label", default="", help="free text stored with the figures")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "families.json"))
    a = p.parse_args()
    if (a.llama_cpp or a.from_gguf) and not (a.convert and Path(a.convert).is_file()):
        p.error("--llama-cpp and --from-gguf need --convert (llama.cpp's convert_hf_to_gguf.py)")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(out.read_text()) if out.exists() else {}
    rows = kept.get("results", [])
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s", flush=True)

    def save() -> None:
        out.write_text(json.dumps({"machine": cpu_info(), "label": a.label, "bandwidth": bandwidth,
                                   "results": rows}, indent=1) + "\n")

    for name in a.model or DEFAULT_MODELS:
        todo = [(q, "eddy") for q in [a.dtype]] + [(q, "llama.cpp") for q in a.llama_cpp]
        todo = [t for t in todo if not any(r["model"] == name and (r["dtype"], r["engine"]) == t for r in rows)]
        if not todo:
            continue
        cfg = config(name)
        work = Path(tempfile.mkdtemp(prefix=f"eddy-families-{name}-"))
        try:
            t = time.perf_counter()
            nbytes = write_checkpoint(work / name, cfg)
            print(f"{name}: random checkpoint {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
            ggufs: dict[str, tuple[Path, dict]] = {}

            def gguf_of(quant: str) -> tuple[Path, dict]:
                """llama.cpp's GGUF of the checkpoint in `quant`, made once for both engines' rows."""
                if quant not in ggufs:
                    path = work / f"{name}-{quant}.gguf"
                    ggufs[quant] = (path, build_gguf(work / name, quant, Path(a.convert), path))
                return ggufs[quant]

            for dtype, engine in todo:
                cache = work / f"cache-{engine}"
                row = {"model": name, "family": arch.for_hf(name, cfg["model_type"], []).name, "dtype": dtype,
                       "engine": engine, "layers": cfg["num_hidden_layers"], "checkpoint_bytes": nbytes}
                if engine == "llama.cpp":
                    try:
                        gguf, row["build"] = gguf_of(dtype)
                        row["build"] = dict(row["build"])
                    except (subprocess.CalledProcessError, SystemExit) as e:
                        # llama.cpp's converter wants what a random checkpoint lacks for some families (Gemma's
                        # SentencePiece model): no llama.cpp row for it, said so.
                        err = getattr(e, "stderr", None) or str(e)
                        print(f"{name}: llama.cpp could not convert it: {str(err)[-300:]}", flush=True)
                        continue
                    row["build"].pop("folder")
                    row.update(measure_llama_run(gguf, cfg, a.runs))
                    step = gguf_decode_bytes(cfg, gguf)
                else:
                    source = work / name
                    if a.from_gguf:
                        source = gguf_of(a.from_gguf)[0]
                        row.update(source=f"llama.cpp {a.from_gguf} GGUF", source_bytes=source.stat().st_size)
                    folder, row["build"] = new_model(source, dtype, cache)
                    row["bandwidth_gb_per_s"] = round(read_bandwidth()["gb_per_s"], 2)
                    row.update(measure_run(folder, ROOT, cache, a.runs))
                    step = decode_bytes(cfg, row["build"]["artefact_bytes"].get("weights.irpa", 0), dtype,
                                        kv_element_bytes(folder))
                    if not (a.no_reuse or a.from_gguf):
                        # A fine-tune of the same shape: other weights, the export kept from the first build.
                        shutil.rmtree(cache / "artefacts")
                        other = work / f"{name}-other"
                        write_checkpoint(other, cfg, seed=1)
                        row["build_reusing_export"] = new_model(other, dtype, cache)[1]
                        shutil.rmtree(other)
                row.setdefault("bandwidth_gb_per_s", round(read_bandwidth()["gb_per_s"], 2))
                floor = row["bandwidth_gb_per_s"] * 1e9 / step
                row.update(decode_bytes_per_token=step, floor_tok_s=round(floor, 2),
                           decode_fraction_of_floor=round(row["decode_1000_tok_s"] / floor, 3))
                shutil.rmtree(cache, ignore_errors=True)
                rows.append(row)
                save()
                print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'model':16} {'engine':9} {'layers':>6} {'build s':>7} {'export':>6} {'weights':>7} {'compile':>7} "
          f"{'reuse s':>7} {'peak GB':>7} {'to 1st tok s':>12} {'start s':>7} {'pf512/s':>7} {'dec/s':>6} "
          f"{'of floor':>8}")
    for r in rows:
        b = r["build"]
        stages = b.get("stages_s", {})
        reuse = r.get("build_reusing_export", {}).get("to_first_token_s", 0)
        print(f"{r['model']:16} {r['engine']:9} {r['layers']:6d} {b['wall_s']:7.1f} "
              f"{stages.get('export', stages.get('exporting', 0)):6.1f} "
              f"{stages.get('save', stages.get('saving weights', 0)):7.1f} "
              f"{stages.get('compile', stages.get('compiling', 0)):7.1f} {reuse:7.1f} {b.get('tree_peak_rss_gb', 0):7.2f} "
              f"{b.get('to_first_token_s', 0):12.1f} {r.get('warm_start_s', 0):7.2f} "
              f"{r.get('prefill_512_tok_s', 0):7.1f} {r.get('decode_1000_tok_s', 0):6.2f} "
              f"{r.get('decode_fraction_of_floor', 0):8.0%}")
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
