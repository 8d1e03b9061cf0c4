#!/usr/bin/env python3
"""Eddy's compiled module on a lent NVIDIA GPU, through IREE's cuda and vulkan drivers: a device check prepared here.

    EDDY_CACHE_DIR=/tmp/gpucheck-cache .venv/bin/python bench/gpu_check.py prepare [--dir .gpu]
    python3 bench/gpu_check.py run [--dir .gpu] [--out DIR] [--device gpu|cpu]

`prepare` (here, on the CPU, with torch and iree-compile) builds every variant below for its device (cuda or
vulkan) and, beside each model and weight type, the CPU build of the same settings: tiny-random, the default
model's shapes, and a Llama 3.2 1B and a Llama 3.1 8B at q4. Weights of hundreds of MB or gigabytes cannot travel,
so those entries get random weights made from a small manifest (name, dtype, shape, seed per entry) that the device
regenerates byte for byte. It runs the CPU builds on a fixed prefill and greedy decode steps and keeps their logits
as the reference, then copies what the device needs into .gpu/ and the iree-base-runtime wheel into .whl/.

`run` (on the device, python3 3.12, no torch, no iree.compiler) regenerates the random weights, lays the entries
out as a bundled-models root ($EDDY_BUNDLED_MODELS), opens each module through the engine on its device, compares
its logits with the reference, times it (decode at 128 and 1000, a 30-token turn after 1000, prefill 1024), runs
`eddy bench --device cuda` once, prints a table last and writes everything to $OUT/gpu_check.json. Each variant runs
in a child process with a time limit, so a module that crashes or hangs is recorded and the rest still runs.
`run --device cpu` does the same with the CPU builds (a self-test of the script, here).

The device call (a later session, one call; `run` stops itself after --budget seconds, 500 by default):

    run(command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; set -o pipefail; PYTHONUNBUFFERED=1 timeout 530 python3 bench/gpu_check.py run --dir .gpu --out $OUT 2>&1 | tee $OUT/gpu_check.log", carry=[".whl", ".gpu"], timeout_s=545)

docs/GPU.md describes the output (the table's columns, the JSON's keys).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.abc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY = "tiny-random"
# Whole checkpoints' shapes with random weights (engine/checkpoint/shapes.py): the sizes people chat with.
LLAMA_1B, LLAMA_8B = "llama-3.2-1b", "llama-3.1-8b"
SHAPED = (LLAMA_1B, LLAMA_8B)
GENERIC_CPU = "x86-64-v2"  # a CPU target without hand-written products (engine/devices.py's DOT_FORMS)
# (variant, model, dtype, device, GPU target, weights that travel, timed), in the order they run: what matters most
# first, as a run short of time skips the rest. sm_89 is the newest CUDA target iree-compile 3.13 knows that Hopper
# runs (the driver compiles its PTX for sm_90 at load); "ada" is the Vulkan target engine/devices.py gives an H100 or
# H200 by name. Every GPU variant takes a float32 KV cache (cuda's own choice, "-kvf32"), vulkan's too, so the two
# devices compare like for like and one CPU build of each model and weight type is the reference of both.
VARIANTS = (
    ("tiny-f32-sm_89", TINY, "f32", "cuda", "sm_89", "real", False),
    ("tiny-f32-vulkan", TINY, "f32", "vulkan", "ada", "real", False),
    ("smollm2-f16-sm_89", DEFAULT_MODEL, "f16-kvf32", "cuda", "sm_89", "random", True),
    ("smollm2-f16-vulkan", DEFAULT_MODEL, "f16-kvf32", "vulkan", "ada", "random", True),
    ("llama1b-q4-sm_89", LLAMA_1B, "q4-kvf32", "cuda", "sm_89", "random", True),
    ("llama8b-q4-sm_89", LLAMA_8B, "q4-kvf32", "cuda", "sm_89", "random", True),
    ("llama1b-q4-vulkan", LLAMA_1B, "q4-kvf32", "vulkan", "ada", "random", True),
    ("llama8b-q4-vulkan", LLAMA_8B, "q4-kvf32", "vulkan", "ada", "random", True),
    ("smollm2-q4-sm_89", DEFAULT_MODEL, "q4-kvf32", "cuda", "sm_89", "random", True),
    ("smollm2-q4-vulkan", DEFAULT_MODEL, "q4-kvf32", "vulkan", "ada", "random", True),
)
# The one `eddy bench` runs on.
BENCH_VARIANT = "smollm2-f16-sm_89"
# Profiled kernel by kernel (Nsight Compute; iree-profile on a CPU), when time is left after every variant ran.
PROFILED = ("smollm2-f16-sm_89", "llama8b-q4-sm_89")
PREFILL_IDS = 64
DECODE_STEPS = 8
# Issue 46's targets, by model, beside each figure: (key in a timing dict, comparison, value, unit). Vulkan's is a
# ratio: within 1.5x of cuda's time on the same GPU (VULKAN_WITHIN).
TARGETS = {
    DEFAULT_MODEL: (("decode_128_tok_s", ">=", 1000.0, "tok/s"), ("decode_1000_tok_s", ">=", 1000.0, "tok/s"),
                    ("turn_30_after_1000_ms", "<=", 5.0, "ms"), ("prefill_1024_tok_s", ">=", 20000.0, "tok/s")),
    LLAMA_1B: (("decode_1000_tok_s", ">=", 400.0, "tok/s"),),
    LLAMA_8B: (("decode_1000_tok_s", ">=", 150.0, "tok/s"),),
}
VULKAN_WITHIN = 1.5
# Logits against the CPU build's: f32 to 1e-4 absolute; the narrower types by the relative error of each call's
# logits (||a - b|| / ||b||). Both sides read the same stored weights and compute in float32, so the narrower
# types should land far inside theirs; the tolerance leaves room for another order of accumulation.
TOLERANCES = {"f32": ("max_abs", 1e-4), "f16": ("rel", 1e-2), "bf16": ("rel", 1e-2), "q8": ("rel", 1e-2),
              "q4": ("rel", 2e-2)}
# What the device machine does not have: `run` refuses to import them, so a self-test here fails as it would there.
NOT_ON_DEVICE = ("torch", "iree.compiler", "iree.turbine", "transformers", "gguf", "PySide6", "qasync")
WHEEL = "iree-base-runtime==3.13.0"
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64")
EXCLUDES = ("/.whl/", "/.gpu/")
DEVICE_COMMAND = ('python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '
                  '/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; set -o pipefail; PYTHONUNBUFFERED=1 '
                  'timeout 530 python3 bench/gpu_check.py run --dir .gpu --out $OUT 2>&1 | tee $OUT/gpu_check.log')


# ----------------------------------------------------------------------------------------- random weights

def entry_spec(name: str, length: int, metadata: bytes | str) -> dict[str, Any]:
    """An .irpa entry's dtype and shape from turbine's metadata ('PYTORCH:{"dtype": "float32", "shape": [..]}')."""
    text = metadata.decode() if isinstance(metadata, bytes) else metadata
    meta = json.loads(text.split(":", 1)[1])
    return {"name": name, "length": int(length), "metadata": text, "dtype": meta["dtype"],
            "shape": [int(n) for n in meta["shape"]]}


def weight_plan(entries: list[dict[str, Any]], seed: int = 17) -> dict[str, Any]:
    """The random-weights manifest: per entry its name, dtype, shape, metadata, seed and value range.

    Matrices are uniform with standard deviation 0.02 (embeddings included), norm weights 1 +- 0.1, biases small,
    int8 codes (q8) uniform over -127..127 with positive per-row scales that give the same 0.02 spread: the
    residual stream stays near unit size over 30 layers, so logits are finite and the greedy token stands out."""
    plan = []
    code_std = 73.6  # of int8 codes uniform on -127..127
    q4_scale = 0.02 / 4.61  # 4.61: the standard deviation of 4-bit codes uniform on 0..15
    for i, e in enumerate(entries):
        spec = dict(e, seed=seed * 100_000 + i)
        name, dtype, shape = e["name"], e["dtype"], e["shape"]
        # A tiled q4 matrix's numbers are 8-bit factors of float16 units (engine/exporter/q4.py, split_numbers): the
        # same scales and offsets as the rows layout's, to within the factors' spread.
        # Units [tiles, supers, 3, 16] (scale's unit, offset's unit and base) are one per super-block: constant
        # numbers of the right size (scale ~q4_scale, offset ~-7.5 q4_scale), the factors random.
        if name.endswith((".scale", ".offset")) and dtype == "int8":  # unsigned factors 150..250 (bytes)
            spec.update(dist="uniform", center=200.0, half=50.0)
        elif name.endswith(".units"):
            spec.update(dist="units", scale_unit=q4_scale / 200, offset_unit=0.2 * q4_scale / 200,
                        offset_base=-7.6 * q4_scale)
        elif dtype == "int8":
            spec.update(dist="int8")
        elif name.endswith(".scale") and dtype == "float16":  # q4 group scales: codes 0..15, std 4.6
            spec.update(dist="uniform", center=q4_scale, half=0.1 * q4_scale)
        elif name.endswith(".offset"):  # q4 group offsets: w = scale * code + offset, centred on 0
            spec.update(dist="uniform", center=-7.5 * q4_scale, half=0.1 * q4_scale)
        elif name.endswith(".scale"):
            c = 0.02 / code_std
            spec.update(dist="uniform", center=c, half=0.1 * c)
        elif name.endswith(".bias"):
            spec.update(dist="uniform", center=0.0, half=0.02)
        elif len(shape) == 1:  # RMSNorm weights
            spec.update(dist="uniform", center=1.0, half=0.1)
        else:
            spec.update(dist="uniform", center=0.0, half=0.02 * 3 ** 0.5)
        plan.append(spec)
    return {"version": 2, "generator": "numpy default_rng(seed).bit_generator.random_raw: 24-bit uniforms "
                                        "(float32 math), int8 codes from the top byte", "entries": plan}


NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "int64": np.int64}


GENERATE_CHUNK = 1 << 24  # elements drawn at a time: an 8B model's 1 GB embedding would take 8 bytes an element


def generate(spec: dict[str, Any]) -> np.ndarray:
    """One entry's values, the same bytes on any machine: only PCG64's raw stream (which numpy keeps stable across
    versions) and exactly rounded float32 arithmetic go into them. Drawn in chunks of one stream, which gives the
    numbers one draw would."""
    n = int(np.prod(spec["shape"], dtype=np.int64))
    if spec["dist"] == "units":
        units = np.array([spec["scale_unit"], spec["offset_unit"], spec["offset_base"]], dtype=np.float16)
        out = np.broadcast_to(units.reshape(1, 1, 3, 1), spec["shape"]).copy()
    else:
        bits = np.random.default_rng(spec["seed"]).bit_generator
        out = np.empty(n, dtype=NP_DTYPES[spec["dtype"]])
        for at in range(0, n, GENERATE_CHUNK):
            out[at:at + GENERATE_CHUNK] = _values(spec, bits.random_raw(min(GENERATE_CHUNK, n - at)))
    out = out.reshape(spec["shape"])
    if out.nbytes != spec["length"]:
        raise ValueError(f"{spec['name']}: {out.nbytes} bytes generated, the entry holds {spec['length']}")
    return out


def _values(spec: dict[str, Any], raw: np.ndarray) -> np.ndarray:
    """Values of spec's distribution from raw 64-bit draws, one each."""
    if spec["dist"] == "int8":
        codes = (raw >> np.uint64(56)).astype(np.uint8).view(np.int8)
        return np.maximum(codes, np.int8(-127))
    u = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)  # [-1, 1)
    out = np.float32(spec["center"]) + np.float32(spec["half"]) * u
    if spec["dtype"] == "int8":  # 8-bit factors; an unsigned one (over 127) is kept as its byte
        return np.round(out).astype(np.int16).astype(np.uint8).view(np.int8)
    return out.astype(NP_DTYPES[spec["dtype"]])


