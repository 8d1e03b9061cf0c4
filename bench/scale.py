#!/usr/bin/env python3
"""Real-size builds: time and memory of `eddy compile` on random-weight checkpoints with real models' shapes, then
the built module's warm start, prefill and decode speed against the machine's bandwidth floor.

    python bench/scale.py [--size llama-3.2-1b ...] [--dtype q4 --dtype q8] [--before DIR] [--json FILE]

For each size it writes a random bf16 safetensors checkpoint of that model's shapes under /tmp (random weights
serve for time and memory), builds it with `eddy compile` in a private artefact cache under /tmp, and reports
the build's wall time, per-stage seconds, the peak resident memory of the build's whole process tree and of
its largest process, and the artefacts' size. `--before DIR` builds the same checkpoint with the code in DIR
too (e.g. main's: `git archive main | tar -x -C DIR`), in the same run, so the two are compared on one machine.
The checkpoint and every artefact are deleted afterwards (they are gigabytes). One build at a time.

Memory is sampled from /proc every 0.1 s: the tree's peak is the largest sum of VmRSS over the CLI, the build's
child process and the iree-compile it starts; each process's own peak is its VmHWM (the kernel's high-water
mark, exact between samples).

Each build is then run in a child process of its own: the warm start (opening the artefacts), prefill of 512
tokens and decode at 1000 tokens of context (medians of `--runs`, default 3). Decode is also given as a fraction of
its floor: bench/bandwidth.py's 2-thread read, measured in the same run, over every byte a decode step reads (the
weights file less an untied embedding, of which a step reads one row, plus the KV cache slots attended).

`--llama-cpp Q4_K_M` (repeatable: any llama.cpp quantisation type) adds llama.cpp on the same checkpoint, in the
same run: llama.cpp's own converter (`--convert`: convert_hf_to_gguf.py from llama.cpp's source, e.g. the
vendor/llama.cpp folder of the llama-cpp-python sdist) writes a bf16 GGUF, llama-cpp-python's
`llama_model_quantize` quantises it, and the same token ids are run through llama-cpp-python (2 threads,
n_batch = n_ubatch = 512) as through Eddy. Its floor counts its own bytes: the GGUF less an untied embedding, plus
its float16 KV cache. The bandwidth is read again before each run, and each row keeps its own floor: on a shared
host it moves.

Results are appended to the JSON (default bench/results/scale.json) after every build, and a rerun skips the
(size, dtype, code) rows it already holds: the 8B builds are long.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bandwidth import read_bandwidth  # noqa: E402  (bench/bandwidth.py, beside this script)
from machine import cpu_info  # noqa: E402  (bench/machine.py, beside this script)

from engine import arch  # noqa: E402
from engine.artefacts.store import MANIFEST  # noqa: E402
from engine.checkpoint.shapes import config  # noqa: E402

# config.json of each size (engine/checkpoint/shapes.py, from the models' cards).
SIZES = {name: config(name) for name in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")}
STAGE = re.compile(r"building: (.+?) +\d+%")


def checkpoint_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    from engine.checkpoint.weights import expected_shapes

    # expected_shapes takes Eddy's family name ("gemma3"), a config.json its model_type ("gemma3_text").
    return expected_shapes({**cfg, "model_type": arch.for_hf("random", cfg.get("model_type"), []).name})


def write_checkpoint(folder: Path, cfg: dict, seed: int = 0) -> int:
    """config.json, random bf16 model.safetensors (written a tensor at a time: an 8B one does not fit in memory
    whole) and the default model's tokenizer files. Returns the weights' size in bytes."""
    import torch

    from engine.checkpoint import resolve_model, save_tokenizer

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    # The default model's tokenizer: smaller than the vocabulary, which the build does not mind.
    save_tokenizer(resolve_model(None), folder)
    chat = json.loads((folder / "chat.json").read_text())
    (folder / "chat.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": chat["bos_token"], "eos_token": chat["eos_token"], "chat_template": chat["chat_template"]}))
    shapes = checkpoint_shapes(cfg)
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            fh.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            del t
    return offset


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


def _status(pid: int) -> tuple[str, int, int] | None:
    """(name, VmRSS, VmHWM) in bytes."""
    try:
        text = open(f"/proc/{pid}/status").read()
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
    label = "iree-compile" if any(b"iree-compile" in c for c in cmd[:1]) else (
        "build child" if b"engine.exporter.process" in cmd else
        "side job" if b"engine.exporter.side_job" in cmd else "eddy compile")
    return label, kb("VmRSS"), kb("VmHWM")


def measure_build(model: Path, dtype: str, code: Path, cache: Path) -> dict:
    env = {**os.environ, "EDDY_CACHE_DIR": str(cache), "PYTHONPATH": str(code)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "compile", "--model", str(model), "--dtype", dtype],
                            cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stages: list[tuple[str, float]] = []
    err_tail: list[str] = []

    def seen(text: str) -> bool:
        m = STAGE.search(text)
        if m and (not stages or stages[-1][0] != m.group(1)):
            stages.append((m.group(1), time.perf_counter() - start))
        return m is not None

    def read_stderr() -> None:
        buf = b""
        while chunk := proc.stderr.read1(4096):
            buf += chunk
            *parts, buf = re.split(rb"[\r\n]", buf)
            for part in parts:
                text = part.decode(errors="replace")
                if not seen(text) and text.strip():
                    err_tail.append(text[-300:])
            # The CLI ends a progress line with the next one's "\r", so the stage it names starts now.
            seen(buf.decode(errors="replace"))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    tree_peak, tree_peak_stage, hwm = 0, None, {}
    stage_peak: dict[str, int] = {}
    while proc.poll() is None:
        total = 0
        for pid in _tree(proc.pid):
            st = _status(pid)
            if st:
                label, rss, peak = st
                total += rss
                hwm[label] = max(hwm.get(label, 0), peak)
        now = stages[-1][0] if stages else "starting"
        stage_peak[now] = max(stage_peak.get(now, 0), total)
        if total > tree_peak:
            tree_peak, tree_peak_stage = total, now
        time.sleep(0.1)
    wall = time.perf_counter() - start
    reader.join(timeout=5)
    out = proc.stdout.read().decode().strip().splitlines()
    if proc.returncode:
        raise SystemExit(f"build with {code} failed ({proc.returncode}):\n" + "\n".join(err_tail[-15:]))
    folder = Path(out[-1])
    sizes = {f.name: f.stat().st_size for f in folder.iterdir() if f.suffix in (".irpa", ".vmfb")}
    ends = [t for _, t in stages[1:]] + [wall]
    # The build's own seconds per part, where its manifest has them: the weights file is written beside the
    # export and the compiler, so the reports' stage changes no longer time the stages.
    try:
        timed = {k: round(float(v), 1) for k, v in json.loads((folder / MANIFEST).read_text())["build_seconds"].items()}
    except (OSError, ValueError, KeyError):
        timed = {name: round(end - t, 1) for (name, t), end in zip(stages, ends) if name != "done"}
    return {
        "folder": str(folder),
        "wall_s": round(wall, 1),
        "stages_s": timed,
        "tree_peak_rss_gb": round(tree_peak / 1e9, 2),
        "tree_peak_stage": tree_peak_stage,
        "tree_peak_rss_gb_by_stage": {k: round(v / 1e9, 2) for k, v in stage_peak.items()},
        "process_peak_rss_gb": {k: round(v / 1e9, 2) for k, v in hwm.items()},
        "artefact_bytes": sizes,
    }


# Run in a child with the build's code: the warm start, prefill and decode of the built module.
RUN_SCRIPT = r"""
import json, sys, time
import numpy as np
from pathlib import Path
from engine.loader import open_folder
t = time.perf_counter()
eng = open_folder(Path(sys.argv[1])).engine
start = time.perf_counter() - t
ids = np.random.RandomState(0).randint(0, eng.cfg.vocab_size, 1000).tolist()
prefill, decode = [], []
for _ in range(int(sys.argv[2])):
    eng.reset()
    t = time.perf_counter(); eng.prefill(ids[:512]); prefill.append(512 / (time.perf_counter() - t))
    eng.prefill(ids[512:1000])
    t = time.perf_counter()
    for i in range(16):
        eng.decode(ids[i])
    decode.append(16 / (time.perf_counter() - t))
