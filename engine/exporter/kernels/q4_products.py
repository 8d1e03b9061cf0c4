"""q4's matrix products as custom ops (needs torch and turbine at export): 4-bit codes with group scales and offsets in
the tiled layout (engine/exporter/q4.py). `q4_linear`, prefill's `q4_linear_parts` (q, k and v in three outputs) and
decode's `q4_linear_swiglu` (SwiGLU's down product, its activation made inside it: x86 only). Forms by the rows
multiplied and the plan (plan.py): on an x86 CPU written by hand with integer dot products (dot_products.py for
one row, prefill_products.py for many); otherwise one generic, which on a cpu carries an llvm-cpu lowering that
keeps a row per vector lane, and off it reads the codes a byte at a time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import Q4_TILE_ROWS as Q4_TILE
from . import dot_products, prefill_products
from .plan import active
from .registry import MV_X86, Kit, cpu_lowering, product_pieces, registered, with_rows

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


def q4_linear(x: torch.Tensor, packed: torch.Tensor, *numbers: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W.T for a tiled q4 matrix W [out, in] (its codes, then its numbers: q4.Q4_NUMBERS): the fused
    custom op in an export, plain torch otherwise."""
    lead = x.shape[:-1]
    return _ops()["q4"](x.reshape(-1, x.shape[-1]), packed, *numbers).reshape(*lead, packed.shape[0] * Q4_TILE)