def write_irpa(plan: dict[str, Any], path: Path) -> str:
    """Writes the plan's weights as an .irpa (engine/exporter/irpa.py's writer, torch-free); returns its sha256."""
    from engine.exporter.irpa import ArchiveWriter, Entry

    entries = plan["entries"]
    with ArchiveWriter(path, [Entry(e["name"], e["length"], e["metadata"].encode()) for e in entries]) as archive:
        for e in entries:
            archive.write(e["name"], np.ascontiguousarray(generate(e)).reshape(-1).view(np.uint8))
    return sha256(path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- comparison

def compare(dev: Any, ref: Any, dtype: str) -> dict[str, Any]:
    """Device logits [calls, vocab] against the reference's: finite, within the dtype's tolerance, same greedy token.

    A different greedy token is forgiven only where the reference itself has the two tokens within the tolerance
    (a tie no build could be expected to break the same way); such rows are listed as near_ties."""
    kind, tol = TOLERANCES[dtype.partition("-kv")[0]]
    a, b = np.asarray(dev, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    out: dict[str, Any] = {"rule": f"{'max |a-b|' if kind == 'max_abs' else '||a-b||/||b|| per call'} <= {tol:g}, "
                                   f"greedy token equal", "tolerance": tol, "rows": int(b.shape[0]) if b.ndim else 0}
    if a.shape != b.shape:
        return {**out, "passed": False, "why": f"logits of shape {a.shape}, the reference's {b.shape}"}
    finite = bool(np.isfinite(a).all())
    out["finite"] = finite
    if not finite:
        bad = int(np.count_nonzero(~np.isfinite(a)))
        return {**out, "passed": False, "why": f"{bad} non-finite logits (NaN or inf)"}
    diff = np.abs(a - b)
    rel = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    out["max_abs"] = float(diff.max())
    out["rel"] = float(rel.max())
    top_a, top_b = a.argmax(axis=1), b.argmax(axis=1)
    rows = np.arange(len(b))
    margin = b[rows, top_b] - b[rows, top_a]  # how much the reference prefers its token to the device's
    scale = np.sqrt(np.mean(b * b, axis=1))
    tie = np.where(kind == "max_abs", tol, tol * scale)
    mismatch = [int(i) for i in np.nonzero((top_a != top_b) & (margin > tie))[0]]
    near = [int(i) for i in np.nonzero((top_a != top_b) & (margin <= tie))[0]]
    second = np.sort(b, axis=1)[:, -2]
    out.update(greedy_equal=int(np.count_nonzero(top_a == top_b)), greedy_mismatch=mismatch, near_ties=near,
               ref_margin_min=float((b[rows, top_b] - second).min()))
    within = out["max_abs"] <= tol if kind == "max_abs" else out["rel"] <= tol
    why = []
    if not within:
        why.append(f"{'max |a-b|' if kind == 'max_abs' else 'relative error'} "
                   f"{out['max_abs'] if kind == 'max_abs' else out['rel']:.3g} > {tol:g}")
    if mismatch:
        why.append(f"greedy token differs at call(s) {mismatch}")
    out["passed"] = within and not mismatch
    if why:
        out["why"] = "; ".join(why)
    return out


def replay(engine: Any, ids: list[int], tokens: list[int] | None, steps: int = DECODE_STEPS) -> tuple[np.ndarray, list[int]]:
    """A prefill of `ids`, then `steps` decode calls: of `tokens` (the reference's greedy tokens, so an early
    difference does not change every later input) or, with tokens None, greedy. Returns the last-position logits of
    every call [1 + steps, vocab] and the tokens decoded."""
    rows = [np.array(engine.prefill(ids), dtype=np.float32)]
    fed = []
    for i in range(steps):
        token = int(np.argmax(rows[-1])) if tokens is None else int(tokens[i])
        fed.append(token)
        rows.append(np.array(engine.decode(token), dtype=np.float32))
    return np.stack(rows), fed


def prefill_ids(n: int, vocab: int, seed: int = 5) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(100, min(vocab, 40000), n)]


# ------------------------------------------------------------------------------------------------ timing

def time_engine(engine: Any, vocab: int, reps: int) -> dict[str, Any]:
    """bench/peers.py's workload on one engine: prefill 128/512/1024 into an empty cache, a 30-token turn after 1000
    tokens of history (the history's cache restored before each), 64 greedy decode steps at 128 and 1000 tokens of
    context. One untimed run, then medians of `reps`."""
    ids = prefill_ids(2048, vocab, seed=11)
    out: dict[str, Any] = {"reps": reps}

    def median_s(fn, setup=None) -> float:
        times = []
        for i in range(reps + 1):
            if setup:
                setup()
            start = time.perf_counter()
            fn()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    engine.reset()
    engine.prefill(ids[:64])
    for n in (128, 512, 1024):
        out[f"prefill_{n}_tok_s"] = n / median_s(lambda n=n: (engine.reset(), engine.prefill(ids[:n])))
    engine.reset()
    engine.prefill(ids[:1000])
    history = engine.snapshot()
    turn = ids[1000:1030]
    out["turn_30_after_1000_ms"] = 1e3 * median_s(lambda: engine.prefill(turn), setup=lambda: engine.restore(history))
    for ctx in (128, 1000):
        engine.reset()
        first = engine.prefill(ids[:ctx])
        kept = engine.snapshot()

        def decode64() -> None:
            logits = first
            for _ in range(64):
                logits = engine.decode(int(np.argmax(logits)))

        out[f"decode_{ctx}_tok_s"] = 64 / median_s(decode64, setup=lambda kept=kept: engine.restore(kept))
    return out


def meets(value: float | None, op: str, target: float) -> bool | None:
    if value is None:
        return None
    return value >= target if op == ">=" else value <= target


# --------------------------------------------------------------------------------------------- prepare

def _slug(model: str) -> str:
    return {DEFAULT_MODEL: "smollm2", TINY: "tiny", LLAMA_1B: "llama1b", LLAMA_8B: "llama8b"}.get(model, model)


def gpu_key(device: str, target: str) -> str:
    """A GPU build's name within its group: "sm_89" (cuda), "vulkan-ada"."""
    return target if device == "cuda" else f"{device}-{target}"


def _group_name(model: str, dtype: str) -> str:
    return f"{_slug(model)}-{dtype}"


def _log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_manifest(folder: Path, model: str, cfg: dict, settings: Any, seconds: dict) -> None:
    """The manifest ensure_artefacts writes (engine/artefacts/store.py), then sealed as a package's entries are."""
    from engine.artefacts.store import BUILT_FILES, MANIFEST, file_digest, seal

    manifest = {"model": model, "config": cfg, "settings": settings.to_dict(), "build_seconds": seconds,
                "files": {n: {"size": (folder / n).stat().st_size, "digest": file_digest(folder / n)}
                          for n in BUILT_FILES}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    seal(folder)


def _valid(folder: Path) -> bool:
    from engine.artefacts.store import read_manifest
    from engine.errors import ArtefactError

    try:
        read_manifest(folder)
        return True
    except ArtefactError:
        return False


def shaped_source(model: str, work: Path) -> Any:
    """A checkpoint of one of SHAPED's shapes that is config.json and the default model's tokenizer (its ids need
    not cover the vocabulary): the weights are random, written from the plan, so none are read."""
    from engine.checkpoint import ModelSource, resolve_model, save_tokenizer
    from engine.checkpoint.shapes import config

    folder = work / "sources" / model
    if not (folder / "tokenizer_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config(model)))
        save_tokenizer(resolve_model(None), folder / "default")
        shutil.copy(folder / "default" / "tokenizer.json", folder / "tokenizer.json")
        chat = json.loads((folder / "default" / "chat.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {k: chat[k] for k in ("bos_token", "eos_token", "chat_template") if k in chat}))
    return ModelSource(model, "hf", folder)


def build_group(model: str, dtype: str, targets: list[tuple[str, str]], weights: str, work: Path) -> dict[str, Any]:
    """One model and weight type, built for the CPU and for each (device, target) of `targets`: {"cpu": folder,
    gpu_key(device, target): folder or an error string, "plan": random-weights manifest or None}. Folders already
    complete are kept (a rerun builds only what is missing). The export and iree-compile calls are the engine's own
    (engine/exporter/export.py); the MLIR depends on the device but not on its target, so it is traced once per device,
    and the weights (the same entries for every device, checked) are written once."""
    from dataclasses import replace

    from engine.checkpoint import open_tensors, read_config, resolve_model, save_tokenizer
    from engine.config import QUANTISED, BuildSettings, ModelConfig, auto_kv_dtype

    group = _group_name(model, dtype)
    dtype, _, kv = dtype.partition("-kv")
    # The KV type as `eddy` resolves it (BuildSettings.for_source): an entry whose manifest said "auto" was not
    # found by `eddy bench --device cuda`, which asks for the resolved one.
    base = BuildSettings(dtype=dtype, kv_dtype=kv or auto_kv_dtype(dtype))
    # The reference for q4 and q8 is the CPU build with the generic products, which compute in float32 as the GPU
    # build does; the hand-written ones quantise x to int8 per group of 32 (llama.cpp's way), which moves the
    # logits by ~1 % relative, more than any GPU difference worth finding.
    cpu = replace(base, target_cpu=GENERIC_CPU) if dtype in QUANTISED else base
    settings = {"cpu": cpu, **{gpu_key(d, t): replace(base, device=d, gpu_target=t) for d, t in targets}}
    folders = {k: work / f"{group}-{'cpu-generic' if k == 'cpu' and dtype in QUANTISED else k}" for k in settings}
    plan_file = work / f"{group}.weights.json"
    result: dict[str, Any] = {k: folders[k] for k in settings}
    result["plan"] = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    if all(_valid(f) for f in folders.values()) and (weights == "real" or result["plan"]):
        _log(f"{group}: built already ({', '.join(settings)})")
        return result

    import iree.turbine.aot as aot

    from engine.exporter import export
    from engine.exporter.model import StreamingLlama
    from engine.exporter.weights_file import archive_entries, write_weights

    source = shaped_source(model, work) if model in SHAPED else resolve_model(model)
    cfg = ModelConfig.from_hf(read_config(source))
    cfg.check_build(base)
    stage = work / f"{group}.staging"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    # The export depends on the device (its KernelPlan, engine/exporter/kernels/plan.py: the CPU's hand-written
    # products and attention ops, the generic forms elsewhere; a GPU's fixed call shapes), not on its target: one
    # export per device.
    by_device: dict[str, list[str]] = {}
    for key, s in settings.items():
        by_device.setdefault(s.device, []).append(key)
    export_s, save_s, entries_seen = 0.0, 0.0, None
    def failed(key: str) -> Path:  # a build that failed is not tried again on a rerun: delete this file to retry
        return folders[key].with_name(folders[key].name + ".failed")

    for device, keys in by_device.items():
        for key in keys:
            if not _valid(folders[key]) and failed(key).is_file():
                result[key] = failed(key).read_text()
        if all(_valid(folders[k]) or failed(k).is_file() for k in keys) and (weights == "real" or result["plan"]):
            continue
        t = time.perf_counter()
        skeleton = StreamingLlama.skeleton(cfg, settings[keys[0]])
        entries = [entry_spec(e.name, e.length, e.metadata) for e in archive_entries(skeleton)]
        if entries_seen is not None and entries != entries_seen:
            raise RuntimeError(f"{group}: the {device} build's weights differ from the other device's")
        entries_seen = entries
        _log(f"{group}: exporting for {device} ({cfg.n_layers} layers)")
        aot.externalize_module_parameters(skeleton)
        output = export.export_module(skeleton)
        mlir = stage / f"module.{device}.mlir"
        mlir.write_text(export.export_text(output))
        del output
        export_s += time.perf_counter() - t
        irpa = stage / "weights.irpa"
        if not irpa.exists():
            t = time.perf_counter()
            if weights == "random":
                plan = weight_plan(entries)
                plan["model"], plan["dtype"] = model, settings["cpu"].dtype
                plan["sha256"] = write_irpa(plan, irpa)
                plan_file.write_text(json.dumps(plan))
                result["plan"] = plan
            else:
                write_weights(skeleton, open_tensors(source), irpa)
            save_s = time.perf_counter() - t
            save_tokenizer(source, stage)
        del skeleton
        for key in keys:
            s, folder = settings[key], folders[key]
            if _valid(folder) or failed(key).is_file():
                continue
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            _log(f"{group}: compiling for {key}")
            t = time.perf_counter()
            try:
                export.compile_mlir(mlir, folder / "module.vmfb", s.device, lambda *a: None, lambda: False,
                                    5.0 + 1.5 * cfg.n_layers, s.target)
            except Exception as e:  # noqa: BLE001 - one target that does not compile must not stop the others
                result[key] = f"{type(e).__name__}: {e}"
                failed(key).write_text(result[key])
                _log(f"{group}: {key} failed: {e}")
                shutil.rmtree(folder, ignore_errors=True)
                continue
            compile_s = time.perf_counter() - t
            os.link(irpa, folder / "weights.irpa")  # one copy of the weights on disk for the group
            for name in ("tokenizer.json", "chat.json"):
                shutil.copy(stage / name, folder / name)
            _write_manifest(folder, source.name, cfg.to_dict(), s,
                            {"export": export_s, "save": save_s, "compile": compile_s})
            _log(f"{group}: {key} built in {compile_s:.0f} s (exports so far {export_s:.0f} s)")
    shutil.rmtree(stage, ignore_errors=True)
    return result


def _blob(store: Path, src: Path, squeeze: bool = True) -> str:
    """Copies src into the content-addressed store (gzipped where that saves a fifth); returns its name there."""
    digest = sha256(src)[:24]
    raw = src.read_bytes()
    packed = gzip.compress(raw, compresslevel=9, mtime=0) if squeeze else raw
    name = f"{digest}.gz" if squeeze and len(packed) < 0.8 * len(raw) else digest
    path = store / name
    if not path.exists():
        path.write_bytes(packed if name.endswith(".gz") else raw)
    return name


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def tracked_bytes() -> int:
    """What travels besides the carried folders: tracked files and untracked ones that are not ignored."""
    cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    names = subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in set(names) if n and (ROOT / n.decode()).is_file())


def _exclude() -> None:
    path = ROOT / ".git" / "info" / "exclude"
    path.parent.mkdir(parents=True, exist_ok=True)
    have = path.read_text().splitlines() if path.exists() else []
    missing = [line for line in EXCLUDES if line not in have]
    if missing:
        with path.open("a") as f:
            if have and not path.read_text().endswith("\n"):
                f.write("\n")
            f.write("".join(line + "\n" for line in missing))


def fetch_wheel(dest: Path) -> Path:
    """The iree-base-runtime wheel for the device's python3 (3.12, manylinux x86-64); its needs (numpy, ml_dtypes)
    are there already."""
    name = WHEEL.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *[a for p in PIP_PLATFORMS for a in ("--platform", p)], "-d", str(dest), WHEEL]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob(f"{name}-*.whl"))[0]


def prepare(args: argparse.Namespace) -> int:
    os.environ.setdefault("EDDY_CACHE_DIR", "/tmp/gpucheck-cache")  # private: the builds never land in a user's cache
    from engine.artefacts.store import export_code_hash
    from engine.loader import open_folder
    from engine.paths import cache_dir

    out = (ROOT / args.dir).resolve()
    # One folder per version of the export code (engine/artefacts/store.py's hash): a rerun after the model, the
    # export or the compile flags changed builds afresh instead of reusing stale entries.
    work = Path(args.work) if args.work else cache_dir() / "gpu-check" / export_code_hash()
    work.mkdir(parents=True, exist_ok=True)
    _exclude()
    wheel = fetch_wheel(ROOT / ".whl")
    _log(f"wheel: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB); builds under {work}")

    groups: dict[tuple[str, str], dict[str, Any]] = {}
    # The whole checkpoints' shapes last, the biggest last of all: a prepare cut short still has the rest.
    for _, model, dtype, device, target, weights, _ in sorted(VARIANTS, key=lambda v: (v[1] in SHAPED, v[1] == LLAMA_8B)):
        g = groups.setdefault((model, dtype), {"targets": [], "weights": weights})
        if (device, target) not in g["targets"]:
            g["targets"].append((device, target))
    ids = prefill_ids(PREFILL_IDS, 49152)  # ids under 40000: every model's vocabulary holds them
    built: dict[tuple[str, str], dict[str, Any]] = {}
    refs: dict[tuple[str, str], dict[str, Any]] = {}
    for (model, dtype), g in groups.items():
        if args.only and _group_name(model, dtype) not in args.only:
            continue
        try:
            built[model, dtype] = b = build_group(model, dtype, g["targets"], g["weights"], work)
        except Exception as e:  # noqa: BLE001
            _log(f"{_group_name(model, dtype)}: build failed: {e}")
            built[model, dtype] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if not isinstance(b["cpu"], Path):  # its variants still run and are timed, their logits unchecked
            _log(f"{_group_name(model, dtype)}: no CPU reference: {b['cpu']}")
            continue
        ref_file = work / f"{b['cpu'].name}.ref.npz"
        if not ref_file.is_file():
            loaded = open_folder(b["cpu"])
            logits, tokens = replay(loaded.engine, ids, None)
            np.savez(ref_file, logits=logits, tokens=np.array(tokens), ids=np.array(ids))
            del loaded
        ref = np.load(ref_file)
        refs[model, dtype] = {"logits": ref["logits"], "tokens": [int(t) for t in ref["tokens"]]}
        _log(f"{_group_name(model, dtype)}: reference greedy tokens {refs[model, dtype]['tokens']}")

    # .gpu/: what the device needs, each file once (the tokenizer and tiny's weights are shared by several entries).
    shutil.rmtree(out, ignore_errors=True)
    for sub in ("blobs", "weights", "refs"):
        (out / sub).mkdir(parents=True)
    plan: dict[str, Any] = {"version": 2, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "prefill_ids": ids,
                            "decode_steps": DECODE_STEPS, "bench_variant": BENCH_VARIANT, "cpu_builds": str(work),
                            "variants": []}
    for name, model, dtype, device, target, weights, timed in VARIANTS:
        b = built.get((model, dtype))
        if b is None:
            continue
        group = _group_name(model, dtype)
        v: dict[str, Any] = {"name": name, "model": model, "dtype": dtype, "device": device, "gpu_target": target,
                             "weights": weights, "timed": timed, "group": group}
        folder = b.get(gpu_key(device, target))
        if not isinstance(folder, Path):
            v["build_error"] = b.get(gpu_key(device, target)) or b.get("error") or "not built"
            plan["variants"].append(v)
            continue
        v["files"] = {n: _blob(out / "blobs", folder / n) for n in ("manifest.json", "module.vmfb", "tokenizer.json",
                                                                      "chat.json")}
        if weights == "real":
            v["files"]["weights.irpa"] = _blob(out / "blobs", folder / "weights.irpa")
        else:
            (out / "weights" / f"{group}.json").write_text(json.dumps(b["plan"]))
            v["weights_plan"] = f"weights/{group}.json"
        if (model, dtype) not in refs:
            v["reference"], v["no_reference"] = None, b["cpu"] if isinstance(b["cpu"], str) else "no CPU build"
            plan["variants"].append(v)
            continue
        v["cpu_entry"] = b["cpu"].name
        ref_name = f"refs/{group}.npy"
        if not (out / ref_name).exists():
            np.save(out / ref_name, refs[model, dtype]["logits"].astype(np.float32))
        v["reference"], v["ref_tokens"] = ref_name, refs[model, dtype]["tokens"]
        plan["variants"].append(v)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))

    gpu, whl, tracked = _tree_bytes(out), _tree_bytes(ROOT / ".whl"), tracked_bytes()
    total = gpu + whl + tracked
    _log(f"sizes: .gpu {gpu / 2**20:.1f} MiB, .whl {whl / 2**20:.1f} MiB, the working tree (tracked files and "
         f"untracked ones not ignored) {tracked / 2**20:.1f} MiB: {total / 2**20:.1f} MiB of the 64 MiB a call carries")
    for v in plan["variants"]:
        _log(f"  {v['name']}: {'BUILD FAILED: ' + v['build_error'] if 'build_error' in v else 'ready'}")
    print("\nThe device call:\n  run(command=" + json.dumps(DEVICE_COMMAND) + ', carry=[".whl", ".gpu"], timeout_s=545)')
    if total > 56 * 2**20:
        _log("WARNING: close to the 64 MiB limit")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------- run

