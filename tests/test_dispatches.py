"""What a GPU build's programs cost in kernel launches, held where bench/dispatches.py measured it (docs/GPU.md): on a
GPU each dispatch is a launch of a few microseconds, the decode step's largest cost at the default model's size.
Counted in iree-compile's flow output at the default model's widths, 2 and 3 layers (a layer's count is the
difference), so a change that splits a fused op fails here without a GPU. The same flow shows which products take the
matrix units' 16-bit form (Device.matrix_units)."""
from __future__ import annotations

import re
import subprocess
from dataclasses import replace

import pytest

from conftest import TINY_SETTINGS

from bench.dispatches import DEFAULT_MODEL, count_at, widest
from engine.devices import TABLE, compile_flags

# A layer's dispatches at most, per device and program (decode, prefill): bench/dispatches.py's figures of 2026-12-07.
MOST = {"cuda": (11, 16), "vulkan": (11, 18)}
TARGET = {"cuda": "sm_89", "vulkan": "ada"}


@pytest.mark.parametrize("device", sorted(MOST))
def test_a_gpu_layer_takes_no_more_dispatches_than_measured(device, tmp_path):
    from iree.compiler.tools.binaries import find_tool

    settings = replace(TINY_SETTINGS, dtype="f16", device=device, gpu_target=TARGET[device])
    two, three = (count_at(DEFAULT_MODEL, n, settings, [], tmp_path) for n in (2, 3))
    for kind, most in zip(("decode", "prefill"), MOST[device]):
        program = widest(two, kind)
        per_layer = three[program] - two[program]
        assert 0 < per_layer <= most, (device, program, per_layer)
    # Where the device has matrix units, every product of many rows (prefill's) multiplies 16 bits into float32 sums,
    # the form IREE gives them (tests/test_matrix_units.py); decode's one row keeps float32 x.
    products = re.findall(r"matmul(?:_like)?_(\d+)x\d+x\d+_([a-z0-9]+)\b", (tmp_path / "3.flow.mlir").read_text())
    many = "f16xf16xf32" if TABLE[device].matrix_units else "f32xf16xf32"
    assert {types for rows, types in products if int(rows) > 1} == {many}, products
    assert {types for rows, types in products if int(rows) == 1} == {"f32xf16xf32"}, products
    # And the two-layer module compiles whole for the device: the flow level passes what code generation can fail
    # (vulkan's cooperative matrices did on a fused product).
    subprocess.run([find_tool("iree-compile"), str(tmp_path / "2.mlir"), "-o", str(tmp_path / "2.vmfb"),
                    *compile_flags(device, TARGET[device])], check=True, capture_output=True, timeout=900)
