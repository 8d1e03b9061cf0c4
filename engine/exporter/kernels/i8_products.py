"""q8's matrix products as custom ops (needs torch and turbine at export): int8 weights in tiles (tiles.py), the
products before their per-row scale (which the caller applies: one multiply of the output). Decode's form on an x86
CPU is written by hand (dot_products.py); otherwise one generic, with llvm-cpu's lowering on a cpu and over bytes
off it; any other row count widens the tile back to float32 rows, then multiplies: on a GPU with matrix units, inside
the product's own dispatch, in float16 (_MM_I8_ONE).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import TILE_ROWS as TILE
from . import dot_products
from .plan import active
from .registry import MV_X86, Kit, cpu_lowering, product_pieces, registered, with_rows
from .tiles import untile_q8

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


def i8_linear(x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W.T for a tiled int8 matrix W [out, in] (no scale): the custom op in an export."""
    lead = x.shape[:-1]
    return _ops()["i8"](x.reshape(-1, x.shape[-1]), tiled).reshape(*lead, tiled.shape[0] * TILE)


def i8_linear_scaled(x: torch.Tensor, tiled: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x [rows, in] @ W.T) * scale [out] for a call's fixed many rows (a GPU build's prefill): the custom op, the
    scale inside the product's dispatch where the plan forms one (_MM_I8_ONE; outside it, a dispatch of its own)."""
    return _ops()["i8_scaled"](x, tiled, scale)


# int8, any number of rows: the tile widened back to float32 rows, then the contraction.
_MM_I8 = r"""
module {{
util.func private @{name}(%a: tensor<?x{k}xf32>, %w: tensor<{nb}x{quads}x{qb}xi8>) -> tensor<?x{n}xf32> {{
  %c0 = arith.constant 0 : index
  %rows = tensor.dim %a, %c0 : tensor<?x{k}xf32>
  %w4 = tensor.expand_shape %w [[0], [1], [2, 3]] output_shape [{nb}, {quads}, {t}, 4] : tensor<{nb}x{quads}x{qb}xi8> into tensor<{nb}x{quads}x{t}x4xi8>
  %e = tensor.empty() : tensor<{nb}x{t}x{quads}x4xf32>
  %w3 = linalg.generic {{
      indexing_maps = [affine_map<(b, r, p, j) -> (b, p, r, j)>, affine_map<(b, r, p, j) -> (b, r, p, j)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%w4 : tensor<{nb}x{quads}x{t}x4xi8>) outs(%e : tensor<{nb}x{t}x{quads}x4xf32>) {{
  ^bb0(%q: i8, %o: f32):
    %0 = arith.sitofp %q : i8 to f32
    linalg.yield %0 : f32
  }} -> tensor<{nb}x{t}x{quads}x4xf32>
  %wf = tensor.collapse_shape %w3 [[0, 1], [2, 3]] : tensor<{nb}x{t}x{quads}x4xf32> into tensor<{n}x{k}xf32>
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty(%rows) : tensor<?x{n}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<?x{n}xf32>) -> tensor<?x{n}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d1, d2)>,
                       affine_map<(d0, d1, d2) -> (d0, d1)>],
      iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%a, %wf : tensor<?x{k}xf32>, tensor<{n}x{k}xf32>) outs(%acc : tensor<?x{n}xf32>) {{
  ^bb0(%x: f32, %y: f32, %o: f32):
    %0 = arith.mulf %x, %y : f32
    %1 = arith.addf %0, %o : f32
    linalg.yield %1 : f32
  }} -> tensor<?x{n}xf32>
  util.return %r : tensor<?x{n}xf32>
}}
}}
"""