class _NotOnDevice(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: D102
        if any(name == m or name.startswith(m + ".") for m in NOT_ON_DEVICE):
            raise ImportError(f"gpu_check run: {name} is not on the device machine, and run must not need it")
        return None


def block_compiler() -> None:
    if not any(isinstance(f, _NotOnDevice) for f in sys.meta_path):
        sys.meta_path.insert(0, _NotOnDevice())


def _guard(record: dict, key: str, fn, *a, **kw) -> Any:
    """Runs one step; its result or its error (with the traceback's tail) goes into record[key]."""
    start = time.perf_counter()
    try:
        value = fn(*a, **kw)
        record[key] = {"ok": True, "seconds": round(time.perf_counter() - start, 3), **(value or {})}
        return value
    except BaseException as e:  # noqa: BLE001 - every step is recorded, whatever it raises
        if isinstance(e, KeyboardInterrupt):
            raise
        record[key] = {"ok": False, "seconds": round(time.perf_counter() - start, 3), "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-2000:]}
        _log(f"{key}: FAILED: {type(e).__name__}: {e}")
        return None


def _sh(cmd: list[str], timeout: float = 30) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout.strip() or p.stderr.strip())[:2000]
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({type(e).__name__}: {e})"


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    import iree.runtime as rt

    info: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__}
    info["nvidia_smi"] = _sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                              "--format=csv,noheader"])
    try:
        info["iree_runtime"] = metadata.version("iree-base-runtime")
    except metadata.PackageNotFoundError:
        info["iree_runtime"] = "unknown"
    try:
        from iree.runtime import version as v

        info["iree_runtime_build"] = getattr(v, "VERSION", "")
    except ImportError:
        pass
    info["iree_drivers"] = list(rt.query_available_drivers())
    try:
        from engine.gpu import probe

        gpus, why = probe()
        info["engine_gpus"] = [{"name": g.name, "compute_capability": f"{g.major}.{g.minor}", "memory": g.memory}
                               for g in gpus]
        info["engine_gpus_why_none"] = why
    except Exception as e:  # noqa: BLE001
        info["engine_gpus"] = f"{type(e).__name__}: {e}"
    try:  # the Vulkan devices IREE's driver sees (the NVIDIA driver's Vulkan ICD, where the machine has it)
        from engine.gpu import vulkan_probe

        found, why = vulkan_probe()
        info["vulkan_devices"], info["vulkan_why_none"] = [g.name for g in found], why
    except Exception as e:  # noqa: BLE001
        info["vulkan_devices"] = f"{type(e).__name__}: {e}"
    info["vulkan_icds"] = sorted(str(f) for d in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d")
                                 for f in Path(d).glob("*.json"))
    return info


