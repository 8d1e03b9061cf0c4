"""float16 products on a GPU's matrix units (Device.matrix_units, kernels.f16_linear), checked without a GPU: the op
computes its meaning (x rounded to float16, products summed in float32; compiled for this CPU and run), and what
iree-compile makes of it for cuda is the tensor cores' `mma.sync`, which the float32 product it replaces does not
get. tests/test_dispatches.py sees a cuda build take it; whether it is faster is the device check's
(bench/gpu_check.py)."""
from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_SETTINGS

torch = pytest.importorskip("torch")

ROWS, OUT, IN = 32, 384, 256  # a fixed chunk of rows, as a GPU build's calls have


class _Product(torch.nn.Module):
    def __init__(self, w: torch.Tensor, units: bool) -> None:
        super().__init__()
        self.register_buffer("w", w)
        self.units = units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.exporter.kernels import f16_linear

        return f16_linear(x, self.w) if self.units else torch.nn.functional.linear(x, self.w.float())


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(ROWS, IN, generator=g), (torch.randn(OUT, IN, generator=g) / 16).half()


def _compile(units: bool, flags: list[str], out: Path, *extra: str) -> subprocess.CompletedProcess:
    import iree.turbine.aot as aot
    from iree.compiler.tools.binaries import find_tool

    x, w = _inputs()
    src = out.with_suffix(".mlir")
    src.write_text(str(aot.export(_Product(w, units), args=(x,), strict_export=False).mlir_module))
    return subprocess.run([find_tool("iree-compile"), str(src), *flags, *extra], capture_output=True, text=True,
                          check=True, timeout=300)


def test_the_16_bit_product_computes_its_meaning(tmp_path):
    import iree.runtime as rt

    from engine.devices import compile_flags

    _compile(True, compile_flags("cpu", "host"), tmp_path / "m", "-o", str(tmp_path / "m.vmfb"))
    module = rt.load_vm_flatbuffer_file(str(tmp_path / "m.vmfb"), driver="local-task")
    x, w = _inputs()
    got = np.asarray(module["main"](x.numpy()).to_host())
    meant = (x.half().float() @ w.float().T).numpy()
    exact = (x @ w.float().T).numpy()
    np.testing.assert_allclose(got, meant, rtol=1e-5, atol=1e-5)
    assert np.abs(got - exact).max() > 1e-4  # x was rounded: not the float32 product


@pytest.mark.parametrize("units", [True, False])
def test_cuda_multiplies_16_bits_on_the_tensor_cores(units, tmp_path):
    from engine.devices import compile_flags

    _compile(units, compile_flags("cuda", "sm_89"), tmp_path / "m", "-o", str(tmp_path / "m.vmfb"))
    ptx = (tmp_path / "m.vmfb").read_bytes()
    assert (b"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx) == units