# int8, many rows on a GPU with matrix units (Device.q4_rows_fused and matrix_units: cuda; as q4_products._MM_Q4_ONE):
# the widening, the product and the rows' scale handed to IREE as one formed dispatch, over the tile's own dimensions, so the widened matrix is never written
# out (left to IREE, the widening, a transpose of the tile, was a dispatch of its own writing the matrix in float32
# every call; the scale outside the formed dispatch was one more).
# The codes widen to float16 (exactly: they are integers under 128) and x is rounded to it, the products summed in
# float32 (the float32 pieces are for the tests' comparison). Rows fixed (with_rows).
_MM_I8_ONE = r"""
module {{
util.func private @{name}(%a: tensor<{m}x{k}xf32>, %w: tensor<{nb}x{quads}x{qb}xi8>, %s: tensor<{n}xf32>) -> tensor<{m}x{n}xf32> {{
  %w4 = tensor.expand_shape %w [[0], [1], [2, 3]] output_shape [{nb}, {quads}, {t}, 4] : tensor<{nb}x{quads}x{qb}xi8> into tensor<{nb}x{quads}x{t}x4xi8>
  %a3 = tensor.expand_shape %a [[0], [1, 2]] output_shape [{m}, {quads}, 4] : tensor<{m}x{k}xf32> into tensor<{m}x{quads}x4xf32>
  %s2 = tensor.expand_shape %s [[0, 1]] output_shape [{nb}, {t}] : tensor<{n}xf32> into tensor<{nb}x{t}xf32>
  %r = flow.dispatch.region -> (tensor<{m}x{nb}x{t}xf32>) {{
  %e = tensor.empty() : tensor<{nb}x{t}x{quads}x4x{wt}>
  %w3 = linalg.generic {{
      indexing_maps = [affine_map<(b, r, p, j) -> (b, p, r, j)>, affine_map<(b, r, p, j) -> (b, r, p, j)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%w4 : tensor<{nb}x{quads}x{t}x4xi8>) outs(%e : tensor<{nb}x{t}x{quads}x4x{wt}>) {{
  ^bb0(%q: i8, %o: {wt}):
    %0 = arith.sitofp %q : i8 to {wt}
    linalg.yield %0 : {wt}
  }} -> tensor<{nb}x{t}x{quads}x4x{wt}>{round_x}
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty() : tensor<{m}x{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{m}x{nb}x{t}xf32>) -> tensor<{m}x{nb}x{t}xf32>
  %p = linalg.generic {{
      indexing_maps = [affine_map<(i, b, r, p, j) -> (i, p, j)>, affine_map<(i, b, r, p, j) -> (b, r, p, j)>,
                       affine_map<(i, b, r, p, j) -> (i, b, r)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]}}
      ins({xa}, %w3 : tensor<{m}x{quads}x4x{wt}>, tensor<{nb}x{t}x{quads}x4x{wt}>) outs(%acc : tensor<{m}x{nb}x{t}xf32>) {{
  ^bb0(%x: {wt}, %y: {wt}, %o: f32):{widen}
    %0 = arith.mulf {xv}, {yv} : f32
    %1 = arith.addf %0, %o : f32
    linalg.yield %1 : f32
  }} -> tensor<{m}x{nb}x{t}xf32>
  %scaled = linalg.generic {{
      indexing_maps = [affine_map<(i, b, r) -> (i, b, r)>, affine_map<(i, b, r) -> (b, r)>,
                       affine_map<(i, b, r) -> (i, b, r)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%p, %s2 : tensor<{m}x{nb}x{t}xf32>, tensor<{nb}x{t}xf32>) outs(%oe : tensor<{m}x{nb}x{t}xf32>) {{
  ^bb0(%v: f32, %f: f32, %o: f32):
    %0 = arith.mulf %v, %f : f32
    linalg.yield %0 : f32
  }} -> tensor<{m}x{nb}x{t}xf32>
  flow.return %scaled : tensor<{m}x{nb}x{t}xf32>
  }}
  %r2 = tensor.collapse_shape %r [[0], [1, 2]] : tensor<{m}x{nb}x{t}xf32> into tensor<{m}x{n}xf32>
  util.return %r2 : tensor<{m}x{n}xf32>
}}
}}
"""


def _one_form(name: str, rows: int, sizes: dict, half: bool) -> str:
    """_MM_I8_ONE as @name for `rows` rows, its products in float16 (`half`: matrix units) or float32."""
    pieces = product_pieces(half, "%a3", f"{rows}x{sizes['quads']}x4")
    return _MM_I8_ONE.format(name=name, m=rows, **pieces, **sizes)