def lay_out(gpu_dir: Path, plan: dict, v: dict, dest: Path, mode: str) -> dict[str, Any]:
    """One entry of the bundled-models root: the carried files (mode "gpu") or the CPU build of the same settings
    ("cpu"), and the weights, regenerated for random ones (once per group: its cuda and vulkan entries share the
    file); then checked in full as a package's entries are."""
    from engine.artefacts.store import read_manifest

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    info: dict[str, Any] = {}
    if mode == "gpu":
        for name, blob in v["files"].items():
            data = (gpu_dir / "blobs" / blob).read_bytes()
            (dest / name).write_bytes(gzip.decompress(data) if blob.endswith(".gz") else data)
    else:
        cpu = Path(plan["cpu_builds"]) / v["cpu_entry"]
        for name in ("manifest.json", "module.vmfb", "tokenizer.json", "chat.json"):
            shutil.copy(cpu / name, dest / name)
        if v["weights"] == "real":
            shutil.copy(cpu / "weights.irpa", dest / "weights.irpa")
    if v["weights"] == "random":
        wplan = json.loads((gpu_dir / v["weights_plan"]).read_text())
        shared = dest.parent.parent / "weights" / f"{v['group']}.irpa"
        if not shared.is_file():
            shared.parent.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            part = shared.with_suffix(".part")
            digest = write_irpa(wplan, part)
            info.update(regenerate_s=round(time.perf_counter() - t, 2), irpa_sha256_matches=digest == wplan["sha256"])
            if digest != wplan["sha256"]:
                raise RuntimeError(f"the regenerated weights differ from prepare's (sha256 {digest[:12]} against "
                                   f"{wplan['sha256'][:12]}): numpy's generator gave other numbers here")
            part.replace(shared)
        os.link(shared, dest / "weights.irpa")
        info["irpa_bytes"] = shared.stat().st_size
    read_manifest(dest, full=True)  # what find_bundled checks: every file's sha256
    info["checked"] = True
    return info


