#!/usr/bin/env python3
"""A model Eddy has not built, from choosing it to its first token: the build in an empty artefact cache (`eddy
compile`, its wall time, its stages' own seconds and the peak memory of its process tree: bench/scale.py's
measure_build), then a new process that opens the build and answers a 16-token prompt with one token
(bench/families.py's first_token), then the same again on the cached build (the warm start).

    python bench/new_model.py MODEL [MODEL ...] [--code DIR ...] [--json FILE]

`--tuned` then builds a fine-tune of each GGUF in the same cache, to its first token too: a copy whose output norm
is scaled by 1.01 (the same shape, other weights, so another model to Eddy), which takes the first build's
compiled module and writes only its weights (engine.artefacts.store.built_module).

MODEL is anything `eddy compile --model` takes (a GGUF as downloaded, a Hugging Face folder). `--code DIR`
(repeatable; default this checkout) builds with the code in DIR too, one after another in the same run, so an
older version (e.g. `git archive <commit> | tar -x -C DIR`) is compared on the same machine and the same minute.
Every cache is deleted afterwards. Results go to the JSON (default bench/results/new-model.json).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from families import first_token  # noqa: E402  (bench/, beside this script)
from machine import cpu_info  # noqa: E402
from scale import measure_build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="+")
    p.add_argument("--code", action="append", type=Path, help="repeatable: a folder of Eddy's code to build with")
    p.add_argument("--dtype", default="q4")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "new-model.json"))
    p.add_argument("--tuned", action="store_true", help="also a fine-tune of each GGUF, built after it")
    a = p.parse_args()
    rows = []
    for model in a.model:
        for code in a.code or [ROOT]:
            cache = Path(tempfile.mkdtemp(prefix="eddy-new-model-"))
            try:
                built = [(Path(model), *_to_first_token(Path(model), a.dtype, code.resolve(), cache))]
                if a.tuned and model.endswith(".gguf"):
                    tuned = _fine_tune(Path(model), cache / f"tuned-{Path(model).name}")
                    built.append((tuned, *_to_first_token(tuned, a.dtype, code.resolve(), cache)))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            for path, build, first, cached in built:
                row = {"model": path.name, "model_bytes": path.stat().st_size if path.is_file() else None,
                       "code": str(code), "dtype": a.dtype, "build": build, "first_token": first,
                       "to_first_token_s": round(build["wall_s"] + first["process_s"], 1), "cached": cached}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": cpu_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "results": rows}, indent=1) + "\n")
    print(f"\n{'model':34} {'code':24} {'to 1st token s':>14} {'build s':>7}  stages s{'':30} {'peak GB':>7} "
          f"{'warm open s':>11}")
    for r in rows:
        stages = " ".join(f"{k} {v:.1f}" for k, v in r["build"]["stages_s"].items() if k != "load")
        print(f"{r['model'][:34]:34} {Path(r['code']).name[:24]:24} {r['to_first_token_s']:14.1f} "
              f"{r['build']['wall_s']:7.1f}  {stages:38} {r['build']['tree_peak_rss_gb']:7.2f} "
              f"{r['cached']['open_s']:11.2f}")
    print(f"wrote {out}")


def _to_first_token(model: Path, dtype: str, code: Path, cache: Path) -> tuple[dict, dict, dict]:
    """The build into `cache`, then a new process's first token, then another's on the cached build."""
    build = measure_build(model, dtype, code, cache)
    folder = Path(build.pop("folder"))
    first = first_token(folder, cache)  # a new process: open the build, one token for 16 tokens
    cached = first_token(folder, cache)  # again, on the cached build
    return build, first, cached


def _fine_tune(gguf_path: Path, out: Path) -> Path:
    """A copy of the GGUF with its output norm's weights times 1.01: a model of the same shape with other
    weights."""
    import gguf
    import numpy as np

    shutil.copyfile(gguf_path, out)
    reader = gguf.GGUFReader(str(out), "r+")
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")
    norm.data[...] = (np.asarray(norm.data) * np.float32(1.01)).astype(norm.data.dtype)
    reader.data.flush()
    return out


if __name__ == "__main__":
    main()