# int8, decode (one row), the generic form of CPUs (GPUs: _MV_I8_BYTES): out[b, r] = sum over positions of w * x,
# a lane per row of the tile. As in _MV_Q4, a row's 4 bytes of a step are read as one int32 and weight j taken out
# with two shifts (which sign-extend it); math.fma as there.
_MV_I8 = r"""
module {{
util.func private @{name}(%a: tensor<1x{k}xf32>, %w: tensor<{nb}x{quads}x{qb}xi8>) -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  %a2 = tensor.expand_shape %a1 [[0, 1]] output_shape [{quads}, 4] : tensor<{k}xf32> into tensor<{quads}x4xf32>
  %ww = flow.tensor.bitcast %w : tensor<{nb}x{quads}x{qb}xi8> -> tensor<{nb}x{quads}x{t}xi32>
  %zero = arith.constant 0.000000e+00 : f32
  %c8 = arith.constant 8 : index
  %c24 = arith.constant 24 : index
  %s24 = arith.constant 24 : i32
  %oe = tensor.empty() : tensor<{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{nb}x{t}xf32>) -> tensor<{nb}x{t}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(b, r, p, j) -> (p, j)>, affine_map<(b, r, p, j) -> (b, p, r)>,
                       affine_map<(b, r, p, j) -> (b, r)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%a2, %ww : tensor<{quads}x4xf32>, tensor<{nb}x{quads}x{t}xi32>) outs(%acc : tensor<{nb}x{t}xf32>) {attrs} {{
  ^bb0(%x: f32, %q: i32, %o: f32):
    %j = linalg.index 3 : index
    %j8 = arith.muli %j, %c8 : index
    %up = arith.subi %c24, %j8 : index
    %upi = arith.index_cast %up : index to i32
    %hi = arith.shli %q, %upi : i32
    %v = arith.shrsi %hi, %s24 : i32
    %0 = arith.sitofp %v : i32 to f32
    %1 = math.fma %0, %x, %zero : f32
    %2 = arith.addf %1, %o : f32
    linalg.yield %2 : f32
  }} -> tensor<{nb}x{t}xf32>
  %r1 = tensor.collapse_shape %r [[0, 1]] : tensor<{nb}x{t}xf32> into tensor<{n}xf32>
  %r2 = tensor.expand_shape %r1 [[0, 1]] output_shape [1, {n}] : tensor<{n}xf32> into tensor<1x{n}xf32>
  util.return %r2 : tensor<1x{n}xf32>
}}
}}
"""


# int8, decode (one row), off the CPU: as _MV_I8, but each weight read as its own byte (sign-extended by sitofp),
# no linalg.index, which IREE's SPIR-V lowering of such a reduction kept in workgroup memory (as _MV_Q4_BYTES).
_MV_I8_BYTES = r"""
module {{
util.func private @{name}(%a: tensor<1x{k}xf32>, %w: tensor<{nb}x{quads}x{qb}xi8>) -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  %a2 = tensor.expand_shape %a1 [[0, 1]] output_shape [{quads}, 4] : tensor<{k}xf32> into tensor<{quads}x4xf32>
  %w4 = tensor.expand_shape %w [[0], [1], [2, 3]] output_shape [{nb}, {quads}, {t}, 4] : tensor<{nb}x{quads}x{qb}xi8> into tensor<{nb}x{quads}x{t}x4xi8>
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty() : tensor<{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{nb}x{t}xf32>) -> tensor<{nb}x{t}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(b, r, p, j) -> (p, j)>, affine_map<(b, r, p, j) -> (b, p, r, j)>,
                       affine_map<(b, r, p, j) -> (b, r)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%a2, %w4 : tensor<{quads}x4xf32>, tensor<{nb}x{quads}x{t}x4xi8>) outs(%acc : tensor<{nb}x{t}xf32>) {{
  ^bb0(%x: f32, %q: i8, %o: f32):
    %0 = arith.sitofp %q : i8 to f32
    %1 = arith.mulf %0, %x : f32
    %2 = arith.addf %1, %o : f32
    linalg.yield %2 : f32
  }} -> tensor<{nb}x{t}xf32>
  %r1 = tensor.collapse_shape %r [[0, 1]] : tensor<{nb}x{t}xf32> into tensor<{n}xf32>
  %r2 = tensor.expand_shape %r1 [[0, 1]] output_shape [1, {n}] : tensor<{n}xf32> into tensor<1x{n}xf32>
  util.return %r2 : tensor<1x{n}xf32>
}}
}}
"""