def variant_child(args: argparse.Namespace) -> int:
    """One variant in its own process: open through the engine, compare with the reference, time it."""
    block_compiler()
    from engine.loader import open_folder

    gpu_dir = Path(args.dir)
    plan = json.loads((gpu_dir / "plan.json").read_text())
    v = next(x for x in plan["variants"] if x["name"] == args.name)
    folder = Path(args.work) / "models" / v["name"]
    res: dict[str, Any] = {}
    result_file = Path(args.result)

    def save() -> None:
        result_file.write_text(json.dumps(res, indent=1))

    held: dict[str, Any] = {}

    def load() -> dict:
        t = time.perf_counter()
        held["model"] = open_folder(folder)
        eng = held["model"].engine
        try:
            from engine.gpu import device_name

            where = device_name(eng.settings)
        except Exception:  # noqa: BLE001
            where = eng.settings.device
        return {"open_s": round(time.perf_counter() - t, 3), "device": where, "settings": eng.settings.to_dict()}

    _guard(res, "load", load)
    save()
    if not res["load"]["ok"]:
        return 0
    eng = held["model"].engine

    def check() -> dict:
        ref = np.load(gpu_dir / v["reference"])
        t = time.perf_counter()
        rows, _ = replay(eng, plan["prefill_ids"], v["ref_tokens"], plan["decode_steps"])
        c = compare(rows, ref, v["dtype"])
        c["first_calls_s"] = round(time.perf_counter() - t, 3)
        c["greedy_device"] = [int(t) for t in rows.argmax(axis=1)]
        c["greedy_reference"] = [int(t) for t in ref.argmax(axis=1)]
        return c

    if v.get("reference") is None:
        res["check"] = {"skipped": f"no CPU reference to compare with: {v.get('no_reference', '')[:300]}"}
    else:
        _guard(res, "check", check)
    save()
    if v["timed"] and not args.no_time:
        _guard(res, "timing", lambda: time_engine(eng, eng.cfg.vocab_size, args.reps))
        save()
    if args.inputs:
        _guard(res, "profile_inputs", capture_inputs, eng, Path(args.inputs))
        save()
    _log(f"{v['name']}: check {'skipped' if 'skipped' in res['check'] else 'passed' if res['check'].get('passed') else 'FAILED'}"
         + (f", timing {'ok' if res.get('timing', {}).get('ok') else 'FAILED'}" if "timing" in res else ""))
    return 0


# --------------------------------------------------------------------------------------------- profile

# The calls profiled dispatch by dispatch: (name, module function, what it is).
PROFILED_CALLS = (("decode_1000", "decode", "one decode step at 1000 tokens of context"),
                  ("turn_30_after_1000", "prefill", "a 30-token turn after 1000 tokens of history"),
                  ("prefill_512", "prefill", "a 512-token chunk into an empty cache"))
# The first the driver accepts: the GPU's device-timestamped dispatches, or (local-task, a self-test here) the CPU's.
PROFILE_MODES = ("dispatch-events", "host-execution")