print(json.dumps({"warm_start_s": round(start, 2), "prefill_512_tok_s": round(float(np.median(prefill)), 1),
                  "decode_1000_tok_s": round(float(np.median(decode)), 2)}))
"""


# The same measurement through llama-cpp-python on a GGUF: the same ids (the vocabulary is the checkpoint's, which
# the converter pads the tokenizer to), the same prefills and the same 16 decode steps.
LLAMA_RUN_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
t = time.perf_counter()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=2048, n_threads=2, n_threads_batch=2, n_batch=512, n_ubatch=512,
                      verbose=False)
start = time.perf_counter() - t
sync = lambda: llama_cpp.llama_synchronize(llm._ctx.ctx)
ids = np.random.RandomState(0).randint(0, int(sys.argv[2]), 1000).tolist()
prefill, decode = [], []
for _ in range(int(sys.argv[3])):
    llm.reset()
    t = time.perf_counter(); llm.eval(ids[:512]); sync(); prefill.append(512 / (time.perf_counter() - t))
    llm.eval(ids[512:1000]); sync()
    t = time.perf_counter()
    for i in range(16):
        llm.eval([ids[i]])
    sync()
    decode.append(16 / (time.perf_counter() - t))
print(json.dumps({"warm_start_s": round(start, 2), "prefill_512_tok_s": round(float(np.median(prefill)), 1),
                  "decode_1000_tok_s": round(float(np.median(decode)), 2), "llama_cpp_version": llama_cpp.__version__,
                  "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}))
"""