# _MM_I8 of fixed rows, then the rows' scale (where the plan forms no dispatch of the two: IREE fuses the multiply
# into the product's).
_SCALED = r"""
module {{
{inner_module}
util.func private @{name}(%a: tensor<{m}x{k}xf32>, %w: tensor<{nb}x{quads}x{qb}xi8>, %s: tensor<{n}xf32>) -> tensor<{m}x{n}xf32> {{
  %p = util.call @{inner}(%a, %w) : (tensor<{m}x{k}xf32>, tensor<{nb}x{quads}x{qb}xi8>) -> tensor<{m}x{n}xf32>
  %e = tensor.empty() : tensor<{m}x{n}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(i, c) -> (i, c)>, affine_map<(i, c) -> (c)>, affine_map<(i, c) -> (i, c)>],
      iterator_types = ["parallel", "parallel"]}}
      ins(%p, %s : tensor<{m}x{n}xf32>, tensor<{n}xf32>) outs(%e : tensor<{m}x{n}xf32>) {{
  ^bb0(%v: f32, %f: f32, %o: f32):
    %0 = arith.mulf %v, %f : f32
    linalg.yield %0 : f32
  }} -> tensor<{m}x{n}xf32>
  util.return %r : tensor<{m}x{n}xf32>
}}
}}
"""


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    CustomOp, library, select, emit, shape = kit.CustomOp, kit.library, kit.select, kit.emit, kit.shape

    @CustomOp.register(library=library)
    class mmt_i8(CustomOp):
        signature = "mmt_i8(Tensor a, Tensor w) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select(ksel, 2, TILE)

        def eager_execute(self, a, w):
            return a @ untile_q8(w).float().T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (rows, _), (nb, quads, qb) = shape(kb, 0), shape(kb, 1)
            k = quads * 4
            sizes = dict(nb=nb, n=nb * TILE, k=k, quads=quads, qb=qb, t=TILE)
            tag = f"{nb * TILE}x{k}"
            # The hand-written form quantises x per group of 32 positions.
            if rows == 1 and active().dot_form and k % 32 == 0:
                name = f"eddy_mv_i8_{tag}_{active().dot_form}"
                exe = f"eddy_i8_{tag}_{active().dot_form}"
                emit(kb, name, MV_X86.format(
                    name=name, args="%w: tensor<{nb}x{quads}x{qb}xi8>".format(**sizes),
                    executable=dot_products.q8_executable(active().dot_form, exe, nb, k),
                    call=dot_products.q8_call(exe, nb, k, "%a1", "%w", "%r"), **sizes))
            elif rows == 1 and active().cpu_tuned:
                name = f"eddy_mv_i8_{tag}_cpu"
                emit(kb, name, _MV_I8.format(name=name, attrs=cpu_lowering(nb, 2), **sizes))
            elif rows == 1:
                name = f"eddy_mv_i8_{tag}"
                emit(kb, name, _MV_I8_BYTES.format(name=name, **sizes))
            else:
                name = f"eddy_mm_i8_{tag}"
                emit(kb, name, _MM_I8.format(name=name, **sizes))


    @CustomOp.register(library=library)
    class mmt_i8_scaled(CustomOp):
        signature = "mmt_i8_scaled(Tensor a, Tensor w, Tensor s) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            a, w, s = (ksel.arg_tensor(i) for i in range(3))
            for t in (a, w, s):
                t.specialize_all_dims()
            ksel.return_new_tensor([a.t.shape[0], w.t.shape[0] * TILE], dtype=torch.float32)

        def eager_execute(self, a, w, s):
            return (a @ untile_q8(w).float().T) * s

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (rows, _), (nb, quads, qb) = shape(kb, 0), shape(kb, 1)
            sizes = dict(nb=nb, n=nb * TILE, k=quads * 4, quads=quads, qb=qb, t=TILE)
            half = active().matrix_units
            # Only with matrix units: vulkan's SPIR-V lowering of the formed dispatch ran for over 14 minutes at
            # Qwen3 0.6B's widths (two layers) and was stopped, where the two apart compile in seconds.
            if active().q4_rows_fused and half:
                name = f"eddy_mm_i8s_{nb * TILE}x{quads * 4}_r{rows}_one" + ("_h" if half else "")
                emit(kb, name, _one_form(name, rows, sizes, half))
            else:
                inner = f"eddy_mm_i8_{nb * TILE}x{quads * 4}_r{rows}"
                name = f"{inner}_scaled"
                emit(kb, name, _SCALED.format(
                    name=name, inner=inner, m=rows,
                    inner_module=with_rows(_MM_I8.format(name=inner, **sizes), rows).strip()[len("module {"):-1],
                    **sizes))

    return {"i8": mmt_i8, "i8_scaled": mmt_i8_scaled}