def capture_inputs(engine: Any, dest: Path) -> dict[str, Any]:
    """Saves the arguments the engine passes for PROFILED_CALLS (.npy per argument), for iree-benchmark-module."""
    ids = prefill_ids(1100, engine.cfg.vocab_size, seed=11)
    seen: dict[str, tuple] = {}
    module = engine.module
    real = {"decode": module.decode, "prefill": module.prefill}

    def spy(fn: str):
        def call(*a: np.ndarray) -> np.ndarray:
            seen[fn] = seen.get(fn, ()) + (a,)
            return real[fn](*a)
        return call

    engine.reset()
    engine.prefill(ids[:1000])
    kept = engine.snapshot()
    module.decode, module.prefill = spy("decode"), spy("prefill")
    try:
        engine.decode(ids[1000])
        engine.restore(kept)
        engine.prefill(ids[1000:1030])
        engine.reset()
        engine.prefill(ids[:512])
    finally:
        module.decode, module.prefill = real["decode"], real["prefill"]
    out: dict[str, Any] = {}
    calls = {"decode_1000": seen["decode"][0], "turn_30_after_1000": seen["prefill"][0],
             "prefill_512": seen["prefill"][1]}
    for name, fn, _ in PROFILED_CALLS:
        folder = dest / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        files = []
        for i, a in enumerate(calls[name]):
            f = folder / f"arg{i}.npy"
            np.save(f, np.ascontiguousarray(a))
            files.append(str(f))
        out[name] = {"function": module.program_name(fn, calls[name]), "inputs": files,
                     "shapes": [list(np.shape(a)) for a in calls[name]]}
    (dest / "inputs.json").write_text(json.dumps(out))
    return out


def _iree_tool(name: str) -> Path:
    import iree._runtime_libs as libs

    tool = Path(libs.__file__).parent / name
    if not os.access(tool, os.X_OK):
        tool.chmod(0o755)  # `pip install --target` may drop the executable bit
    return tool