def build_gguf(model: Path, quant: str, convert: Path, out: Path) -> dict:
    """The checkpoint through llama.cpp's converter (bf16, exact) and llama-cpp-python's quantiser."""
    import llama_cpp

    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    full = out.with_suffix(".bf16.gguf")
    subprocess.run([sys.executable, str(convert), str(model), "--outtype", "bf16", "--outfile", str(full)],
                   cwd=convert.parent, check=True, capture_output=True)
    converted = time.perf_counter()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(full).encode(), str(out).encode(), params):
        raise SystemExit(f"llama.cpp could not quantise {full} to {quant}")
    full.unlink()
    wall = time.perf_counter() - start
    return {"folder": str(out), "wall_s": round(wall, 1),
            "stages_s": {"convert": round(converted - start, 1), "quantise": round(wall - (converted - start), 1)},
            "artefact_bytes": {out.name: out.stat().st_size}}


def gguf_decode_bytes(cfg: dict, path: Path, context: int = 1000) -> int:
    """Bytes one llama.cpp decode step reads: the GGUF's tensors, less an untied embedding, plus its float16 KV
    cache slots attended."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    embed = 0 if cfg["tie_word_embeddings"] else tensors["token_embd.weight"]
    kv = context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    return sum(tensors.values()) - embed + kv


def measure_llama_run(gguf: Path, cfg: dict, runs: int) -> dict:
    out = subprocess.run([sys.executable, "-c", LLAMA_RUN_SCRIPT, str(gguf), str(cfg["vocab_size"]), str(runs)],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"running {gguf} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kv_element_bytes(folder: Path) -> int:
    """Bytes of one KV cache element in the build at `folder`, from its manifest (float32 before it was named)."""
    settings = json.loads((folder / MANIFEST).read_text()).get("settings", {})
    return 4 if settings.get("kv_dtype", "f32") == "f32" else 2


def decode_bytes(cfg: dict, irpa_bytes: int, dtype: str, kv_bytes: int, context: int = 1000) -> int:
    """Bytes one decode step reads: the weights file, less an untied embedding (a step reads one of its rows),
    plus the KV cache slots attended (keys and values of every layer, `kv_bytes` an element)."""
    embed = 0
    if not cfg["tie_word_embeddings"]:
        per_weight = {"q8": 1.0, "q4": 0.625, "f16": 2.0, "bf16": 2.0, "f32": 4.0}[dtype]
        embed = int(cfg["vocab_size"] * cfg["hidden_size"] * per_weight)
    kv = context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_bytes
    return irpa_bytes - embed + kv


def measure_run(folder: Path, code: Path, cache: Path, runs: int) -> dict:
    env = {**os.environ, "EDDY_CACHE_DIR": str(cache), "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", RUN_SCRIPT, str(folder), str(runs)], cwd=code, env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"running {folder} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", action="append", choices=sorted(SIZES), help="repeatable (default llama-3.2-1b)")
    p.add_argument("--dtype", action="append", help="repeatable (default q4 and q8)")
    p.add_argument("--before", type=Path, help="a checkout of the code to compare with (built first)")
    p.add_argument("--llama-cpp", action="append", default=[], metavar="QUANT",
                   help="repeatable: also llama.cpp on a GGUF of the checkpoint in this type (e.g. Q4_K_M)")
    p.add_argument("--convert", type=Path, default=os.environ.get("LLAMA_CPP_CONVERT"),
                   help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERT)")
    p.add_argument("--runs", type=int, default=3, help="prefill and decode samples per build, medians (default 3)")
    p.add_argument("--label", default="", help="free text stored with the figures")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "scale.json"))
    a = p.parse_args()
    if a.llama_cpp and not (a.convert and Path(a.convert).is_file()):
        p.error("--llama-cpp needs --convert (llama.cpp's convert_hf_to_gguf.py)")
    codes = ([("before", a.before.resolve())] if a.before else []) + [("after", ROOT)]
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(out.read_text()) if out.exists() else {}
    rows = kept.get("results", [])
    done = {(r["size"], r["dtype"], r["code"]) for r in rows}
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth['gb_per_s']:.1f} GB/s", flush=True)

    def save() -> None:
        out.write_text(json.dumps({"machine": cpu_info(), "label": a.label, "bandwidth": bandwidth,
                                   "results": rows}, indent=1) + "\n")

    for size in a.size or ["llama-3.2-1b"]:
        cfg = SIZES[size]
        todo = [(d, label, code) for d in a.dtype or ["q4", "q8"] for label, code in codes]
        todo += [(q, "llama.cpp", None) for q in a.llama_cpp]
        todo = [t for t in todo if (size, t[0], t[1]) not in done]
        if not todo:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"eddy-scale-{size}-"))
        try:
            t = time.perf_counter()
            nbytes = write_checkpoint(work / size, cfg)
            print(f"{size}: random checkpoint {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
            for dtype, label, code in todo:
                cache = work / f"cache-{label}"
                if code is None:
                    result = build_gguf(work / size, dtype, Path(a.convert), cache / f"{size}-{dtype}.gguf")
                else:
                    result = measure_build(work / size, dtype, code, cache)
                # The bandwidth of the moment: on a shared host it moves between runs.
                result["bandwidth_gb_per_s"] = round(read_bandwidth()["gb_per_s"], 2)
                folder = Path(result.pop("folder"))
                if code is None:
                    result.update(measure_llama_run(folder, cfg, a.runs))
                    step = gguf_decode_bytes(cfg, folder)
                else:
                    result.update(measure_run(folder, code, cache, a.runs))
                    step = decode_bytes(cfg, result["artefact_bytes"].get("weights.irpa", 0), dtype,
                                        kv_element_bytes(folder))
                floor = result["bandwidth_gb_per_s"] * 1e9 / step
                result.update(decode_bytes_per_token=step, floor_tok_s=round(floor, 2),
                              decode_fraction_of_floor=round(result["decode_1000_tok_s"] / floor, 3))
                shutil.rmtree(cache)  # the artefacts, before the next build
                rows.append({"size": size, "dtype": dtype, "code": label, "checkpoint_bytes": nbytes, **result})
                save()
                print(json.dumps(rows[-1]), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'size':14} {'dtype':6} {'code':9} {'wall s':>7} {'tree GB':>7} {'at stage':>15} {'file GB':>7} "
          f"{'start s':>7} {'pf512/s':>7} {'dec/s':>6} {'GB/s':>5} {'floor':>6} {'of floor':>8}")
    for r in rows:
        weights = r["artefact_bytes"].get("weights.irpa") or sum(r["artefact_bytes"].values())
        print(f"{r['size']:14} {r['dtype']:6} {r['code']:9} {r['wall_s']:7.1f} {r.get('tree_peak_rss_gb', 0):7.2f} "
              f"{str(r.get('tree_peak_stage', '')):>15} {weights / 1e9:7.2f} {r.get('warm_start_s', 0):7.2f} "
              f"{r.get('prefill_512_tok_s', 0):7.1f} {r.get('decode_1000_tok_s', 0):6.2f} "
              f"{r.get('bandwidth_gb_per_s', bandwidth['gb_per_s']):5.1f} {r.get('floor_tok_s', 0):6.2f} "
              f"{r.get('decode_fraction_of_floor', 0):8.0%}")
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
