#!/usr/bin/env python3
"""A quantised type's product alone, in each form this CPU runs: the generic one and the hand-written ones
(engine/exporter/kernels/dot_products.py; prefill_products.py for many rows), alternated, as iree-benchmark-module times them.

    python bench/decode_product.py [--dtype q4|q8] [--rows 57344] [--cols 4096] [--tokens 1] [--rounds 3] [--json FILE]

--tokens is the rows of x: 1 is decode's matrix-vector product, more a prefill chunk's (iree-benchmark-module's
time then includes uploading x; the weights are uploaded in every case).

One matrix-vector product of a q4 or q8 matrix [rows, cols] (the default is four 14336 x 4096 matrices as one,
147 MB in q4, 235 MB in q8: more than any L2, so the product reads memory, or the L3 of a large server CPU; a
Llama 3 LM head is --rows 128256 --cols 2048), compiled as the engine compiles it (the same custom op,
devices.compile_flags for this host), each form timed `rounds` times in turn with 2 threads; the bandwidth
(bench/bandwidth.py) is read before each round. Prints the medians and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bandwidth import read_bandwidth  # noqa: E402
from machine import cpu_info  # noqa: E402

from engine.devices import compile_flags, host_dot_forms  # noqa: E402

TOOLS = Path(sys.executable).parent


def weights(dtype: str, rows: int, cols: int) -> list:
    """The product's weight arguments, as Linear stores them (tiled), for their shapes and types."""
    from engine.exporter.linear import Linear

    lin = Linear(rows, cols, dtype)
    return list(lin.q4_tensors()) if dtype == "q4" else [lin.weight]


def compiled(dtype: str, form: str | None, rows: int, cols: int, folder: Path, tokens: int = 1) -> Path:
    """The product of one row by a q4 or q8 matrix [rows, cols] (q8's before its rows' scales) taken as arguments
    (not parameters: nothing to inline or fold), exported with `form` and compiled for this host."""
    import iree.turbine.aot as aot
    import torch

    from engine.exporter.kernels import i8_linear, lowering_for, q4_linear

    class Product(torch.nn.Module):
        def forward(self, x, *w):
            return q4_linear(x, *w) if dtype == "q4" else i8_linear(x, *w)

    fxb = aot.FxProgramsBuilder(Product())

    @fxb.export_program(name="main", args=(torch.zeros(tokens, cols), *weights(dtype, rows, cols)), strict=False)
    def main(m, x, *w):
        return m(x, *w)

    with lowering_for("cpu", form):
        mlir = folder / f"{form}.mlir"
        aot.export(fxb).save_mlir(mlir)
    out = folder / f"{form}.vmfb"
    subprocess.run([str(TOOLS / "iree-compile"), str(mlir), *compile_flags("cpu", "host"), "-o", str(out)],
                   check=True)
    return out


def timed(vmfb: Path, dtype: str, rows: int, cols: int, tokens: int = 1) -> float:
    """Median wall ms of 5 calls, 2 threads."""
    kinds = {"torch.int8": ("i8", 3), "torch.float16": ("f16", 0.01)}
    inputs = [f"--input={'x'.join(map(str, t.shape))}x{kinds[str(t.dtype)][0]}={kinds[str(t.dtype)][1]}"
              for t in weights(dtype, rows, cols)]
    out = subprocess.run([str(TOOLS / "iree-benchmark-module"), f"--module={vmfb}", "--function=main",
                          "--device=local-task", "--task_topology_max_group_count=2",
                          f"--input={tokens}x{cols}xf32=0.5", *inputs, "--benchmark_repetitions=5"],
                         check=True, capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if "real_time_median" in ln)
    return float(line.split()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("q4", "q8"), default="q4")
    p.add_argument("--rows", type=int, default=4 * 14336)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1, help="rows of x: 1 is decode's product, more prefill's")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "decode_product.json")
    a = p.parse_args()

    forms = [None, *host_dot_forms()]
    megabytes = sum(t.numel() * t.element_size() for t in weights(a.dtype, a.rows, a.cols)) / 1e6
    times: dict[str, list[float]] = {str(f): [] for f in forms}
    bandwidths = []
    with tempfile.TemporaryDirectory() as tmp:
        modules = {str(f): compiled(a.dtype, f, a.rows, a.cols, Path(tmp), a.tokens) for f in forms}
        for _ in range(a.rounds):
            bandwidths.append(read_bandwidth()["gb_per_s"])
            for name, vmfb in modules.items():
                times[name].append(timed(vmfb, a.dtype, a.rows, a.cols, a.tokens))
    print(f"{a.dtype} product of {a.tokens} row(s), {a.rows} x {a.cols} ({megabytes:.0f} MB), 2 threads; "
          f"bandwidth {statistics.median(bandwidths):.1f} GB/s; {cpu_info().get('Model name', '')}")
    print("| form | median ms | samples | read at |\n| --- | ---: | --- | ---: |")
    rows = {}
    for name, ms in times.items():
        med = statistics.median(ms)
        rows[name] = {"median_ms": med, "samples_ms": ms, "gb_per_s": megabytes / med}
        label = "generic" if name == "None" else name
        print(f"| {label} | {med:.2f} | {', '.join(f'{t:.2f}' for t in ms)} | {megabytes / med:.1f} GB/s |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"machine": cpu_info(), "dtype": a.dtype, "tokens": a.tokens, "rows": a.rows, "cols": a.cols, "megabytes": megabytes,
                                  "bandwidth_gb_per_s": bandwidths, "forms": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