def profile_call(folder: Path, device: str, function: str, inputs: list[str], dest: Path,
                 timeout: float) -> dict[str, Any]:
    """One call of `function` under iree-benchmark-module with the HAL's profiling on, then iree-profile's
    per-dispatch table: where the call's device time goes, by kernel."""
    base = [str(_iree_tool("iree-benchmark-module")), f"--module={folder / 'module.vmfb'}",
            f"--parameters=model={folder / 'weights.irpa'}", f"--device={'local-task' if device == 'cpu' else device}",
            f"--function={function}", *[f"--input=@{f}" for f in inputs],
            "--benchmark_repetitions=5", "--benchmark_min_warmup_time=0.2"]
    out: dict[str, Any] = {}

    def medians(extra: list[str]) -> list[str] | str:
        p = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=timeout)
        return [ln for ln in p.stdout.splitlines() if "_median" in ln] or (p.stdout + p.stderr)[-1500:]

    out["benchmark"] = medians([])
    if device == "cuda":  # the CUDA driver's ways of running a command buffer: streams (default), graphs, inline
        out["benchmark_graphs"] = medians(["--cuda_use_streams=false"])
        out["benchmark_inline"] = medians(["--cuda_allow_inline_execution=true"])
    if device == "cuda":
        out["kernels"] = kernel_times([str(_iree_tool("iree-run-module")), *base[1:-2], "--output_max_element_count=8"],
                                      timeout)
    for mode in PROFILE_MODES:
        bundle = dest.with_suffix(".ireeprof")
        bundle.unlink(missing_ok=True)
        p = subprocess.run([*base[:-2], "--benchmark_repetitions=1", "--benchmark_min_time=20x",
                            f"--device_profiling_mode={mode}", f"--device_profiling_output={bundle}"],
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not bundle.is_file():
            out.setdefault("refused", {})[mode] = (p.stdout + p.stderr)[-800:]
            continue
        out["mode"] = mode
        prof = str(_iree_tool("iree-profile"))
        for view in ("summary", "dispatch", "explain"):
            q = subprocess.run([prof, view, "--format=text", str(bundle)], capture_output=True, text=True,
                               timeout=120)
            out[view] = (q.stdout or q.stderr)[-12000:]
        rows = subprocess.run([prof, "dispatch", "--format=jsonl", str(bundle)], capture_output=True, text=True,
                              timeout=120).stdout.splitlines()
        out["dispatch_rows"] = [json.loads(r) for r in rows[:400] if r.startswith("{")]
        break
    return out


def _ncu() -> str | None:
    import glob

    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") +
                                          glob.glob("/usr/local/cuda*/bin/ncu"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def kernel_times(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Every CUDA kernel of one call (iree-run-module: the module's initialisers, then the call) timed by Nsight
    Compute (gpu__time_duration, the clocks left as they are), summed by kernel name. IREE's CUDA driver has no
    profiling of its own (iree-profile's modes are UNIMPLEMENTED there)."""
    import csv
    import io

    ncu = _ncu()
    if ncu is None:
        return {"ok": False, "error": "ncu not found"}
    p = subprocess.run([ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
                        "--print-units", "base", *cmd], capture_output=True, text=True, timeout=timeout)
    text = p.stdout[p.stdout.find('"ID"'):] if '"ID"' in p.stdout else ""
    by_name: dict[str, list[float]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            name = row.get("Kernel Name") or row.get("Function Name") or "?"
            by_name.setdefault(name, []).append(float(row["Metric Value"].replace(",", "")))
    if not by_name:
        return {"ok": False, "rc": p.returncode, "error": p.stdout[:1500] + " ... " + p.stdout[-1500:] + p.stderr[-1500:]}
    rows = sorted(({"kernel": k, "count": len(v), "total_us": round(sum(v) / 1e3, 2)} for k, v in by_name.items()),
                  key=lambda r: -r["total_us"])
    return {"ok": True, "launches": sum(r["count"] for r in rows),
            "total_us": round(sum(r["total_us"] for r in rows), 1), "top": rows[:60]}


def _kernels_text(k: dict | None) -> str:
    if not k:
        return ""
    if not k.get("ok"):
        return f"ncu: {k.get('error', '')}"
    lines = [f"ncu: {k['launches']} kernels, {k['total_us']:.0f} us of GPU time (initialisers included)",
             f"{'total us':>10} {'count':>6}  kernel"]
    lines += [f"{r['total_us']:10.1f} {r['count']:6d}  {r['kernel'][:150]}" for r in k["top"][:40]]
    return "\n".join(lines)


def profile_variants(report: dict, variants: list[dict], root: Path, work: Path, mode: str, out_dir: Path,
                     left: Any) -> None:
    text = []
    for v in variants:
        name, device = v["name"], "cpu" if mode == "cpu" else v["device"]
        inputs_file = work / "inputs" / name / "inputs.json"
        if not inputs_file.is_file():
            report.setdefault("profiles", {})[name] = {"skipped": "no inputs captured"}
            continue
        calls = json.loads(inputs_file.read_text())
        for call, fn, what in PROFILED_CALLS:
            if left() < 45:
                report.setdefault("profiles", {}).setdefault(name, {})[call] = {"skipped": "out of time"}
                continue
            _log(f"{name}: profiling {what}")
            prof = report.setdefault("profiles", {}).setdefault(name, {})
            _guard(prof, call, profile_call, root / name, device, fn, calls[call]["inputs"],
                   work / "inputs" / name / call, min(120.0, left() - 30))
            r = prof[call]
            text.append(f"===== {name}: {what} ({fn}; mode {r.get('mode', 'none')})\n"
                        + "\n".join(f"{k}: {r[k] if isinstance(r[k], str) else ' | '.join(r[k])}"
                                     for k in ("benchmark", "benchmark_graphs", "benchmark_inline", "error") if k in r)
                        + "\n" + _kernels_text(r.get("kernels"))
                        + "\n" + r.get("summary", "") + "\n" + r.get("dispatch", "") + "\n" + r.get("explain", "")
                        + "".join(f"\nrefused {m}: {e}" for m, e in r.get("refused", {}).items()))
    (out_dir / "profile.txt").write_text("\n\n".join(text))


# `eddy` as the device runs it: torch and the compiler refused, so a bundled entry must be found, never built.
EDDY_WITHOUT_COMPILER = r'''
import sys
from bench.gpu_check import block_compiler
block_compiler()
from engine.cli import main
sys.exit(main(sys.argv[1:]))
'''


def eddy_bench(v: dict, device: str, root: Path, work: Path, runs: int, timeout: float) -> dict[str, Any]:
    """`eddy bench` once, on the bundled root, in a process of its own (engine.cli's main, without the compiler)."""
    out = work / "eddy_bench.json"
    out.unlink(missing_ok=True)
    dtype, _, kv = v["dtype"].partition("-kv")
    args = ["bench", "--model", v["model"], "--device", device, "--dtype", dtype, "--runs", str(runs),
            "--json", str(out)] + (["--kv-dtype", kv] if kv else [])
    if device != "cpu":
        args += ["--gpu-target", v["gpu_target"]]
    env = _child_env(root)
    cmd = [sys.executable, "-c", EDDY_WITHOUT_COMPILER, *args]
    _log("eddy " + " ".join(args) + f" (EDDY_BUNDLED_MODELS={root}, at most {timeout:.0f} s)")
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"eddy bench ran past {timeout:.0f} s; output so far: {(e.stdout or '')[-1500:]}") from None
    wall = time.perf_counter() - start
    print(p.stdout, flush=True)
    if p.returncode or not out.is_file():
        raise RuntimeError(f"eddy bench exited {p.returncode}: {(p.stderr or p.stdout)[-1500:]}")
    built = sorted(p.name for p in (Path(os.environ["EDDY_CACHE_DIR"]) / "artefacts").glob("*"))
    if built:  # it should have found the bundled entry, never built one
        raise RuntimeError(f"eddy bench built {built} instead of opening the bundled entry")
    return {"wall_s": round(wall, 1), "command": "eddy " + " ".join(args[:-2]),
            "result": json.loads(out.read_text())}


def bench_estimate_s(result: dict, runs: int) -> float:
    """About how long `eddy bench` takes, from the variant's own decode speed: it decodes 20,000 tokens for its
    memory figures and three capacities (3 x 1024) sliding, besides its shorter figures and cold starts."""
    rate = result.get("timing", {}).get("decode_1000_tok_s")
    if not rate:
        return 0.0  # unknown: try, under the time limit
    return (20_000 + 3 * 1024 + 2 * runs * 64) / rate + 20 + 10 * runs


def _child_env(bundled: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # run() has set EDDY_CACHE_DIR to a folder of its own
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if bundled is not None:
        env["EDDY_BUNDLED_MODELS"] = str(bundled)
    return env


def run(args: argparse.Namespace) -> int:
    block_compiler()
    start = time.perf_counter()
    deadline = start + args.budget
    gpu_dir = Path(args.dir).resolve()
    out_dir = Path(args.out or os.environ.get("OUT") or "gpu-check-out").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve()
    root = work / "models"
    root.mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(exist_ok=True)
    plan = json.loads((gpu_dir / "plan.json").read_text())
    report: dict[str, Any] = {"version": 2, "device_mode": args.device, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "plan_created": plan.get("created"), "budget_s": args.budget,
                              "targets": {m: [{"key": k, "op": op, "value": val, "unit": u} for k, op, val, u in t]
                                          for m, t in TARGETS.items()},
                              "vulkan_within": VULKAN_WITHIN,
                              "tolerances": {k: {"kind": a, "value": b} for k, (a, b) in TOLERANCES.items()},
                              "machine": {}, "setup": {}, "variants": {}}
    json_file = out_dir / "gpu_check.json"

    def save() -> None:
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        json_file.write_text(json.dumps(report, indent=1))

    def left() -> float:
        return deadline - time.perf_counter()

    # An empty cache of its own: nothing is built, and a user's cache is never read or written.
    os.environ["EDDY_CACHE_DIR"] = str(work / "cache")
    for scratch in ("cache", "weights"):  # nothing of an earlier run's: its weights may be another plan's
        shutil.rmtree(work / scratch, ignore_errors=True)
    _guard(report["machine"], "info", machine_info)
    info = report["machine"]["info"]
    _log(f"GPU: {info.get('nvidia_smi', '?')}; Vulkan: {info.get('vulkan_devices') or info.get('vulkan_why_none')}; "
         f"iree-base-runtime {info.get('iree_runtime', '?')} ({info.get('iree_runtime_build', '')}); drivers "
         f"{info.get('iree_drivers', '?')}; python {info.get('python')}")
    save()

    variants = [v for v in plan["variants"] if not args.only or v["name"] in args.only]
    for v in variants:
        if "build_error" in v:
            report["setup"][v["name"]] = {"ok": False, "error": "not built: " + v["build_error"]}
            continue
        _guard(report["setup"], v["name"], lay_out, gpu_dir, plan, v, root / v["name"], args.device)
        save()
    for v in variants:
        name = v["name"]
        if not report["setup"].get(name, {}).get("ok"):
            report["variants"][name] = {"skipped": "its entry could not be laid out"}
            continue
        limit = min(args.variant_timeout, left() - 30)
        if limit < 20:
            report["variants"][name] = {"skipped": "out of time"}
            continue
        result = work / "results" / f"{name}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "variant", "--dir", str(gpu_dir), "--work", str(work),
               "--name", name, "--result", str(result), "--reps", str(args.reps)]
        cmd += ["--no-time"] if args.no_time else []
        if name in (args.profile or PROFILED):
            cmd += ["--inputs", str(work / "inputs" / name)]
        _log(f"{name}: opening and checking (at most {limit:.0f} s)")
        t = time.perf_counter()
        try:  # its log lines go straight to ours; its stderr (IREE's and Python's complaints) is kept
            p = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, timeout=limit, env=_child_env())
            rc, tail = p.returncode, (p.stderr or "")[-3000:]
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            rc, tail = "timeout", err[-3000:]
        r = json.loads(result.read_text()) if result.is_file() else {}
        r.update(model=v["model"], device=v["device"], group=v["group"])
        r["process"] = {"rc": rc, "seconds": round(time.perf_counter() - t, 1)}
        if rc != 0:
            r["process"]["stderr_tail"] = tail
            _log(f"{name}: process ended with {rc}: {tail[-400:]}")
        report["variants"][name] = r
        save()

    profiled = [v["name"] for v in variants if v["name"] in (args.profile or PROFILED)
                and report["variants"].get(v["name"], {}).get("load", {}).get("ok")]
    profile_variants(report, [v for v in variants if v["name"] in profiled], root, work, args.device, out_dir, left)
    save()

    bench_v = next((v for v in variants if v["name"] == (args.bench_variant or plan["bench_variant"])), None)
    if args.no_bench or bench_v is None:
        report["eddy_bench"] = {"skipped": "--no-bench" if args.no_bench else "its variant is not in this run"}
    elif not report["setup"].get(bench_v["name"], {}).get("ok"):
        report["eddy_bench"] = {"skipped": "its entry could not be laid out"}
    elif report["variants"].get(bench_v["name"], {}).get("load", {}).get("ok") is False:
        report["eddy_bench"] = {"skipped": "its module did not open (see its row)"}
    elif left() < 60:
        report["eddy_bench"] = {"skipped": "out of time"}
    elif (need := bench_estimate_s(report["variants"].get(bench_v["name"], {}), args.bench_runs)) > left() - 20:
        report["eddy_bench"] = {"skipped": f"it would take about {need:.0f} s at the decode speed measured above, "
                                           f"and {left():.0f} s are left"}
    else:
        # Only the bench's entry in its root: the cold start's `eddy chat` opens the same one.
        bench_root = work / "bench-root"
        shutil.rmtree(bench_root, ignore_errors=True)
        bench_root.mkdir()
        (bench_root / bench_v["name"]).symlink_to(root / bench_v["name"])
        runs = args.bench_runs if left() > 200 else 1
        _guard(report, "eddy_bench", eddy_bench, bench_v, "cpu" if args.device == "cpu" else bench_v["device"],
               bench_root, work, runs, left() - 15)
    save()
    table = format_table(report)
    report["table"] = table
    save()
    print("\n" + table, flush=True)
    print(f"\nJSON: {json_file}", flush=True)
    return 0


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    m = report.get("machine", {}).get("info", {})
    lines = [f"gpu_check ({report['device_mode']}): {m.get('nvidia_smi') or 'no nvidia-smi'} | iree-base-runtime "
             f"{m.get('iree_runtime', '?')} | {report.get('elapsed_s', 0):.0f} s"]
    head = ("variant", "open s", "check", "max|d|", "rel", "greedy", "dec@128", "dec@1000", "turn ms", "pf1024 t/s")
    rows = [head]
    for name, r in report["variants"].items():
        if "skipped" in r:
            rows.append((name, "-", "skip", "-", "-", "-", "-", "-", "-", "-"))
            continue
        load, check, timing = r.get("load", {}), r.get("check", {}), r.get("timing", {})
        if not load.get("ok"):
            state = "NOLOAD" if load else "CRASH"
        else:
            state = "noref" if "skipped" in check else "ok" if check.get("passed") else "FAIL" if check else "CRASH"
        c = check if "max_abs" in check else {}
        greedy = f"{c['greedy_equal']}/{c['rows']}" if "greedy_equal" in c else "-"
        rows.append((name, _fmt(load.get("open_s"), ".1f"), state, _fmt(c.get("max_abs"), ".1e"),
                     _fmt(c.get("rel"), ".1e"), greedy, _fmt(timing.get("decode_128_tok_s"), ".0f"),
                     _fmt(timing.get("decode_1000_tok_s"), ".0f"), _fmt(timing.get("turn_30_after_1000_ms"), ".2f"),
                     _fmt(timing.get("prefill_1024_tok_s"), ".0f")))
    rows.append(("target (smollm2)", "", "", "<=1e-4 f32", "<=1e-2", "all", ">=1000", ">=1000", "<=5", ">=20000"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines += ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    hits = []
    for name, r in report["variants"].items():
        t = r.get("timing", {})
        if t.get("ok") and TARGETS.get(r.get("model")):
            met = [f"{k.replace('_tok_s', '').replace('_ms', '')} {'met' if meets(t.get(k), op, val) else 'MISSED'}"
                   f" ({op}{val:g})" for k, op, val, _ in TARGETS[r["model"]]]
            hits.append(f"  {name}: " + ", ".join(met))
    hits += vulkan_against_cuda(report)
    if hits:
        lines += ["targets:", *hits]
    for name, r in report["variants"].items():
        for step in ("load", "check", "timing"):
            if r.get(step, {}).get("ok") is False:
                lines.append(f"  {name} {step}: {r[step].get('error', '')[:300]}")
        if r.get("check", {}).get("passed") is False:
            lines.append(f"  {name} check: {r['check'].get('why', '')[:300]}")
        if r.get("process", {}).get("rc") not in (0, None):
            lines.append(f"  {name} process: {r['process']['rc']}")
    for name, s in report.get("setup", {}).items():
        if not s.get("ok"):
            lines.append(f"  {name} setup: {s.get('error', '')[:300]}")
    b = report.get("eddy_bench", {})
    if b.get("ok"):
        res = b["result"]
        d, p, t = res["decode_tok_s"], res["prefill_tok_s"], res["ttft_ms_reuse"]
        lines.append(f"eddy bench ({b['command']}, {b['wall_s']:.0f} s): turn after 1000 {t['1000']:.2f} ms, prefill "
                     f"1024 {p['1024']:.0f} tok/s, decode 128/1000 {d['128']:.0f}/{d['1000']:.0f} tok/s, rss "
                     f"{res['rss_mb'].get('2000', 0):.0f} MiB, cold start {res['cold_start_first_token_s']:.2f} s")
    else:
        lines.append(f"eddy bench: {b.get('skipped') or 'FAILED: ' + str(b.get('error', ''))[:400]}")
    for name, calls in report.get("profiles", {}).items():
        for call, r in calls.items():
            if not isinstance(r, dict) or "benchmark" not in r:
                continue
            k = r.get("kernels") or {}
            bench = r["benchmark"][0].split()[1:3] if isinstance(r["benchmark"], list) and r["benchmark"] else ["?"]
            gpu = f"{k['launches']} kernels, {k['total_us'] / 1e3:.2f} ms on the GPU" if k.get("ok") else \
                "no kernel times" if device_is_cpu(report) else f"ncu failed: {str(k.get('error', ''))[:120]}"
            lines.append(f"profile {name} {call}: {' '.join(bench)} a call (iree-benchmark-module); {gpu}")
    return "\n".join(lines)


# Times (lower is better) vulkan is held to against cuda: each figure as the time it stands for.
_AS_TIME = {"decode_1000_tok_s": lambda v: 1 / v, "prefill_1024_tok_s": lambda v: 1 / v,
            "turn_30_after_1000_ms": lambda v: v}


def vulkan_against_cuda(report: dict[str, Any]) -> list[str]:
    """Each vulkan variant's time against the cuda variant of the same model and weights: within VULKAN_WITHIN."""
    by = {(r.get("group"), r.get("device")): (name, r.get("timing", {})) for name, r in report["variants"].items()}
    lines = []
    for (group, device), (name, t) in by.items():
        cuda = by.get((group, "cuda"), (None, {}))[1]
        if device != "vulkan" or not t.get("ok") or not cuda.get("ok"):
            continue
        parts = []
        for key, as_time in _AS_TIME.items():
            if t.get(key) and cuda.get(key):
                x = as_time(t[key]) / as_time(cuda[key])
                parts.append(f"{key.rsplit('_', 1)[0].replace('_tok', '')} {x:.2f}x "
                             f"{'met' if x <= VULKAN_WITHIN else 'MISSED'}")
        lines.append(f"  {name} against cuda (time, <={VULKAN_WITHIN:g}x): " + ", ".join(parts))
    return lines


def device_is_cpu(report: dict) -> bool:
    return report.get("device_mode") == "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("prepare", help="build, compute references and fill .gpu/ and .whl/ (here, with torch)")
    pr.add_argument("--dir", default=".gpu")
    pr.add_argument("--only", action="append", help="only this group (e.g. tiny-f32); repeatable")
    pr.add_argument("--work", default=None, help="where the builds go (default: a folder per version of the export "
                                                 "code); an earlier folder's builds are reused as they are")
    ru = sub.add_parser("run", help="on the device: check and time every variant")
    ru.add_argument("--dir", default=".gpu")
    ru.add_argument("--out", default=None, help="where gpu_check.json goes (default $OUT)")
    ru.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                    help="gpu: each variant on its own device (cuda or vulkan); cpu: the CPU builds instead (a "
                         "self-test of this script where there is no GPU)")
    ru.add_argument("--work", default="/tmp/gpu-check", help="the bundled-models root and scratch files go here")
    ru.add_argument("--budget", type=float, default=500.0, help="seconds for the whole run")
    ru.add_argument("--variant-timeout", type=float, default=150.0, help="seconds at most per variant")
    ru.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (medians)")
    ru.add_argument("--no-time", action="store_true", help="check only")
    ru.add_argument("--no-bench", action="store_true", help="skip the `eddy bench` run")
    ru.add_argument("--bench-variant", default=None, help=f"the variant `eddy bench` runs on (default {BENCH_VARIANT})")
    ru.add_argument("--bench-runs", type=int, default=1)
    ru.add_argument("--only", action="append", help="only this variant; repeatable")
    ru.add_argument("--profile", action="append",
                    help=f"profile this variant's calls dispatch by dispatch (default {', '.join(PROFILED)}); repeatable")
    va = sub.add_parser("variant", help=argparse.SUPPRESS)
    for flag in ("--dir", "--work", "--name", "--result"):
        va.add_argument(flag, required=True)
    va.add_argument("--reps", type=int, default=5)
    va.add_argument("--no-time", action="store_true")
    va.add_argument("--inputs", default=None)
    args = p.parse_args(argv)
    if args.command == "prepare":
        return prepare(args)
    if args.command == "run":
        return run(args)
    return variant_child(args)


if __name__ == "__main__":
    sys.exit(main())