def q4_linear_swiglu(gate_up: torch.Tensor, packed: torch.Tensor, *numbers: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up @ W.T for decode's one row gate_up [1, 2 x in] = gate | up and a tiled q4 matrix W [out, in]:
    SwiGLU's down product, the activation made inside the product's hand-written dispatch as it rounds x
    (dot_products.quantise_group), where it was a dispatch of its own (an x86 CPU's decode only)."""
    return _ops()["q4_swiglu"](gate_up, packed, *numbers)


def q4_linear_parts(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    units: torch.Tensor, first: int, second: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_linear of prefill's x [rows, in] as three tensors: its first `first` columns, the next `second`, the rest.
    The hand-written product of many rows (an x86 CPU) writes each to its own output; elsewhere they are slices of
    one product (and wherever a part is not in whole tiles of rows): the op's form is chosen when the export is
    lowered (its KernelPlan: plan.py), after the model is traced."""
    return _ops()["q4_parts"](x, packed, scale, offset, units, first, second)


# Prefill's q4 form reads the codes through a 7-d view of the tiled layout (engine/exporter/q4.py): [tile, super-block
# s, group c in it, block h, row r, position j, nibble], the position in the group being nibble * 16 + h * 4 + j;
# the group's factors as [tile, s, c, row] and its super-block's three units each as [tile, s, row] (_Q4_FACTORS):
# every index of the generics is then a plain dimension.
_Q4_VIEW = r"""
  %q = flow.tensor.bitcast %qs : tensor<{nb}x{groups}x{gb}xi8> -> tensor<{nb}x{groups}x{gc}xi4>
  %q6 = tensor.expand_shape %q [[0], [1, 2], [3, 4, 5, 6]] output_shape [{nb}, {supers}, {per}, 4, {t}, 4, 2] : tensor<{nb}x{groups}x{gc}xi4> into tensor<{nb}x{supers}x{per}x4x{t}x4x2xi4>"""

_Q4_FACTORS = r"""
  %d4 = tensor.expand_shape %d [[0], [1, 2], [3]] output_shape [{nb}, {supers}, {per}, {t}] : tensor<{nb}x{groups}x{t}xi8> into tensor<{nb}x{supers}x{per}x{t}xi8>
  %m4 = tensor.expand_shape %m [[0], [1, 2], [3]] output_shape [{nb}, {supers}, {per}, {t}] : tensor<{nb}x{groups}x{t}xi8> into tensor<{nb}x{supers}x{per}x{t}xi8>
  %ds = tensor.extract_slice %units[0, 0, 0, 0] [{nb}, {supers}, 1, {t}] [1, 1, 1, 1] : tensor<{nb}x{supers}x3x{t}xf16> to tensor<{nb}x{supers}x{t}xf16>
  %ms = tensor.extract_slice %units[0, 0, 1, 0] [{nb}, {supers}, 1, {t}] [1, 1, 1, 1] : tensor<{nb}x{supers}x3x{t}xf16> to tensor<{nb}x{supers}x{t}xf16>
  %bs = tensor.extract_slice %units[0, 0, 2, 0] [{nb}, {supers}, 1, {t}] [1, 1, 1, 1] : tensor<{nb}x{supers}x3x{t}xf16> to tensor<{nb}x{supers}x{t}xf16>"""

_Q4_ARGS = ("%qs: tensor<{nb}x{groups}x{gb}xi8>, %d: tensor<{nb}x{groups}x{t}xi8>, %m: tensor<{nb}x{groups}x{t}xi8>, "
            "%units: tensor<{nb}x{supers}x3x{t}xf16>")

# A group's scale and offset (%dv, %mv) from its factors (%dq, %mq) and its super-block's units (%dh, %mh, %bh).
_Q4_NUMBERS = r"""
    %dqf = arith.uitofp %dq : i8 to f32
    %mqf = arith.uitofp %mq : i8 to f32
    %dhf = arith.extf %dh : f16 to f32
    %mhf = arith.extf %mh : f16 to f32
    %bhf = arith.extf %bh : f16 to f32
    %dv = arith.mulf %dqf, %dhf : f32
    %mv = math.fma %mqf, %mhf, %bhf : f32"""

# q4, prefill (any number of rows) off x86: the tile is widened back to float32 rows in one generic, which IREE fuses
# with the packing of the data-tiled matmul, then a contraction over the groups and their weights.
_MM_Q4 = r"""
module {{
util.func private @{name}(%a: tensor<?x{k}xf32>, """ + _Q4_ARGS + r""") -> tensor<?x{n}xf32> {{
  %c0 = arith.constant 0 : index
  %rows = tensor.dim %a, %c0 : tensor<?x{k}xf32>""" + _Q4_VIEW + _Q4_FACTORS + r"""
  %a3 = tensor.expand_shape %a [[0], [1, 2]] output_shape [%rows, {groups}, {g}] : tensor<?x{k}xf32> into tensor<?x{groups}x{g}xf32>
  %e = tensor.empty() : tensor<{nb}x{t}x{supers}x{per}x2x4x4xf32>
  %w6 = linalg.generic {{
      indexing_maps = [affine_map<(b, r, s, c, u, h, j) -> (b, s, c, h, r, j, u)>, affine_map<(b, r, s, c, u, h, j) -> (b, s, c, r)>,
                       affine_map<(b, r, s, c, u, h, j) -> (b, s, c, r)>, affine_map<(b, r, s, c, u, h, j) -> (b, s, r)>,
                       affine_map<(b, r, s, c, u, h, j) -> (b, s, r)>, affine_map<(b, r, s, c, u, h, j) -> (b, s, r)>,
                       affine_map<(b, r, s, c, u, h, j) -> (b, r, s, c, u, h, j)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%q6, %d4, %m4, %ds, %ms, %bs : tensor<{nb}x{supers}x{per}x4x{t}x4x2xi4>, tensor<{nb}x{supers}x{per}x{t}xi8>,
                                         tensor<{nb}x{supers}x{per}x{t}xi8>, tensor<{nb}x{supers}x{t}xf16>,
                                         tensor<{nb}x{supers}x{t}xf16>, tensor<{nb}x{supers}x{t}xf16>)
      outs(%e : tensor<{nb}x{t}x{supers}x{per}x2x4x4xf32>) {{
  ^bb0(%qv: i4, %dq: i8, %mq: i8, %dh: f16, %mh: f16, %bh: f16, %o: f32):
    %0 = arith.extui %qv : i4 to i32
    %1 = arith.uitofp %0 : i32 to f32""" + _Q4_NUMBERS + r"""
    %2 = arith.mulf %1, %dv : f32
    %3 = arith.addf %2, %mv : f32
    linalg.yield %3 : f32
  }} -> tensor<{nb}x{t}x{supers}x{per}x2x4x4xf32>
  %w = tensor.collapse_shape %w6 [[0, 1], [2, 3], [4, 5, 6]] : tensor<{nb}x{t}x{supers}x{per}x2x4x4xf32> into tensor<{n}x{groups}x{g}xf32>
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty(%rows) : tensor<?x{n}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<?x{n}xf32>) -> tensor<?x{n}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d1, d2, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%a3, %w : tensor<?x{groups}x{g}xf32>, tensor<{n}x{groups}x{g}xf32>) outs(%acc : tensor<?x{n}xf32>) {{
  ^bb0(%x: f32, %y: f32, %o: f32):
    %0 = arith.mulf %x, %y : f32
    %1 = arith.addf %0, %o : f32
    linalg.yield %1 : f32
  }} -> tensor<?x{n}xf32>
  util.return %r : tensor<?x{n}xf32>
}}
}}
"""

# q4, prefill on a GPU (Device.q4_rows_fused): _MM_Q4 with the widening and the product handed to IREE as one formed
# dispatch, so that the widened matrix is never written out (IREE's own formation leaves the widening a dispatch of its
# own: isDequantizationLikeOp takes no group numbers computed in float). The product runs over the tiled layout's own
# dimensions: a reshape between the two left the widening unfused (llvm-cpu failed its distribution). The codes are
# read as bytes, each position's nibble shifted out: as i4, SPIR-V lowering failed on `vector.bitcast vector<1xi8> to
# vector<2xi4>`. Rows fixed (with_rows). On a device with matrix units (Device.matrix_units: cuda's tensor cores) the
# matrix is widened to float16 and x rounded to it, inside the same dispatch, and their products summed in float32
# (`{wt}` f16: registry.product_pieces), which IREE gives the units: `mma.m16n8k16...f32` for sm_89 at a 1B's widths, none
# in float32.
_MM_Q4_ONE = r"""
module {{
util.func private @{name}(%a: tensor<{m}x{k}xf32>, """ + _Q4_ARGS + r""") -> tensor<{m}x{n}xf32> {{
  %q5 = tensor.expand_shape %qs [[0], [1, 2], [3, 4, 5]] output_shape [{nb}, {supers}, {per}, 4, {t}, 4] : tensor<{nb}x{groups}x{gb}xi8> into tensor<{nb}x{supers}x{per}x4x{t}x4xi8>""" + _Q4_FACTORS + r"""
  %a6 = tensor.expand_shape %a [[0], [1, 2, 3, 4, 5]] output_shape [{m}, {supers}, {per}, 2, 4, 4] : tensor<{m}x{k}xf32> into tensor<{m}x{supers}x{per}x2x4x4xf32>
  %c4 = arith.constant 4 : index
  %c15 = arith.constant 15 : i8
  %r = flow.dispatch.region -> (tensor<{m}x{nb}x{t}xf32>) {{
  %e = tensor.empty() : tensor<{nb}x{t}x{supers}x{per}x2x4x4x{wt}>
  %w = linalg.generic {{
      indexing_maps = [affine_map<(b, r, s, c, u, h, j) -> (b, s, c, h, r, j)>, affine_map<(b, r, s, c, u, h, j) -> (b, s, c, r)>,
                       affine_map<(b, r, s, c, u, h, j) -> (b, s, c, r)>, affine_map<(b, r, s, c, u, h, j) -> (b, s, r)>,
                       affine_map<(b, r, s, c, u, h, j) -> (b, s, r)>, affine_map<(b, r, s, c, u, h, j) -> (b, s, r)>,
                       affine_map<(b, r, s, c, u, h, j) -> (b, r, s, c, u, h, j)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%q5, %d4, %m4, %ds, %ms, %bs : tensor<{nb}x{supers}x{per}x4x{t}x4xi8>, tensor<{nb}x{supers}x{per}x{t}xi8>,
                                         tensor<{nb}x{supers}x{per}x{t}xi8>, tensor<{nb}x{supers}x{t}xf16>,
                                         tensor<{nb}x{supers}x{t}xf16>, tensor<{nb}x{supers}x{t}xf16>)
      outs(%e : tensor<{nb}x{t}x{supers}x{per}x2x4x4x{wt}>) {{
  ^bb0(%qb: i8, %dq: i8, %mq: i8, %dh: f16, %mh: f16, %bh: f16, %o: {wt}):
    %u = linalg.index 4 : index
    %u4 = arith.muli %u, %c4 : index
    %sh = arith.index_cast %u4 : index to i8
    %qu = arith.shrui %qb, %sh : i8
    %0 = arith.andi %qu, %c15 : i8
    %1 = arith.uitofp %0 : i8 to f32""" + _Q4_NUMBERS + r"""
    %2 = arith.mulf %1, %dv : f32
    %3 = arith.addf %2, %mv : f32{narrow}
  }} -> tensor<{nb}x{t}x{supers}x{per}x2x4x4x{wt}>{round_x}
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty() : tensor<{m}x{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{m}x{nb}x{t}xf32>) -> tensor<{m}x{nb}x{t}xf32>
  %p = linalg.generic {{
      indexing_maps = [affine_map<(i, b, r, s, c, u, h, j) -> (i, s, c, u, h, j)>,
                       affine_map<(i, b, r, s, c, u, h, j) -> (b, r, s, c, u, h, j)>,
                       affine_map<(i, b, r, s, c, u, h, j) -> (i, b, r)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction", "reduction", "reduction", "reduction"]}}
      ins({xa}, %w : tensor<{m}x{supers}x{per}x2x4x4x{wt}>, tensor<{nb}x{t}x{supers}x{per}x2x4x4x{wt}>)
      outs(%acc : tensor<{m}x{nb}x{t}xf32>) {{
  ^bb0(%x: {wt}, %y: {wt}, %o: f32):{widen}
    %0 = arith.mulf {xv}, {yv} : f32
    %1 = arith.addf %0, %o : f32
    linalg.yield %1 : f32
  }} -> tensor<{m}x{nb}x{t}xf32>
  flow.return %p : tensor<{m}x{nb}x{t}xf32>
  }}
  %r2 = tensor.collapse_shape %r [[0], [1, 2]] : tensor<{m}x{nb}x{t}xf32> into tensor<{m}x{n}xf32>
  util.return %r2 : tensor<{m}x{n}xf32>
}}
}}
"""


def _one_form(name: str, rows: int, sizes: dict, half: bool) -> str:
    """_MM_Q4_ONE as @name for `rows` rows, its products in float16 (`half`: matrix units) or float32."""
    pieces = product_pieces(half, "%a6", f"{rows}x{sizes['supers']}x{sizes['per']}x2x4x4")
    narrow = "\n    %4 = arith.truncf %3 : f32 to f16\n    linalg.yield %4 : f16" if half else "\n    linalg.yield %3 : f32"
    return _MM_Q4_ONE.format(name=name, m=rows, narrow=narrow, **pieces, **sizes)


# q4, decode (one row), the generic form of CPUs without a hand-written one (GPUs: _MV_Q4_BYTES): out[b, r] = sum
# over the group's positions of (code * d + m) * x, vectorised along the tile's rows r. Each row's 4 bytes of a block are
# read as one int32 (16 rows' are 64 contiguous bytes: one vector load) and the code of position (u, j) taken out
# with a shift by 8j + 4u: indexing the nibbles as i4 gathered 16 rows 4 bytes apart, several times slower. The
# product is math.fma(w, x, 0) and not a mulf: IREE turns a reduction of a mulf into a vector.contract, which it
# lowers here as one scalar multiply-add per lane.
_MV_Q4 = r"""
module {{
util.func private @{name}(%a: tensor<1x{k}xf32>, """ + _Q4_ARGS + r""") -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  %a4 = tensor.expand_shape %a1 [[0, 1, 2, 3, 4]] output_shape [{supers}, {per}, 2, 4, 4] : tensor<{k}xf32> into tensor<{supers}x{per}x2x4x4xf32>
  %qw = flow.tensor.bitcast %qs : tensor<{nb}x{groups}x{gb}xi8> -> tensor<{nb}x{groups}x{gw}xi32>
  %q4 = tensor.expand_shape %qw [[0], [1, 2], [3, 4]] output_shape [{nb}, {supers}, {per}, 4, {t}] : tensor<{nb}x{groups}x{gw}xi32> into tensor<{nb}x{supers}x{per}x4x{t}xi32>""" + _Q4_FACTORS + r"""
  %zero = arith.constant 0.000000e+00 : f32
  %c4 = arith.constant 4 : index
  %c8 = arith.constant 8 : index
  %c15 = arith.constant 15 : i32
  %oe = tensor.empty() : tensor<{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{nb}x{t}xf32>) -> tensor<{nb}x{t}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(b, r, s, c, h, u, j) -> (s, c, u, h, j)>, affine_map<(b, r, s, c, h, u, j) -> (b, s, c, h, r)>,
                       affine_map<(b, r, s, c, h, u, j) -> (b, s, c, r)>, affine_map<(b, r, s, c, h, u, j) -> (b, s, c, r)>,
                       affine_map<(b, r, s, c, h, u, j) -> (b, s, r)>, affine_map<(b, r, s, c, h, u, j) -> (b, s, r)>,
                       affine_map<(b, r, s, c, h, u, j) -> (b, s, r)>, affine_map<(b, r, s, c, h, u, j) -> (b, r)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction", "reduction", "reduction", "reduction"]}}
      ins(%a4, %q4, %d4, %m4, %ds, %ms, %bs : tensor<{supers}x{per}x2x4x4xf32>, tensor<{nb}x{supers}x{per}x4x{t}xi32>,
                                              tensor<{nb}x{supers}x{per}x{t}xi8>, tensor<{nb}x{supers}x{per}x{t}xi8>,
                                              tensor<{nb}x{supers}x{t}xf16>, tensor<{nb}x{supers}x{t}xf16>,
                                              tensor<{nb}x{supers}x{t}xf16>)
      outs(%acc : tensor<{nb}x{t}xf32>) {attrs} {{
  ^bb0(%x: f32, %w: i32, %dq: i8, %mq: i8, %dh: f16, %mh: f16, %bh: f16, %o: f32):
    %u = linalg.index 5 : index
    %j = linalg.index 6 : index
    %u4 = arith.muli %u, %c4 : index
    %j8 = arith.muli %j, %c8 : index
    %sh = arith.addi %u4, %j8 : index
    %shi = arith.index_cast %sh : index to i32
    %s = arith.shrui %w, %shi : i32
    %c = arith.andi %s, %c15 : i32
    %f = arith.sitofp %c : i32 to f32""" + _Q4_NUMBERS + r"""
    %wv = math.fma %f, %dv, %mv : f32
    %p = math.fma %wv, %x, %zero : f32
    %y = arith.addf %p, %o : f32
    linalg.yield %y : f32
  }} -> tensor<{nb}x{t}xf32>
  %r1 = tensor.collapse_shape %r [[0, 1]] : tensor<{nb}x{t}xf32> into tensor<{n}xf32>
  %r2 = tensor.expand_shape %r1 [[0, 1]] output_shape [1, {n}] : tensor<{n}xf32> into tensor<1x{n}xf32>
  util.return %r2 : tensor<1x{n}xf32>
}}
}}
"""

# q4, decode (one row), off the CPU: as _MV_Q4, but over the codes' bytes, each giving its two nibbles' products
# (the low one is position u = 0, the high one u = 1, so x is read twice, at u = 0 and u = 1): no linalg.index,
# which IREE's SPIR-V lowering of such a reduction kept in workgroup memory as `index` values it cannot hold.
_MV_Q4_BYTES = r"""
module {{
util.func private @{name}(%a: tensor<1x{k}xf32>, """ + _Q4_ARGS + r""") -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  %a4 = tensor.expand_shape %a1 [[0, 1, 2, 3, 4]] output_shape [{supers}, {per}, 2, 4, 4] : tensor<{k}xf32> into tensor<{supers}x{per}x2x4x4xf32>
  %q5 = tensor.expand_shape %qs [[0], [1, 2], [3, 4, 5]] output_shape [{nb}, {supers}, {per}, 4, {t}, 4] : tensor<{nb}x{groups}x{gb}xi8> into tensor<{nb}x{supers}x{per}x4x{t}x4xi8>""" + _Q4_FACTORS + r"""
  %zero = arith.constant 0.000000e+00 : f32
  %c4 = arith.constant 4 : i8
  %c15 = arith.constant 15 : i8
  %oe = tensor.empty() : tensor<{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{nb}x{t}xf32>) -> tensor<{nb}x{t}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(b, r, s, c, h, j) -> (s, c, 0, h, j)>, affine_map<(b, r, s, c, h, j) -> (s, c, 1, h, j)>,
                       affine_map<(b, r, s, c, h, j) -> (b, s, c, h, r, j)>,
                       affine_map<(b, r, s, c, h, j) -> (b, s, c, r)>, affine_map<(b, r, s, c, h, j) -> (b, s, c, r)>,
                       affine_map<(b, r, s, c, h, j) -> (b, s, r)>, affine_map<(b, r, s, c, h, j) -> (b, s, r)>,
                       affine_map<(b, r, s, c, h, j) -> (b, s, r)>, affine_map<(b, r, s, c, h, j) -> (b, r)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction", "reduction", "reduction"]}}
      ins(%a4, %a4, %q5, %d4, %m4, %ds, %ms, %bs : tensor<{supers}x{per}x2x4x4xf32>, tensor<{supers}x{per}x2x4x4xf32>,
                                                   tensor<{nb}x{supers}x{per}x4x{t}x4xi8>,
                                                   tensor<{nb}x{supers}x{per}x{t}xi8>, tensor<{nb}x{supers}x{per}x{t}xi8>,
                                                   tensor<{nb}x{supers}x{t}xf16>, tensor<{nb}x{supers}x{t}xf16>,
                                                   tensor<{nb}x{supers}x{t}xf16>)
      outs(%acc : tensor<{nb}x{t}xf32>) {{
  ^bb0(%xl: f32, %xh: f32, %w: i8, %dq: i8, %mq: i8, %dh: f16, %mh: f16, %bh: f16, %o: f32):
    %lo = arith.andi %w, %c15 : i8
    %hi = arith.shrui %w, %c4 : i8
    %lof = arith.uitofp %lo : i8 to f32
    %hif = arith.uitofp %hi : i8 to f32""" + _Q4_NUMBERS + r"""
    %wl = math.fma %lof, %dv, %mv : f32
    %wh = math.fma %hif, %dv, %mv : f32
    %pl = arith.mulf %wl, %xl : f32
    %ph = math.fma %wh, %xh, %pl : f32
    %y = arith.addf %ph, %o : f32
    linalg.yield %y : f32
  }} -> tensor<{nb}x{t}xf32>
  %r1 = tensor.collapse_shape %r [[0, 1]] : tensor<{nb}x{t}xf32> into tensor<{n}xf32>
  %r2 = tensor.expand_shape %r1 [[0, 1]] output_shape [1, {n}] : tensor<{n}xf32> into tensor<1x{n}xf32>
  util.return %r2 : tensor<1x{n}xf32>
}}
}}
"""

# q4, any number of rows, on an x86 CPU: x (and in two steps its rounding error) quantised per group, then
# the hand-written integer product of those rows, summed per row of x (engine/exporter/kernels/prefill_products.py).
_MM_X86 = r"""
module {{
{executables}
util.func private @{name}(%a: tensor<?x{k}xf32>, {args}) -> ({result_types}) {{
  %c0 = arith.constant 0 : index
  %csteps = arith.constant {steps} : index
  %rows = tensor.dim %a, %c0 : tensor<?x{k}xf32>
  %rows2 = arith.muli %rows, %csteps : index
  {quantise}
  {call}
  util.return {results} : {result_types}
}}
}}
"""

# q4_linear_parts where there is no hand-written product: the product (the function @{inner}, merged in from its own
# template), then its columns sliced into the parts.
_PARTS_OF_PRODUCT = r"""
module {{
{inner_module}
util.func private @{name}(%a: tensor<?x{k}xf32>, {args}) -> ({result_types}) {{
  %c0 = arith.constant 0 : index
  %rows = tensor.dim %a, %c0 : tensor<?x{k}xf32>
  %r = util.call @{inner}(%a, %qs, %d, %m, %units) : (tensor<?x{k}xf32>, {arg_types}) -> tensor<?x{n}xf32>
  {slices}
  util.return {results} : {result_types}
}}
}}
"""

# A product of dynamic rows (`inner`) called with fixed ones, behind casts.
_STATIC_ROWS = r"""
module {{
{inner_module}
util.func private @{name}(%a: tensor<{m}x{k}xf32>, {args}) -> ({static_types}) {{
  %ad = tensor.cast %a : tensor<{m}x{k}xf32> to tensor<?x{k}xf32>
  %r:{n_out} = util.call @{inner}(%ad, %qs, %d, %m, %units) : (tensor<?x{k}xf32>, {arg_types}) -> ({dyn_types})
  {casts}
  util.return {results} : {static_types}
}}
}}
"""

# The MLIR names of a q4 product's numbers (_Q4_ARGS), as the hand-written calls bind them.
Q4_ARG_NAMES = ("%d", "%m", "%units")


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    from ...config import super_groups
    from ..q4 import Q4_NUMBERS, dequantise_q4, untile_q4

    CustomOp, library, select, emit, shape = kit.CustomOp, kit.library, kit.select, kit.emit, kit.shape

    def dense_q4(qs: torch.Tensor, *numbers: torch.Tensor) -> torch.Tensor:
        return dequantise_q4(*untile_q4({"weight": qs, **dict(zip(Q4_NUMBERS, numbers))}).values())


    def emit_q4_rows(kb: KernelBuilder, sizes: dict, nb: int, k: int, parts: tuple[int, ...]) -> None:
        """The hand-written product of many rows (prefill_products.py), one output or one per part (tiles each)."""
        rows = shape(kb, 0)[0]
        tag = (f"{nb * Q4_TILE}x{k}" + "".join(f"_{p * Q4_TILE}" for p in parts) + f"_x{active().x_steps}"
               + (f"_r{rows}" if rows >= 0 else ""))
        name = f"eddy_mm_q4_{tag}_{active().dot_form}"
        qx, exe = f"eddy_qx_{tag}_{active().dot_form}", f"eddy_q4_rows_{tag}_{active().dot_form}"
        outs = parts or (nb,)
        asm = _MM_X86.format(
            name=name, args=_Q4_ARGS.format(**sizes), steps=active().x_steps,
            executables=prefill_products.quantise_rows_executable(qx, k, active().x_steps)
            + prefill_products.q4_rows_executable(active().dot_form, exe, nb, k, parts, active().x_steps),
            quantise=prefill_products.quantise_rows_call(qx, k, "%a", "%rows", "%rows2", "%xq", "%xs"),
            call=prefill_products.q4_rows_call(exe, nb, k, "%xq", "%xs", "%rows", "%rows2", "%qs", Q4_ARG_NAMES,
                                               f"%r:{len(outs)}" if parts else "%r", parts),
            result_types=", ".join(f"tensor<?x{p * Q4_TILE}xf32>" for p in outs),
            results=", ".join(f"%r#{i}" for i in range(len(outs))) if parts else "%r", **sizes)
        if rows >= 0:  # fixed rows (a test's trace): the dynamic function behind casts
            inner, name = name, f"{name}_fixed"
            asm = _STATIC_ROWS.format(
                inner_module=asm.strip()[len("module {"):-1], name=name, inner=inner, m=rows, n_out=len(outs),
                args=_Q4_ARGS.format(**sizes), k=k, arg_types=", ".join(
                    t.split(": ")[1] for t in _Q4_ARGS.format(**sizes).split(", ")),
                dyn_types=", ".join(f"tensor<?x{p * Q4_TILE}xf32>" for p in outs),
                static_types=", ".join(f"tensor<{rows}x{p * Q4_TILE}xf32>" for p in outs),
                casts="\n  ".join(f"%s{i} = tensor.cast %r#{i} : tensor<?x{p * Q4_TILE}xf32> to "
                                   f"tensor<{rows}x{p * Q4_TILE}xf32>" for i, p in enumerate(outs)),
                results=", ".join(f"%s{i}" for i in range(len(outs))))
        emit(kb, name, asm)

    def q4_sizes(kb: KernelBuilder, k: int | None = None) -> tuple[dict, int, int]:
        """The template sizes of a q4 product whose x is k wide (default: argument 0's width)."""
        (_, width), (nb, groups, gb) = shape(kb, 0), shape(kb, 1)
        k = width if k is None else k
        per = super_groups(groups)
        return (dict(nb=nb, n=nb * Q4_TILE, k=k, gb=gb, gc=2 * gb, gw=gb // 4, t=Q4_TILE, groups=groups,
                     g=k // groups, per=per, supers=groups // per), nb, k)

    @CustomOp.register(library=library)
    class mmt_q4_parts(CustomOp):
        """mmt_q4 of many rows with its output columns in parts (the first `first` and the next `second` columns,
        then the rest), each a tensor of its own: q, k and v, which as slices of one [rows, q|k|v] tensor were three
        strided copies a layer. The hand-written product (an x86 CPU) stores each part in its own output; elsewhere
        the parts are slices of the product, inside the op."""
        signature = ("mmt_q4_parts(Tensor a, Tensor qs, Tensor d, Tensor m, Tensor u, int first, int second) "
                     "-> (Tensor, Tensor, Tensor)")

        def select(self, ksel: KernelSelection) -> None:
            a, *weights = (ksel.arg_tensor(i) for i in range(5))
            for t in weights:
                t.specialize_all_dims()
            if isinstance(a.t.shape[0], int):  # as Kit.select's fixed_rows
                a.specialize_all_dims()
            else:
                a.specialize_dims(1)
            first, second = ksel.attr_int(5).v, ksel.attr_int(6).v
            rest = weights[0].t.shape[0] * Q4_TILE - first - second
            for cols in (first, second, rest):
                ksel.return_new_tensor([a.t.shape[0], cols], dtype=torch.float32)

        def eager_execute(self, a, qs, d, m, u, first, second):
            y = a @ dense_q4(qs, d, m, u).T
            return y[:, :first], y[:, first:first + second], y[:, first + second:]

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            sizes, nb, k = q4_sizes(kb)
            first, second = (ksel.arg_descs[i].v for i in (5, 6))
            cols = (first, second, nb * Q4_TILE - first - second)
            if active().dot_form and first % Q4_TILE == 0 and second % Q4_TILE == 0:
                emit_q4_rows(kb, sizes, nb, k, tuple(c // Q4_TILE for c in cols))
                return
            rows = shape(kb, 0)[0]
            fused, half = active().q4_rows_fused and rows >= 0, active().matrix_units
            inner = (f"eddy_mm_q4_{nb * Q4_TILE}x{k}" + (f"_r{rows}" if rows >= 0 else "")
                     + (("_one_h" if half else "_one") if fused else ""))
            tag = "_".join(map(str, cols))
            module = (_one_form(inner, rows, sizes, half) if fused
                      else _MM_Q4.format(name=inner, m=rows, **sizes)).strip()
            types = [f"tensor<?x{c}xf32>" for c in cols]
            slices = "\n  ".join(
                f"%p{i} = tensor.extract_slice %r[0, {sum(cols[:i])}] [%rows, {c}] [1, 1] : "
                f"tensor<?x{nb * Q4_TILE}xf32> to {types[i]}" for i, c in enumerate(cols))
            name = f"{inner}_parts_{tag}"
            emit(kb, name, with_rows(_PARTS_OF_PRODUCT.format(
                name=name, inner=inner, inner_module=module[len("module {"):-1], args=_Q4_ARGS.format(**sizes),
                arg_types=", ".join(t.split(": ")[1] for t in _Q4_ARGS.format(**sizes).split(", ")),
                slices=slices, results="%p0, %p1, %p2", result_types=", ".join(types), **sizes), rows))

    @CustomOp.register(library=library)
    class mv_q4_swiglu(CustomOp):
        signature = "mv_q4_swiglu(Tensor a, Tensor qs, Tensor d, Tensor m, Tensor u) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select(ksel, 5, Q4_TILE)

        def eager_execute(self, a, qs, d, m, u):
            k = a.shape[1] // 2
            return (torch.nn.functional.silu(a[:, :k]) * a[:, k:]) @ dense_q4(qs, d, m, u).T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (rows, k2), (nb, groups, gb) = shape(kb, 0), shape(kb, 1)
            form = active().dot_form
            if rows != 1 or form is None:
                raise NotImplementedError(f"the SwiGLU down product is decode's by hand only (asked: {rows} rows, "
                                          f"dot form {form})")
            sizes, _, k = q4_sizes(kb, k2 // 2)
            name = f"eddy_mv_q4_swiglu_{nb * Q4_TILE}x{k}_{form}"
            exe = f"eddy_q4_swiglu_{nb * Q4_TILE}x{k}_{form}"
            emit(kb, name, MV_X86.format(
                name=name, args=_Q4_ARGS.format(**sizes), executable=dot_products.q4_executable(
                    form, exe, nb, k, swiglu=True),
                call=dot_products.q4_call(exe, nb, k, "%a1", "%qs", Q4_ARG_NAMES, "%r", swiglu=True),
                **{**sizes, "k": k2}))

    @CustomOp.register(library=library)
    class mmt_q4(CustomOp):
        signature = "mmt_q4(Tensor a, Tensor qs, Tensor d, Tensor m, Tensor u) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select(ksel, 5, Q4_TILE, fixed_rows=True)

        def eager_execute(self, a, qs, d, m, u):
            return a @ dense_q4(qs, d, m, u).T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            sizes, nb, k = q4_sizes(kb)
            rows, tag = shape(kb, 0)[0], f"{nb * Q4_TILE}x{k}"
            if rows != 1 and active().dot_form:
                emit_q4_rows(kb, sizes, nb, k, ())
            elif rows != 1:
                fused = active().q4_rows_fused and rows >= 0  # the portable vulkan target's rows are dynamic
                half = active().matrix_units
                name = (f"eddy_mm_q4_{tag}" + (f"_r{rows}" if rows >= 0 else "")
                        + (("_one_h" if half else "_one") if fused else ""))
                emit(kb, name, with_rows(_one_form(name, rows, sizes, half) if fused
                                         else _MM_Q4.format(name=name, m=rows, **sizes), rows))
            elif active().dot_form:
                name = f"eddy_mv_q4_{tag}_{active().dot_form}"
                exe = f"eddy_q4_{tag}_{active().dot_form}"
                emit(kb, name, MV_X86.format(
                    name=name, args=_Q4_ARGS.format(**sizes),
                    executable=dot_products.q4_executable(active().dot_form, exe, nb, k),
                    call=dot_products.q4_call(exe, nb, k, "%a1", "%qs", Q4_ARG_NAMES, "%r"), **sizes))
            else:
                name = f"eddy_mv_q4_{tag}{'_cpu' if active().cpu_tuned else ''}"
                if active().cpu_tuned:
                    emit(kb, name, _MV_Q4.format(name=name, attrs=cpu_lowering(nb, 5, Q4_TILE), **sizes))
                else:
                    emit(kb, name, _MV_Q4_BYTES.format(name=name, **sizes))


    return {"q4": mmt_q4, "q4_parts": mmt_q4_parts, "q4_swiglu": mv_q4_swiglu}
