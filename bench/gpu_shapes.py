#!/usr/bin/env python3
"""Does a GPU build want static shapes? The default model's module with its dynamic token count and attended slots
(as Eddy exports it for every device) against the same model exported with both fixed: prefill for exactly 32 and
exactly 512 tokens, every call attending to all the cache's slots. Both on the lent H200, same weights, same inputs.

Why: the first device runs (docs/GPU.md) found prefill's matrix products at ~1 TFLOP/s and its attention's at
~0.4, a few percent of what the chip does in float32, and Nsight Compute put 95 % of a 512-token chunk's GPU time
in those dispatches, all of them over a dynamic dimension. IREE's GPU code generation tiles what it can see.

    EDDY_CACHE_DIR=/tmp/gpucheck-cache .venv/bin/python bench/gpu_shapes.py prepare   # here, after gpu_check's
    python3 bench/gpu_shapes.py run --out $OUT                                          # on the device

`run` regenerates gpu_check's random weights, loads both modules on the cuda driver, feeds each the same calls (a
512-token chunk, a 32-token turn after it, one decode step), compares their logits and times each call (median of
7 after one untimed run). It prints a table and writes $OUT/gpu_shapes.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GROUP = "smollm2-f16-kvf32"  # gpu_check's group: f16 weights, a float32 cache (the faster one on the GPU)
DIR = ROOT / ".gpu" / "shapes"
CALLS = (("prefill_512", 512), ("prefill_32", 32), ("decode", 1))


def prepare(args: argparse.Namespace) -> int:
    import iree.turbine.aot as aot
    import torch

    from bench.gpu_check import _compile_with_flags
    from engine.build import export, kernels
    from engine.build.artefacts import export_code_hash
    from engine.build.model import StreamingLlama
    from engine.config import BuildSettings
    from engine.loader import open_folder
    from engine.paths import cache_dir

    work = cache_dir() / "gpu-check" / export_code_hash()
    cpu, cuda = work / f"{GROUP}-cpu", work / f"{GROUP}-sm_89"
    DIR.mkdir(parents=True, exist_ok=True)
    loaded = open_folder(cpu)
    engine, cfg = loaded.engine, loaded.engine.cfg
    settings = BuildSettings(**json.loads((cuda / "manifest.json").read_text())["settings"])

    # The calls' inputs as the engine makes them, every call attending to all the slots (what the static export
    # takes; the dynamic one takes any multiple of the attend step, so both get the very same arrays).
    full = len(engine.slot_pos)
    engine.attended = lambda: full
    engine.reset()
    ids = np.random.default_rng(3).integers(100, 40000, 545)
    inputs = {"prefill_512": engine._inputs(ids[:512]), "prefill_32": engine._inputs(ids[512:544]),
              "decode": engine._inputs(ids[544:545])}
    np.savez(DIR / "inputs.npz", **{f"{c}.{i}": a for c, args_ in inputs.items() for i, a in enumerate(args_)})
    del loaded

    t = time.perf_counter()
    model = StreamingLlama.skeleton(cfg, settings)
    aot.externalize_module_parameters(model)
    fxb = aot.FxProgramsBuilder(model)

    def static(call: str) -> tuple:
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs[call])

    @fxb.export_program(name="prefill_512", args=static("prefill_512"), strict=False)
    def prefill_512(m, tokens, slots, rope, shift, slot_pos, token_pos):
        return m.prefill(tokens, slots, rope, shift, slot_pos, token_pos)

    @fxb.export_program(name="prefill_32", args=static("prefill_32"), strict=False)
    def prefill_32(m, tokens, slots, rope, shift, slot_pos, token_pos):
        return m.prefill(tokens, slots, rope, shift, slot_pos, token_pos)

    @fxb.export_program(name="decode", args=static("decode"), strict=False)
    def decode(m, tokens, slots, rope, shift, slot_pos, token_pos):
        return m.decode(tokens, slots, rope, shift, slot_pos, token_pos)

    @fxb.export_program(name="reset", args=(), strict=False)
    def reset(m):
        return m.reset()

    with kernels.lowering_for("cuda", None):
        output = aot.export(fxb)
    mlir = DIR / "static.mlir"
    mlir.write_text(export.zero_init_cache(str(output.mlir_module)))
    print(f"exported in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    _compile_with_flags(mlir, DIR / "static.vmfb", settings, ())
    if args.cpu:  # for `run --driver local-task`, a self-test of this script here
        from dataclasses import replace
        _compile_with_flags(mlir, DIR / "static-cpu.vmfb", replace(settings, device="cpu", gpu_target=""), ())
    mlir.unlink()
    print(f"compiled in {time.perf_counter() - t:.0f} s: {DIR / 'static.vmfb'}", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from bench.gpu_check import block_compiler, write_irpa

    block_compiler()  # before the engine's imports: they must not need torch or the compiler
    from engine.config import BuildSettings
    from engine.run.runtime import CompiledModule

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = Path(args.dir)
    plan = json.loads((gpu / "plan.json").read_text())
    variant = next(v for v in plan["variants"] if v["name"] == f"{GROUP}-sm_89")
    work = Path("/tmp/gpu-shapes")
    work.mkdir(exist_ok=True)
    irpa = work / "weights.irpa"
    wplan = json.loads((gpu / variant["weights_plan"]).read_text())
    if write_irpa(wplan, irpa) != wplan["sha256"]:
        raise SystemExit("regenerated weights differ from prepare's")
    import gzip
    blob = gpu / "blobs" / variant["files"]["module.vmfb"]
    dynamic, static = work / "dynamic.vmfb", gpu / "shapes" / "static.vmfb"
    dynamic.write_bytes(gzip.decompress(blob.read_bytes()) if blob.name.endswith(".gz") else blob.read_bytes())
    if args.driver != "cuda":  # the self-test: the CPU builds of both
        dynamic, static = Path(plan["cpu_builds"]) / f"{GROUP}-cpu" / "module.vmfb", gpu / "shapes" / "static-cpu.vmfb"
    data = np.load(gpu / "shapes" / "inputs.npz")
    calls = {c: [data[f"{c}.{i}"] for i in range(6)] for c, _ in CALLS}
    settings = BuildSettings(device="cuda", gpu_target="sm_89") if args.driver == "cuda" else BuildSettings()
    report: dict[str, Any] = {"device": args.driver, "modules": {}}

    def load(vmfb: Path):
        """The engine's own loading (CompiledModule), from a folder laid out as a build's; its functions by name."""
        folder = work / vmfb.stem
        folder.mkdir(exist_ok=True)
        for name, src in (("module.vmfb", vmfb), ("weights.irpa", irpa)):
            (folder / name).unlink(missing_ok=True)
            (folder / name).symlink_to(src.resolve())
        return CompiledModule(folder, settings).context.modules.module

    logits: dict[str, dict[str, np.ndarray]] = {}
    for name, vmfb, fn in (("dynamic", dynamic, lambda c: "decode" if c == "decode" else "prefill"),
                           ("static", static, lambda c: c)):
        t = time.perf_counter()
        m = load(vmfb)
        rec: dict[str, Any] = {"load_s": round(time.perf_counter() - t, 2)}
        m["reset"]()
        logits[name] = {c: np.array(m[fn(c)](*calls[c]).to_host()) for c, _ in CALLS}
        for c, n in CALLS:
            f = m[fn(c)]
            times = []
            for i in range(8):
                s = time.perf_counter()
                np.array(f(*calls[c]).to_host())
                if i:
                    times.append(time.perf_counter() - s)
            ms = 1e3 * statistics.median(times)
            rec[c] = {"ms": round(ms, 3), "tok_s": round(n / ms * 1e3, 1)}
        report["modules"][name] = rec
        print(name, json.dumps(rec), flush=True)
    report["agreement"] = {c: {"max_abs": float(np.max(np.abs(logits["static"][c] - logits["dynamic"][c]))),
                               "rel": float(np.linalg.norm(logits["static"][c] - logits["dynamic"][c]) /
                                            np.linalg.norm(logits["dynamic"][c])),
                               "same_greedy": bool(np.argmax(logits["static"][c]) == np.argmax(logits["dynamic"][c]))}
                           for c, _ in CALLS}
    lines = [f"{'call':12} {'dynamic ms':>11} {'static ms':>10} {'speed-up':>9} {'static tok/s':>13} {'rel diff':>9}"]
    for c, _ in CALLS:
        d, s = report["modules"]["dynamic"][c]["ms"], report["modules"]["static"][c]["ms"]
        lines.append(f"{c:12} {d:11.3f} {s:10.3f} {d / s:8.1f}x {report['modules']['static'][c]['tok_s']:13.0f} "
                     f"{report['agreement'][c]['rel']:9.1e}")
    report["table"] = "\n".join(lines)
    (out_dir / "gpu_shapes.json").write_text(json.dumps(report, indent=1))
    print(report["table"], flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("--cpu", action="store_true", help="also compile it for this CPU")
    r = sub.add_parser("run")
    r.add_argument("--dir", default=".gpu")
    r.add_argument("--out", default="gpu-shapes-out")
    r.add_argument("--driver", default="cuda", help="local-task: a self-test here (the CPU builds)")
    args = p.parse_args()
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
