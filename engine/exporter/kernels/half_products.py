"""float16 weights multiplying many rows in 16 bits, as a custom op (needs torch and turbine at export): x rounded to
float16, products summed in float32. A GPU runs that contraction on its matrix units (tensor cores through
`mma.sync` on cuda, cooperative matrices on vulkan: IREE picks them for f16 x f16 -> f32 and for no float32 form).
torch cannot say it: its f16 linear rounds the float32 sums back to float16 (torch-mlir's lowering), a second
rounding of every output.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .registry import Kit, registered

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


def f16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (float32, rows fixed) @ w.T for a float16 w [out, in], x rounded to float16 and the products
    summed in float32: float32 [rows, out]. An x already in float16 (a norm's output: kernels.rms_norm_one_dispatch)
    is taken as it is."""
    return _ops()["f16"](x, w)


_ROUND_X = r"""
  %e = tensor.empty() : tensor<{m}x{k}xf16>
  %ah = linalg.generic {{
      indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]}}
      ins(%a : tensor<{m}x{k}xf32>) outs(%e : tensor<{m}x{k}xf16>) {{
  ^bb0(%x: f32, %o: f16):
    %0 = arith.truncf %x : f32 to f16
    linalg.yield %0 : f16
  }} -> tensor<{m}x{k}xf16>
"""

_MM_F16 = r"""
module {{
util.func private @{name}(%a: tensor<{m}x{k}x{x}>, %w: tensor<{n}x{k}xf16>) -> tensor<{m}x{n}xf32> {{
{half_x}
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty() : tensor<{m}x{n}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(i, j, p) -> (i, p)>, affine_map<(i, j, p) -> (j, p)>,
                       affine_map<(i, j, p) -> (i, j)>],
      iterator_types = ["parallel", "parallel", "reduction"]}}
      ins({ah}, %w : tensor<{m}x{k}xf16>, tensor<{n}x{k}xf16>) outs(%acc : tensor<{m}x{n}xf32>) {{
  ^bb0(%x: f16, %y: f16, %o: f32):
    %0 = arith.extf %x : f16 to f32
    %1 = arith.extf %y : f16 to f32
    %2 = arith.mulf %0, %1 : f32
    %3 = arith.addf %2, %o : f32
    linalg.yield %3 : f32
  }} -> tensor<{m}x{n}xf32>
  util.return %r : tensor<{m}x{n}xf32>
}}
}}
"""


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    CustomOp, library, emit, shape = kit.CustomOp, kit.library, kit.emit, kit.shape

    @CustomOp.register(library=library)
    class mmt_f16(CustomOp):
        signature = "mmt_f16(Tensor a, Tensor w) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            a, w = ksel.arg_tensor(0), ksel.arg_tensor(1)
            a.specialize_all_dims()  # a GPU build's calls have fixed shapes (engine/shapes.py)
            w.specialize_all_dims()
            ksel.return_new_tensor([a.t.shape[0], w.t.shape[0]], dtype=torch.float32)

        def eager_execute(self, a, w):
            return a.half().float() @ w.float().T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (m, k), (n, _) = shape(kb, 0), shape(kb, 1)
            x = kit.element_type(kb, 0)
            name = f"eddy_mm_f16_{m}x{n}x{k}_{x}"
            half_x = "" if x == "f16" else _ROUND_X.format(m=m, k=k)
            emit(kb, name, _MM_F16.format(name=name, m=m, n=n, k=k, x=x, half_x=half_x,
                                          ah="%a" if x == "f16" else "%ah"))

    return {"f16": mmt_f16}
