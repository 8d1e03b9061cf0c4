#!/usr/bin/env python3
"""How many dispatches a decode step and a prefill call hold (on a GPU, each one a kernel launch), counted in
iree-compile's flow output: for a change that fuses ops, checked without the device.

    python bench/dispatches.py [--shape smollm2-135m-instruct|NAME] [--device cuda] [--dtype f16]
                               [--iree-flag F ...] [--json FILE]

Exports the shape (the default model's, or a name from engine/checkpoint/shapes.py) at 2 and 3 layers as a skeleton
(weights never written), compiles each to IREE's flow level for the device, and counts the `flow.dispatch` ops of
the decode program and of the prefill program (on a device of fixed shapes, those of the most slots and the longest
chunk). A layer's count is the difference of the two, the whole model's the 2-layer count plus the rest of its
layers at that. Prints a table and writes JSON. `--iree-flag` adds an iree-compile flag (to see what it would fuse).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402

TARGETS = {"cuda": "sm_89", "vulkan": "ada", "cpu": ""}
DEFAULT_MODEL = "smollm2-135m-instruct"  # its config read from the bundled GGUF


def shape_config(name: str, layers: int | None = None) -> dict:
    """The shape's config at `layers` layers (None: all of them)."""
    from engine.checkpoint import resolve_model
    from engine.checkpoint.shapes import config
    from engine.checkpoint.weights import read_config

    if name == DEFAULT_MODEL:
        return {**read_config(resolve_model(name)), **({"num_hidden_layers": layers} if layers else {})}
    return config(name, layers)


def counts(flow: str) -> dict[str, int]:
    """flow.dispatch ops per public program of a flow-level module (a program's `$async` body where it has one)."""
    out: dict[str, int] = {}
    for m in re.finditer(r"util\.func public @(\w+)(\$async)?\(", flow):
        end = flow.find("util.func public", m.end())
        n = len(re.findall(r"flow\.dispatch @", flow[m.end():end if end > 0 else None]))
        if m.group(2) or m.group(1) not in out:
            out[m.group(1)] = n
    return out


def count_at(name: str, layers: int, settings, flags: list[str], work: Path) -> dict[str, int]:
    """counts() of the shape at `layers` layers, its flow module left in work/{layers}.flow.mlir."""
    import iree.turbine.aot as aot
    from iree.compiler.tools.binaries import find_tool

    from engine.config import ModelConfig
    from engine.devices import compile_flags
    from engine.exporter import export
    from engine.exporter.model import StreamingLlama

    skeleton = StreamingLlama.skeleton(ModelConfig.from_hf(shape_config(name, layers)), settings)
    aot.externalize_module_parameters(skeleton)
    mlir, flow = work / f"{layers}.mlir", work / f"{layers}.flow.mlir"
    mlir.write_text(export.export_text(export.export_module(skeleton)))
    subprocess.run([find_tool("iree-compile"), str(mlir), "-o", str(flow), "--compile-to=flow",
                    *compile_flags(settings.device, settings.target), *flags], check=True)
    return counts(flow.read_text())


def widest(programs: dict[str, int], kind: str) -> str:
    """The program of `kind` with the most slots and the longest chunk (its name's numbers), or the only one."""
    names = [p for p in programs if p == kind or p.startswith(kind + "_")]
    return max(names, key=lambda p: [int(x) for x in p.split("_")[1:]][::-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=DEFAULT_MODEL)
    p.add_argument("--device", choices=list(TARGETS), default="cuda")
    p.add_argument("--gpu-target", default=None)
    p.add_argument("--dtype", default="f16")
    p.add_argument("--window", type=int, default=252,
                   help="the cache's window (fewer programs to export than the default's; a count does not "
                        "depend on it)")
    p.add_argument("--iree-flag", action="append", default=[])
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    from engine.config import BuildSettings

    gpu = a.device != "cpu"
    settings = BuildSettings(dtype=a.dtype, device=a.device, window=a.window,
                             gpu_target=(a.gpu_target or TARGETS[a.device]) if gpu else "")
    layers = shape_config(a.shape)["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        two, three = (count_at(a.shape, n, settings, a.iree_flag, Path(tmp)) for n in (2, 3))
    rows = []
    for kind in ("decode", "prefill"):
        program = widest(two, kind)
        per_layer = three[program] - two[program]
        rows.append({"program": program, "per_layer": per_layer, "outside_layers": two[program] - 2 * per_layer,
                     "model": two[program] + (layers - 2) * per_layer})
    print(f"{a.shape} ({layers} layers), {a.device} {settings.target or 'host'}, {a.dtype}"
          + (f", {' '.join(a.iree_flag)}" if a.iree_flag else ""))
    print(f"{'program':<22}{'a layer':>9}{'outside':>9}{'model':>8}")
    for r in rows:
        print(f"{r['program']:<22}{r['per_layer']:>9}{r['outside_layers']:>9}{r['model']:>8}")
    if a.json:
        a.json.write_text(json.dumps({"shape": a.shape, "layers": layers, "device": a.device,
                                      "target": settings.target, "dtype": a.dtype, "iree_flags": a.iree_flag,
                                      "rows": rows, "machine": cpu_info()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
