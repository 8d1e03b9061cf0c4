"""The matrix products of quantised weights as custom ops, written as MLIR (needs torch and turbine at export).

Two ops, each with two forms chosen by the number of rows multiplied:
  * `q4_linear`: 4-bit codes with group scales and offsets, in the tiled layout (engine/exporter/q4.py), and
    `q4_linear_parts`, prefill's with its output in three tensors (q, k and v);
  * `i8_linear`: int8 weights tiled (`tile_q8`), the products of q8's tiled matrices before their per-row scale
    (which the caller applies: it is one multiply of the output).
And two for decode's attention, which reads the cache in place:
  * `query_keys`: the query heads against the cached keys, plus the mask (the scores);
  * `weighted_values`: the probabilities times the cached values;
and `query_keys_rows` / `weighted_values_rows`, prefill's scores and output (many queries) on a cpu, the latter
in the output projection's order; `softmax_over_slots`, attention's softmax on a cpu, one dispatch a layer;
`attend_rows`, prefill's whole attention in one dispatch on a cpu (scores, softmax and output).
And `first_slots` / `first_blocks`, a layer's keys or values in the cache's first slots (what a call attends to:
model.py), as a plain slice or in blocks of ATTEND_STEP slots.
As batch matmuls IREE data-tiles them and so re-packs the whole cache's keys and values on every step; as
generics whose body is not a plain multiply-add (math.fma(a, b, 0) + acc) they are not taken for contractions,
and carry a cpu lowering instead: 0.16 + 0.15 ms a layer for a 1B's 8 x 4 heads over 1024 slots against 0.38 +
0.28 ms as batch matmuls (bench: iree-benchmark-module on the ops alone, this Xeon).

Tiles. A matrix that is multiplied is stored in tiles of rows (q8: TILE rows, 4 positions at a time,
[out/T, in/4, T x 4]; q4's own blocked layout of 16), so that decode's product (one row: a matrix-vector product)
keeps one output row per vector lane and needs no horizontal sum. With whole rows IREE's default reduced each
group (q4) or each vector of positions (q8) to a scalar inside the loop. Decode's form depends on the device
(`lowering_for`): on an x86 CPU both are written by hand with integer dot products (engine/exporter/kernels/dot_products.py);
otherwise each is one generic carrying an llvm-cpu lowering that keeps those lanes. Any other row count (prefill,
scoring): q4 on an x86 CPU is written by hand too (engine/exporter/kernels/prefill_products.py: x rounded to int8, integer
dot products of the codes as stored); q8, and q4 elsewhere, widen the tile back to float32 rows inside the
dispatch that packs the data-tiled matmul, then multiply.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ...config import ATTEND_STEP
from ...config import Q4_TILE_ROWS as Q4_TILE
from ...config import TILE_ROWS as TILE
from . import attention_rows, dot_products, prefill_products


def tileable(out_features: int, in_features: int) -> bool:
    """Whether a multiplied q8 matrix makes whole tiles: of rows, and of 4 positions along them."""
    return out_features % TILE == 0 and in_features % 4 == 0


def tile_q8(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/T, in/4, T x 4]: each tile's rows 4 positions at a time, byte 4r + j of step p holding
    row r's weight at position 4p + j (the operand of `vpdpbusd`: engine/exporter/kernels/dot_products.py)."""
    out, cols = w.shape
    return w.reshape(out // TILE, TILE, cols // 4, 4).transpose(1, 2).reshape(out // TILE, cols // 4, TILE * 4)


def untile_q8(t: torch.Tensor) -> torch.Tensor:
    """tile_q8's inverse."""
    tiles, quads, _ = t.shape
    return t.reshape(tiles, quads, TILE, 4).transpose(1, 2).reshape(tiles * TILE, quads * 4)


def tiled_rows(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of a tiled q8 matrix (tile_q8), as [n, in] (a tied embedding's lookup): the tile of each,
    then its row."""
    tiles, quads, _ = tiled.shape
    tile = torch.nn.functional.embedding(torch.div(ids, TILE, rounding_mode="floor"), tiled.reshape(tiles, -1))
    row = torch.remainder(ids, TILE).reshape(-1, 1, 1, 1).expand(-1, quads, 1, 4)
    return torch.gather(tile.reshape(-1, quads, TILE, 4), 2, row).reshape(-1, quads * 4)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, *numbers: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W.T for a tiled q4 matrix W [out, in] (its codes, then its numbers: q4.Q4_NUMBERS): the fused
    custom op in an export, plain torch otherwise."""
    lead = x.shape[:-1]
    return _ops()["q4"](x.reshape(-1, x.shape[-1]), packed, *numbers).reshape(*lead, packed.shape[0] * Q4_TILE)


def q4_linear_parts(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    units: torch.Tensor, first: int, second: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_linear of prefill's x [rows, in] as three tensors: its first `first` columns, the next `second`, the rest.
    The hand-written product of many rows (an x86 CPU) writes each to its own output; elsewhere they are slices of
    one product (and wherever a part is not in whole tiles of rows): the op's form is chosen when the export is
    lowered (lowering_for), after the model is traced."""
    return _ops()["q4_parts"](x, packed, scale, offset, units, first, second)


def i8_linear(x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W.T for a tiled int8 matrix W [out, in] (no scale): the custom op in an export."""
    lead = x.shape[:-1]
    return _ops()["i8"](x.reshape(-1, x.shape[-1]), tiled).reshape(*lead, tiled.shape[0] * TILE)


def query_keys(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [kvh, rep, d] . keys [kvh, C, d] + mask [C] -> [kvh, rep, C] (decode's attention scores, q already scaled;
    keys may come as blocks, [kvh, C / ATTEND_STEP, ATTEND_STEP, d]: first_blocks):
    the custom op. The mask starts each sum: as an add after it, IREE fused that add into this op's dispatch,
    whose code then took twice as long."""
    return _ops()["qk"](q, keys, mask)


def weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [kvh, rep, C] @ values [kvh, C, d] -> [kvh, rep, d] (decode's attention output): the custom op."""
    return _ops()["pv"](probs, values)


def weighted_values_rows(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [kvh, rep, n, C] @ values[:, :C] -> [n, kvh, rep, d] (prefill's attention output, in the order the
    output projection takes it): the custom op, for a cpu. `values` [kvh, slots >= C, d] may be a layer of the
    cache as stored (model.KV_STORAGE), read in place and widened as it is read: as a float32 slice it was a
    conversion (or a copy) of its own, 1.1 ms a 30-token turn at 1000 of context (default model). As a torch
    matmul broadcast over rep and then permuted, IREE multiplied it in a generic kernel with the permutation fused
    in: 0.40 ms a layer for 30 queries over 1000 slots, against 0.22 ms here."""
    return _ops()["pv_rows"](probs, values)


def _eager_float(t: torch.Tensor) -> torch.Tensor:
    """Stored keys or values (model.KV_STORAGE: bfloat16 as int16 bits) as float32, for an op's eager form."""
    return (t.view(torch.bfloat16) if t.dtype == torch.int16 else t).float()


def query_keys_rows(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [kvh, rep, n, d] . keys [kvh, C, d] (as the cache stores them: model.KV_STORAGE) -> [kvh, rep, n, C]
    (prefill's attention scores, on a cpu): the custom op, one matmul per kv head with its rep query heads' rows
    stacked. As a torch matmul broadcast over rep, IREE copied the keys transposed once per query head before a
    batch matmul: 0.63 ms a layer for 30 queries over 1000 slots (default model), 0.45 of it the copy."""
    return _ops()["qk_rows"](q, keys)


def attend_rows(q_t: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask_t: torch.Tensor) -> torch.Tensor:
    """softmax(q . keys + mask) . values -> [n, kvh, rep, d] (prefill's attention, in the order the output
    projection takes it, on a cpu): the custom op, one dispatch a layer (engine/exporter/kernels/attention_rows.py). q_t
    [kvh, rep, d, n] is q scaled and transposed; keys and values [kvh, slots, d] are a layer of the cache as
    stored (model.KV_STORAGE), read in place; mask_t [C, n] is the mask transposed, its C the slots attended."""
    return _ops()["attend_rows"](q_t, keys, values, mask_t)


def softmax_over_slots(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scores [kvh, rep, C] or [kvh, rep, n, C] (+ mask [n, C])) over the slots, on a cpu: the custom op,
    one dispatch a layer (engine/exporter/kernels/attention_rows.py). Decode's scores hold their mask already."""
    return _ops()["softmax"](scores) if mask is None else _ops()["softmax_masked"](scores, mask)


def first_blocks(kv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """first_slots as blocks of ATTEND_STEP slots, [kvh, len(like) / ATTEND_STEP, ATTEND_STEP, d]: decode's keys
    for query_keys, whose loops then have a static innermost extent (a view of the cache as blocks, then sliced:
    reshaping the slice instead made IREE copy it)."""
    return _ops()["blocks"](kv, like)


def first_slots(kv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """kv [kvh, slots, d][:, :len(like)]: the custom op. As a torch slice its strides would involve the slot
    count, whose contiguity checks make torch.export fix that count; in MLIR it is a plain extract_slice, which
    IREE reads in place."""
    return _ops()["slots"](kv, like)


_cpu_tuned = False
_dot_form: str | None = None
_x_steps = prefill_products.STEPS


@contextlib.contextmanager
def lowering_for(device: str, dot_form: str | None = None, x_steps: int = prefill_products.STEPS) -> Iterator[None]:
    """Within it, the ops' decode forms are those for `device`: on a cpu, the hand-written products in `dot_form`
    (devices.dot_form: the instructions the build's target CPU has; None off the cpu), else the generic forms with
    the llvm-cpu lowering that keeps a vector accumulator per lane of output rows (IREE's default for these
    reductions tiles the reduction into the vector and sums it horizontally, or, with unit reduction tiles, lowers
    the multiply-add as one scalar per lane). Other devices get IREE's own choice: the attribute names llvm-cpu's
    pipeline. `x_steps`: the rounded rows a row of x becomes in the hand-written prefill products
    (prefill_products.x_steps: the model's width decides)."""
    global _cpu_tuned, _dot_form, _x_steps
    before = _cpu_tuned, _dot_form, _x_steps
    _cpu_tuned, _dot_form, _x_steps = device == "cpu", dot_form, x_steps
    try:
        yield
    finally:
        _cpu_tuned, _dot_form, _x_steps = before


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

# q4 or q8, decode (one row) on an x86 CPU: a call of the hand-written dispatch (engine/exporter/kernels/dot_products.py).
_MV_X86 = r"""
module {{
{executable}
util.func private @{name}(%a: tensor<1x{k}xf32>, {args}) -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  {call}
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

# Decode's attention. Scores: out[h, r, i] = mask[i] + sum over j of q[h, r, j] * keys[h, i, j] (a local ring's
# keys; the cache's come as blocks: _QUERY_BLOCKS). Output rows: out[h, r, i] = sum over j of probs[h, r, j] *
# values[h, j, i]. The product is math.fma(a, b, 0) plus the sum. The slots are a dynamic dimension (model.py).
_QUERY_KEYS = r"""
module {{
util.func private @{name}(%q: tensor<{h}x{r}x{d}xf32>, %k: tensor<{h}x?x{d}xf32>, %m: tensor<?xf32>) -> tensor<{h}x{r}x?xf32> {{
  %zero = arith.constant 0.000000e+00 : f32
  %c1 = arith.constant 1 : index
  %slots = tensor.dim %k, %c1 : tensor<{h}x?x{d}xf32>
  %e = tensor.empty(%slots) : tensor<{h}x{r}x?xf32>
  %masked = linalg.generic {{
      indexing_maps = [affine_map<(h, r, i) -> (i)>, affine_map<(h, r, i) -> (h, r, i)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%m : tensor<?xf32>) outs(%e : tensor<{h}x{r}x?xf32>) {{
  ^bb0(%x: f32, %o: f32):
    linalg.yield %x : f32
  }} -> tensor<{h}x{r}x?xf32>
  %zeros = linalg.fill ins(%zero : f32) outs(%e : tensor<{h}x{r}x?xf32>) -> tensor<{h}x{r}x?xf32>
  %o = linalg.generic {{
      indexing_maps = [affine_map<(h, r, i, j) -> (h, r, j)>, affine_map<(h, r, i, j) -> (h, i, j)>,
                       affine_map<(h, r, i, j) -> (h, r, i)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%q, %k : tensor<{h}x{r}x{d}xf32>, tensor<{h}x?x{d}xf32>) outs({acc} : tensor<{h}x{r}x?xf32>) {attrs} {{
  ^bb0(%x: f32, %y: f32, %s: f32):
    %0 = math.fma %x, %y, %zero : f32
    %1 = arith.addf %0, %s : f32
    linalg.yield %1 : f32
  }} -> tensor<{h}x{r}x?xf32>
  %out = linalg.generic {{
      indexing_maps = [affine_map<(h, r, i) -> (h, r, i)>, affine_map<(h, r, i) -> (i)>, affine_map<(h, r, i) -> (h, r, i)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%o, %m : tensor<{h}x{r}x?xf32>, tensor<?xf32>) outs(%e : tensor<{h}x{r}x?xf32>) {{
  ^bb0(%x: f32, %y: f32, %z: f32):
    %0 = arith.addf %x, %y : f32
    linalg.yield %0 : f32
  }} -> tensor<{h}x{r}x?xf32>
  util.return {result} : tensor<{h}x{r}x?xf32>
}}
}}
"""

# On a cpu the sums start at the mask (`acc`, `result`); off it they start at zero and the mask is added after them:
# IREE's GPU pipeline failed on sums started at a broadcast mask ("map_load ... restricted to lane or thread
# distributed contexts"). The unused ops are dropped.
_MASK_FIRST = {True: dict(acc="%masked", result="%o"), False: dict(acc="%zeros", result="%out")}

# The same over keys in blocks (first_blocks): out[h, r, b, s] = mask[b, s] + sum over j of q[h, r, j] *
# keys[h, b, s, j].
_QUERY_BLOCKS = r"""
module {{
util.func private @{name}(%q: tensor<{h}x{r}x{d}xf32>, %k: tensor<{h}x?x{step}x{d}xf32>, %m: tensor<?xf32>) -> tensor<{h}x{r}x?xf32> {{
  %zero = arith.constant 0.000000e+00 : f32
  %c1 = arith.constant 1 : index
  %blocks = tensor.dim %k, %c1 : tensor<{h}x?x{step}x{d}xf32>
  %mb = tensor.expand_shape %m [[0, 1]] output_shape [%blocks, {step}] : tensor<?xf32> into tensor<?x{step}xf32>
  %e = tensor.empty(%blocks) : tensor<{h}x{r}x?x{step}xf32>
  %acc = linalg.generic {{
      indexing_maps = [affine_map<(h, r, b, s) -> (b, s)>, affine_map<(h, r, b, s) -> (h, r, b, s)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%mb : tensor<?x{step}xf32>) outs(%e : tensor<{h}x{r}x?x{step}xf32>) {{
  ^bb0(%x: f32, %o: f32):
    linalg.yield %x : f32
  }} -> tensor<{h}x{r}x?x{step}xf32>
  %o = linalg.generic {{
      indexing_maps = [affine_map<(h, r, b, s, j) -> (h, r, j)>, affine_map<(h, r, b, s, j) -> (h, b, s, j)>,
                       affine_map<(h, r, b, s, j) -> (h, r, b, s)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}}
      ins(%q, %k : tensor<{h}x{r}x{d}xf32>, tensor<{h}x?x{step}x{d}xf32>) outs(%acc : tensor<{h}x{r}x?x{step}xf32>) {attrs} {{
  ^bb0(%x: f32, %y: f32, %s: f32):
    %0 = math.fma %x, %y, %zero : f32
    %1 = arith.addf %0, %s : f32
    linalg.yield %1 : f32
  }} -> tensor<{h}x{r}x?x{step}xf32>
  %out = tensor.collapse_shape %o [[0], [1], [2, 3]] : tensor<{h}x{r}x?x{step}xf32> into tensor<{h}x{r}x?xf32>
  util.return %out : tensor<{h}x{r}x?xf32>
}}
}}
"""

_WEIGHTED_VALUES = r"""
module {{
util.func private @{name}(%p: tensor<{h}x{r}x?xf32>, %v: tensor<{h}x?x{d}xf32>) -> tensor<{h}x{r}x{d}xf32> {{
  %zero = arith.constant 0.000000e+00 : f32
  %e = tensor.empty() : tensor<{h}x{r}x{d}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<{h}x{r}x{d}xf32>) -> tensor<{h}x{r}x{d}xf32>
  %o = linalg.generic {{
      indexing_maps = [affine_map<(h, r, i, j) -> (h, r, j)>, affine_map<(h, r, i, j) -> (h, j, i)>,
                       affine_map<(h, r, i, j) -> (h, r, i)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%p, %v : tensor<{h}x{r}x?xf32>, tensor<{h}x?x{d}xf32>) outs(%acc : tensor<{h}x{r}x{d}xf32>) {attrs} {{
  ^bb0(%x: f32, %y: f32, %s: f32):
    %0 = math.fma %x, %y, %zero : f32
    %1 = arith.addf %0, %s : f32
    linalg.yield %1 : f32
  }} -> tensor<{h}x{r}x{d}xf32>
  util.return %o : tensor<{h}x{r}x{d}xf32>
}}
}}
"""

# Prefill's output rows, written in the output projection's order: out[i, h, r, j] = sum over s of
# probs[h, r, i, s] * values[h, s, j], math.fma(a, b, 0) plus the sum as in decode's ops; per workgroup (and per
# vector step) one query of a kv head's rep heads, a vector of its d outputs, the slots one at a time. Queries two
# or five at a time took 2.4x and 3.8x as long.
_WEIGHTED_VALUES_ROWS = r"""
module {{
util.func private @{name}(%p: tensor<{h}x{r}x?x?xf32>, %vall: tensor<{h}x?x{d}x{e}>) -> tensor<?x{h}x{r}x{d}xf32> {{
  %zero = arith.constant 0.000000e+00 : f32
  %c2 = arith.constant 2 : index
  %c3 = arith.constant 3 : index
  %n = tensor.dim %p, %c2 : tensor<{h}x{r}x?x?xf32>
  %cols = tensor.dim %p, %c3 : tensor<{h}x{r}x?x?xf32>
  %vs = tensor.extract_slice %vall[0, 0, 0] [{h}, %cols, {d}] [1, 1, 1] : tensor<{h}x?x{d}x{e}> to tensor<{h}x?x{d}x{e}>
  {values}
  %e = tensor.empty(%n) : tensor<?x{h}x{r}x{d}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<?x{h}x{r}x{d}xf32>) -> tensor<?x{h}x{r}x{d}xf32>
  %o = linalg.generic {{
      indexing_maps = [affine_map<(h, r, i, j, s) -> (h, r, i, s)>, affine_map<(h, r, i, j, s) -> (h, s, j)>,
                       affine_map<(h, r, i, j, s) -> (i, h, r, j)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}}
      ins(%p, %v : tensor<{h}x{r}x?x?xf32>, tensor<{h}x?x{d}xf32>) outs(%acc : tensor<?x{h}x{r}x{d}xf32>) {attrs} {{
  ^bb0(%x: f32, %y: f32, %s: f32):
    %0 = math.fma %x, %y, %zero : f32
    %1 = arith.addf %0, %s : f32
    linalg.yield %1 : f32
  }} -> tensor<?x{h}x{r}x{d}xf32>
  util.return %o : tensor<?x{h}x{r}x{d}xf32>
}}
}}
"""

_AS_FLOAT = r"""{out}_e = tensor.empty({slots}) : tensor<{h}x?x{d}xf32>
  {out} = linalg.generic {{
      indexing_maps = [affine_map<(h, s, j) -> (h, s, j)>, affine_map<(h, s, j) -> (h, s, j)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins({src} : tensor<{h}x?x{d}x{e}>) outs({out}_e : tensor<{h}x?x{d}xf32>) {{
  ^bb0(%x: {e}, %o: f32):
    {body}
  }} -> tensor<{h}x?x{d}xf32>"""


def _as_float(src: str, out: str, slots: str, h: int, d: int, e: str) -> str:
    """MLIR setting `out` to the stored keys or values `src` (tensor<h x slots x d x e>, e: model.KV_STORAGE) as
    float32, in one elementwise generic."""
    lines = attention_rows.widen("%x", e, "%w")
    body = "\n    ".join(lines + [f"linalg.yield {'%w' if lines else '%x'} : f32"])
    return _AS_FLOAT.format(src=src, out=out, slots=slots, h=h, d=d, e=e, body=body)


# Prefill's scores: per kv head, its rep heads' queries as the rows of one matmul against the keys (transposed),
# which IREE data-tiles. Float32 keys are cloned first: read straight from the cache's slice, IREE fused their
# packing into the matmul's dispatch, whose stack (80 kB) then passed its 32 kB limit; the clone is a plain copy
# (~0.03 ms a layer at 1000 slots). 16-bit keys are widened instead (_as_float), and IREE packs them in the
# widening's dispatch: one dispatch where a conversion, the clone and the packing were three.
_QUERY_KEYS_ROWS = r"""
module {{
util.func private @{name}(%q: tensor<{h}x{r}x?x{d}xf32>, %k: tensor<{h}x?x{d}x{e}>) -> tensor<{h}x{r}x?x?xf32> {{
  %zero = arith.constant 0.000000e+00 : f32
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %cr = arith.constant {r} : index
  %n = tensor.dim %q, %c2 : tensor<{h}x{r}x?x{d}xf32>
  %s = tensor.dim %k, %c1 : tensor<{h}x?x{d}x{e}>
  %rn = arith.muli %n, %cr : index
  {keys}
  %q2 = tensor.collapse_shape %q [[0], [1, 2], [3]] : tensor<{h}x{r}x?x{d}xf32> into tensor<{h}x?x{d}xf32>
  %e = tensor.empty(%rn, %s) : tensor<{h}x?x?xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<{h}x?x?xf32>) -> tensor<{h}x?x?xf32>
  %o = linalg.generic {{
      indexing_maps = [affine_map<(b, m, n, k) -> (b, m, k)>, affine_map<(b, m, n, k) -> (b, n, k)>,
                       affine_map<(b, m, n, k) -> (b, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%q2, %kc : tensor<{h}x?x{d}xf32>, tensor<{h}x?x{d}xf32>) outs(%acc : tensor<{h}x?x?xf32>) {{
  ^bb0(%x: f32, %y: f32, %a: f32):
    %0 = arith.mulf %x, %y : f32
    %1 = arith.addf %a, %0 : f32
    linalg.yield %1 : f32
  }} -> tensor<{h}x?x?xf32>
  %o4 = tensor.expand_shape %o [[0], [1, 2], [3]] output_shape [{h}, {r}, %n, %s] : tensor<{h}x?x?xf32> into tensor<{h}x{r}x?x?xf32>
  util.return %o4 : tensor<{h}x{r}x?x?xf32>
}}
}}
"""

# Softmax over the slots: the scores as rows (kv heads x rep x queries), one hand-written dispatch.
_SOFTMAX_MASKED = r"""
module {{
{executable}
util.func private @{name}(%s: tensor<{h}x{r}x?x?xf32>, %m: tensor<?x?xf32>) -> tensor<{h}x{r}x?x?xf32> {{
  %c2 = arith.constant 2 : index
  %c3 = arith.constant 3 : index
  %chr = arith.constant {hr} : index
  %n = tensor.dim %s, %c2 : tensor<{h}x{r}x?x?xf32>
  %cols = tensor.dim %s, %c3 : tensor<{h}x{r}x?x?xf32>
  %rows = arith.muli %n, %chr : index
  %s2 = tensor.collapse_shape %s [[0, 1, 2], [3]] : tensor<{h}x{r}x?x?xf32> into tensor<?x?xf32>
  {call}
  %r4 = tensor.expand_shape %r [[0, 1, 2], [3]] output_shape [{h}, {r}, %n, %cols] : tensor<?x?xf32> into tensor<{h}x{r}x?x?xf32>
  util.return %r4 : tensor<{h}x{r}x?x?xf32>
}}
}}
"""

_SOFTMAX = r"""
module {{
{executable}
util.func private @{name}(%s: tensor<{h}x{r}x?xf32>) -> tensor<{h}x{r}x?xf32> {{
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %rows = arith.constant {hr} : index
  %cols = tensor.dim %s, %c2 : tensor<{h}x{r}x?xf32>
  %s1 = tensor.collapse_shape %s [[0, 1], [2]] : tensor<{h}x{r}x?xf32> into tensor<{hr}x?xf32>
  %s2 = tensor.cast %s1 : tensor<{hr}x?xf32> to tensor<?x?xf32>
  {call}
  %r1 = tensor.cast %r : tensor<?x?xf32> to tensor<{hr}x?xf32>
  %r3 = tensor.expand_shape %r1 [[0, 1], [2]] output_shape [{h}, {r}, %cols] : tensor<{hr}x?xf32> into tensor<{h}x{r}x?xf32>
  util.return %r3 : tensor<{h}x{r}x?xf32>
}}
}}
"""

# Prefill's attention in one hand-written dispatch (engine/exporter/kernels/attention_rows.py).
_ATTEND_BY_HAND = r"""
module {{
{executable}
util.func private @{name}(%q: tensor<{h}x{r}x{d}x?xf32>, %k: tensor<{h}x?x{d}x{e}>, %v: tensor<{h}x?x{d}x{e}>, %m: tensor<?x?xf32>) -> tensor<?x{h}x{r}x{d}xf32> {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c3 = arith.constant 3 : index
  %n = tensor.dim %q, %c3 : tensor<{h}x{r}x{d}x?xf32>
  %cols = tensor.dim %m, %c0 : tensor<?x?xf32>
  %slots = tensor.dim %k, %c1 : tensor<{h}x?x{d}x{e}>
  {call}
  util.return %o : tensor<?x{h}x{r}x{d}xf32>
}}
}}
"""

# The same by hand on a cpu (engine/exporter/kernels/attention_rows.py): values read once per block of queries.
_VALUES_BY_HAND = r"""
module {{
{executable}
util.func private @{name}(%p: tensor<{h}x{r}x?x?xf32>, %v: tensor<{h}x?x{d}x{e}>) -> tensor<?x{h}x{r}x{d}xf32> {{
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %c3 = arith.constant 3 : index
  %n = tensor.dim %p, %c2 : tensor<{h}x{r}x?x?xf32>
  %cols = tensor.dim %p, %c3 : tensor<{h}x{r}x?x?xf32>
  %slots = tensor.dim %v, %c1 : tensor<{h}x?x{d}x{e}>
  {call}
  util.return %o : tensor<?x{h}x{r}x{d}xf32>
}}
}}
"""

_VALUES_ROWS_CPU = ("attrs = {{compilation_info = #iree_codegen.compilation_info<lowering_config = "
                    "#iree_cpu.lowering_config<distribution = [1, {r}, 1, {d}, 0], vector_common_parallel = "
                    "[1, {r}, 1, {d}, 0], vector_reduction = [0, 0, 0, 0, 1]>, translation_info = "
                    "#iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}}")

# Per workgroup one kv head's queries. Values: a vector of each query's d outputs, the slots one at a time. Scores:
# 64 slots (4 blocks), each query's dot product with a key over d as one vector, summed across it (a vector along
# the slots would gather keys d apart). Each measured against 1 query at a time and 16-wide vectors: those were
# slower.
_SCORES_CPU = ("attrs = {{compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
               "distribution = [1, {r}, 64, 0], vector_common_parallel = [1, {r}, 1, 0], "
               "vector_reduction = [0, 0, 0, {d}]>, translation_info = #iree_codegen.translation_info<"
               "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}}")
_BLOCKS_CPU = ("attrs = {{compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
               "distribution = [1, {r}, 4, {step}, 0], vector_common_parallel = [1, {r}, 1, 1, 0], "
               "vector_reduction = [0, 0, 0, 0, {d}]>, translation_info = #iree_codegen.translation_info<"
               "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}}")
_VALUES_CPU = ("attrs = {{compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
               "distribution = [1, {r}, {d}, 0], vector_common_parallel = [1, {r}, {d}, 0], "
               "vector_reduction = [0, 0, 0, 1]>, translation_info = #iree_codegen.translation_info<"
               "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}}")


_FIRST_BLOCKS = r"""
module {{
util.func private @{name}(%t: tensor<{h}x{s}x{d}x{e}>, %like: tensor<?x{le}>) -> tensor<{h}x?x{step}x{d}x{e}> {{
  %c0 = arith.constant 0 : index
  %step = arith.constant {step} : index
  %len = tensor.dim %like, %c0 : tensor<?x{le}>
  %blocks = arith.divui %len, %step : index
  %tb = tensor.expand_shape %t [[0], [1, 2], [3]] output_shape [{h}, {sb}, {step}, {d}] : tensor<{h}x{s}x{d}x{e}> into tensor<{h}x{sb}x{step}x{d}x{e}>
  %r = tensor.extract_slice %tb[0, 0, 0, 0] [{h}, %blocks, {step}, {d}] [1, 1, 1, 1] : tensor<{h}x{sb}x{step}x{d}x{e}> to tensor<{h}x?x{step}x{d}x{e}>
  util.return %r : tensor<{h}x?x{step}x{d}x{e}>
}}
}}
"""

_FIRST_SLOTS = r"""
module {{
util.func private @{name}(%t: tensor<{h}x{s}x{d}x{e}>, %like: tensor<?x{le}>) -> tensor<{h}x?x{d}x{e}> {{
  %c0 = arith.constant 0 : index
  %len = tensor.dim %like, %c0 : tensor<?x{le}>
  %n = util.assume.int %len<umin = {step}, umax = {s}, udiv = {step}> : index
  %r = tensor.extract_slice %t[0, 0, 0] [{h}, %n, {d}] [1, 1, 1] : tensor<{h}x{s}x{d}x{e}> to tensor<{h}x?x{d}x{e}>
  util.return %r : tensor<{h}x?x{d}x{e}>
}}
}}
"""

def _cpu_lowering(tiles: int, reduction_dims: int, tile: int = TILE) -> str:
    """The decode product's compilation_info for llvm-cpu: workgroups of a few tiles (at least ~16 workgroups for
    the threads to share once a matrix has the tiles for it), one tile of rows per vector, the reduction one
    step at a time, accumulated per lane."""
    per_group = max(1, min(16, tiles // 16))
    zeros, ones = ", ".join(["0"] * reduction_dims), ", ".join(["1"] * reduction_dims)
    return ("attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [{per_group}, {tile}, {zeros}], vector_common_parallel = [1, {tile}, {zeros}], "
            f"vector_reduction = [0, 0, {ones}]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}")


# The MLIR names of a q4 product's numbers (_Q4_ARGS), as the hand-written calls bind them.
Q4_ARG_NAMES = ("%d", "%m", "%units")

_registered: dict | None = None


def _ops() -> dict:
    """The registered custom ops (registered on first use: they need turbine, and once per process)."""
    global _registered
    if _registered is None:
        _registered = _register()
    return _registered


def _register() -> dict:
    from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library
    from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader, call_function
    from iree.turbine.support.ir_imports import RankedTensorType

    from ...config import super_groups
    from ..q4 import Q4_NUMBERS, dequantise_q4, untile_q4

    def dense_q4(qs: torch.Tensor, *numbers: torch.Tensor) -> torch.Tensor:
        return dequantise_q4(*untile_q4({"weight": qs, **dict(zip(Q4_NUMBERS, numbers))}).values())

    _mlir_isinstance_shim()

    class Template(TemplateLoader):
        def load_template(self, kb: KernelBuilder, name: str, asm: str):
            return self._parse_module_asm(kb, asm)

    template = Template()
    library = def_library("eddy_quant")

    def select(ksel: KernelSelection, arity: int, tile: int) -> None:
        a, *weights = (ksel.arg_tensor(i) for i in range(arity))
        for t in weights:
            t.specialize_all_dims()
        # One row (decode's call, whose shapes are static) selects the matrix-vector form.
        if isinstance(a.t.shape[0], int) and a.t.shape[0] == 1:
            a.specialize_all_dims()
        else:
            a.specialize_dims(1)
        ksel.return_new_tensor([a.t.shape[0], weights[0].t.shape[0] * tile], dtype=torch.float32)

    def emit(kb: KernelBuilder, name: str, asm: str) -> None:
        fn = template.inline_template_function(kb, name, name, asm=asm)
        # An attribute (an int argument of the op's signature) is no value of the IR: it has no binding.
        kb.yield_results(*call_function(fn, *(b for b in kb.arg_bindings if b is not None)))

    def shape(kb: KernelBuilder, i: int) -> list:
        return RankedTensorType(kb.arg_value(i).type).shape

    def emit_q4_rows(kb: KernelBuilder, sizes: dict, nb: int, k: int, parts: tuple[int, ...]) -> None:
        """The hand-written product of many rows (prefill_products.py), one output or one per part (tiles each)."""
        tag = f"{nb * Q4_TILE}x{k}" + "".join(f"_{p * Q4_TILE}" for p in parts) + f"_x{_x_steps}"
        name = f"eddy_mm_q4_{tag}_{_dot_form}"
        qx, exe = f"eddy_qx_{tag}_{_dot_form}", f"eddy_q4_rows_{tag}_{_dot_form}"
        outs = parts or (nb,)
        emit(kb, name, _MM_X86.format(
            name=name, args=_Q4_ARGS.format(**sizes), steps=_x_steps,
            executables=prefill_products.quantise_rows_executable(qx, k, _x_steps)
            + prefill_products.q4_rows_executable(_dot_form, exe, nb, k, parts, _x_steps),
            quantise=prefill_products.quantise_rows_call(qx, k, "%a", "%rows", "%rows2", "%xq", "%xs"),
            call=prefill_products.q4_rows_call(exe, nb, k, "%xq", "%xs", "%rows", "%rows2", "%qs", Q4_ARG_NAMES,
                                               f"%r:{len(outs)}" if parts else "%r", parts),
            result_types=", ".join(f"tensor<?x{p * Q4_TILE}xf32>" for p in outs),
            results=", ".join(f"%r#{i}" for i in range(len(outs))) if parts else "%r", **sizes))

    def q4_sizes(kb: KernelBuilder) -> tuple[dict, int, int]:
        (_, k), (nb, groups, gb) = shape(kb, 0), shape(kb, 1)
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
            if _dot_form and first % Q4_TILE == 0 and second % Q4_TILE == 0:
                emit_q4_rows(kb, sizes, nb, k, tuple(c // Q4_TILE for c in cols))
                return
            inner, tag = f"eddy_mm_q4_{nb * Q4_TILE}x{k}", "_".join(map(str, cols))
            module = _MM_Q4.format(name=inner, **sizes).strip()
            types = [f"tensor<?x{c}xf32>" for c in cols]
            slices = "\n  ".join(
                f"%p{i} = tensor.extract_slice %r[0, {sum(cols[:i])}] [%rows, {c}] [1, 1] : "
                f"tensor<?x{nb * Q4_TILE}xf32> to {types[i]}" for i, c in enumerate(cols))
            name = f"{inner}_parts_{tag}"
            emit(kb, name, _PARTS_OF_PRODUCT.format(
                name=name, inner=inner, inner_module=module[len("module {"):-1], args=_Q4_ARGS.format(**sizes),
                arg_types=", ".join(t.split(": ")[1] for t in _Q4_ARGS.format(**sizes).split(", ")),
                slices=slices, results="%p0, %p1, %p2", result_types=", ".join(types), **sizes))

    @CustomOp.register(library=library)
    class mmt_q4(CustomOp):
        signature = "mmt_q4(Tensor a, Tensor qs, Tensor d, Tensor m, Tensor u) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select(ksel, 5, Q4_TILE)

        def eager_execute(self, a, qs, d, m, u):
            return a @ dense_q4(qs, d, m, u).T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            sizes, nb, k = q4_sizes(kb)
            rows, tag = shape(kb, 0)[0], f"{nb * Q4_TILE}x{k}"
            if rows != 1 and _dot_form:
                emit_q4_rows(kb, sizes, nb, k, ())
            elif rows != 1:
                name = f"eddy_mm_q4_{tag}"
                emit(kb, name, _MM_Q4.format(name=name, **sizes))
            elif _dot_form:
                name = f"eddy_mv_q4_{tag}_{_dot_form}"
                exe = f"eddy_q4_{tag}_{_dot_form}"
                emit(kb, name, _MV_X86.format(
                    name=name, args=_Q4_ARGS.format(**sizes),
                    executable=dot_products.q4_executable(_dot_form, exe, nb, k),
                    call=dot_products.q4_call(exe, nb, k, "%a1", "%qs", Q4_ARG_NAMES, "%r"), **sizes))
            else:
                name = f"eddy_mv_q4_{tag}{'_cpu' if _cpu_tuned else ''}"
                if _cpu_tuned:
                    emit(kb, name, _MV_Q4.format(name=name, attrs=_cpu_lowering(nb, 5, Q4_TILE), **sizes))
                else:
                    emit(kb, name, _MV_Q4_BYTES.format(name=name, **sizes))

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
            if rows == 1 and _dot_form and k % 32 == 0:
                name = f"eddy_mv_i8_{tag}_{_dot_form}"
                exe = f"eddy_i8_{tag}_{_dot_form}"
                emit(kb, name, _MV_X86.format(
                    name=name, args="%w: tensor<{nb}x{quads}x{qb}xi8>".format(**sizes),
                    executable=dot_products.q8_executable(_dot_form, exe, nb, k),
                    call=dot_products.q8_call(exe, nb, k, "%a1", "%w", "%r"), **sizes))
            elif rows == 1 and _cpu_tuned:
                name = f"eddy_mv_i8_{tag}_cpu"
                emit(kb, name, _MV_I8.format(name=name, attrs=_cpu_lowering(nb, 2), **sizes))
            elif rows == 1:
                name = f"eddy_mv_i8_{tag}"
                emit(kb, name, _MV_I8_BYTES.format(name=name, **sizes))
            else:
                name = f"eddy_mm_i8_{tag}"
                emit(kb, name, _MM_I8.format(name=name, **sizes))

    def select_attend(ksel: KernelSelection, keys: bool) -> None:
        # The slots (keys' and values' dimension 1, probabilities' 2) stay dynamic: model.py, Step.cache_pos.
        a, b = ksel.arg_tensor(0), ksel.arg_tensor(1)
        a.specialize_all_dims() if keys else a.specialize_dims(0, 1)
        blocked = len(b.t.shape) == 4  # keys as blocks (first_blocks)
        b.specialize_dims(0, 2, 3) if blocked else b.specialize_dims(0, 2)
        slots = b.t.shape[2]
        if keys:
            slots = ksel.arg_tensor(2).t.shape[0]  # the mask's one dimension is the slots
        ksel.return_new_tensor([a.t.shape[0], a.t.shape[1], slots], dtype=torch.float32)

    def generate_attend(kb: KernelBuilder, keys: bool) -> None:
        (h, r, _), b = shape(kb, 0), shape(kb, 1)
        blocked, d = len(b) == 4, b[-1]
        name = f"eddy_{'qk' if keys else 'pv'}{'_blocks' if blocked else ''}_{h}x{r}x{d}{'_cpu' if _cpu_tuned else ''}"
        lowering, template = ((_BLOCKS_CPU, _QUERY_BLOCKS) if blocked else (_SCORES_CPU, _QUERY_KEYS)) if keys else (
            _VALUES_CPU, _WEIGHTED_VALUES)
        attrs = lowering.format(r=r, d=d, step=ATTEND_STEP) if _cpu_tuned else ""
        emit(kb, name, template.format(name=name, h=h, r=r, d=d, step=ATTEND_STEP, attrs=attrs,
                                       **_MASK_FIRST[_cpu_tuned]))

    @CustomOp.register(library=library)
    class attend_qk(CustomOp):
        signature = "attend_qk(Tensor q, Tensor k, Tensor m) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_attend(ksel, True)

        def eager_execute(self, q, k, m):
            return torch.matmul(q, (k.flatten(1, 2) if k.dim() == 4 else k).transpose(1, 2)) + m

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_attend(kb, True)

    @CustomOp.register(library=library)
    class attend_pv(CustomOp):
        signature = "attend_pv(Tensor p, Tensor v) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_attend(ksel, False)

        def eager_execute(self, p, v):
            return torch.matmul(p, v)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_attend(kb, False)

    @CustomOp.register(library=library)
    class attend_pv_rows(CustomOp):
        signature = "attend_pv_rows(Tensor p, Tensor v) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            p, v = ksel.arg_tensor(0), ksel.arg_tensor(1)
            p.specialize_dims(0, 1)  # the queries and the slots stay dynamic
            v.specialize_dims(0, 2)
            h, r, n, _ = p.t.shape
            ksel.return_new_tensor([n, h, r, v.t.shape[2]], dtype=torch.float32)

        def eager_execute(self, p, v):
            return torch.matmul(p, _eager_float(v[:, : p.shape[-1]]).unsqueeze(1)).permute(2, 0, 1, 3)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (h, r, _, _), d = shape(kb, 0), shape(kb, 1)[-1]
            e = str(RankedTensorType(kb.arg_value(1).type).element_type)
            if _cpu_tuned and d % 16 == 0 and attention_rows.values_block(r, d):
                name = f"eddy_pv_rows_{h}x{r}x{d}x{e}_hand"
                exe = f"{name}_e"
                emit(kb, name, _VALUES_BY_HAND.format(
                    name=name, h=h, r=r, d=d, e=e,
                    executable=attention_rows.weighted_values_executable(exe, h, r, d, e),
                    call=attention_rows.weighted_values_call(exe, h, r, d, e, "%p", "%v", "%n", "%cols", "%slots",
                                                             "%o")))
                return
            name = f"eddy_pv_rows_{h}x{r}x{d}x{e}{'_cpu' if _cpu_tuned else ''}"
            attrs = _VALUES_ROWS_CPU.format(r=r, d=d) if _cpu_tuned else ""
            emit(kb, name, _WEIGHTED_VALUES_ROWS.format(name=name, h=h, r=r, d=d, e=e, attrs=attrs,
                                                        values=_as_float("%vs", "%v", "%cols", h, d, e)))

    @CustomOp.register(library=library)
    class attend_qk_rows(CustomOp):
        signature = "attend_qk_rows(Tensor q, Tensor k) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            q, k = ksel.arg_tensor(0), ksel.arg_tensor(1)
            q.specialize_dims(0, 1, 3)  # the queries and the slots stay dynamic
            k.specialize_dims(0, 2)
            h, r, n, _ = q.t.shape
            ksel.return_new_tensor([h, r, n, k.t.shape[1]], dtype=torch.float32)

        def eager_execute(self, q, k):
            return torch.matmul(q, _eager_float(k).unsqueeze(1).transpose(2, 3))

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            h, r, _, d = shape(kb, 0)
            e = str(RankedTensorType(kb.arg_value(1).type).element_type)
            name = f"eddy_qk_rows_{h}x{r}x{d}x{e}"
            keys = (f"%kc = flow.tensor.clone %k : tensor<{h}x?x{d}xf32>{{%s}}" if e == "f32" else
                    _as_float("%k", "%kc", "%s", h, d, e))
            emit(kb, name, _QUERY_KEYS_ROWS.format(name=name, h=h, r=r, d=d, e=e, keys=keys))

    @CustomOp.register(library=library)
    class attend_rows(CustomOp):
        signature = "attend_rows(Tensor q, Tensor k, Tensor v, Tensor m) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            q, k, v, m = (ksel.arg_tensor(i) for i in range(4))
            q.specialize_dims(0, 1, 2)  # the queries and the slots stay dynamic
            k.specialize_dims(0, 2)
            v.specialize_dims(0, 2)
            h, r, d, n = q.t.shape
            ksel.return_new_tensor([n, h, r, d], dtype=torch.float32)

        def eager_execute(self, q, k, v, m):
            cols = m.shape[0]
            scores = torch.matmul(q.transpose(2, 3), _eager_float(k[:, :cols]).unsqueeze(1).transpose(2, 3)) + m.T
            return torch.matmul(torch.softmax(scores, -1), _eager_float(v[:, :cols]).unsqueeze(1)).permute(2, 0, 1, 3)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            h, r, d, _ = shape(kb, 0)
            e = str(RankedTensorType(kb.arg_value(1).type).element_type)
            name = f"eddy_attend_rows_{h}x{r}x{d}x{e}"
            exe = f"{name}_e"
            emit(kb, name, _ATTEND_BY_HAND.format(
                name=name, h=h, r=r, d=d, e=e, executable=attention_rows.attend_rows_executable(exe, h, r, d, e),
                call=attention_rows.attend_rows_call(exe, h, r, d, e, "%q", "%k", "%v", "%m", "%n", "%cols",
                                                     "%slots", "%o")))

    def select_softmax(ksel: KernelSelection, masked: bool) -> None:
        s = ksel.arg_tensor(0)
        s.specialize_dims(0, 1)  # the queries and the slots stay dynamic
        if masked:
            ksel.arg_tensor(1)
        ksel.return_new_tensor(list(s.t.shape), dtype=torch.float32)

    def generate_softmax(kb: KernelBuilder, masked: bool) -> None:
        h, r = shape(kb, 0)[:2]
        name = f"eddy_softmax_{'masked_' if masked else ''}{h}x{r}"
        exe = f"{name}_rows"
        call = attention_rows.softmax_rows_call(exe, masked, "%s2", "%m", "%rows", "%n" if masked else "%c1",
                                              "%cols", "%r")
        emit(kb, name, (_SOFTMAX_MASKED if masked else _SOFTMAX).format(
            name=name, h=h, r=r, hr=h * r, executable=attention_rows.softmax_rows_executable(exe, masked), call=call))

    @CustomOp.register(library=library)
    class attend_softmax(CustomOp):
        signature = "attend_softmax(Tensor s) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_softmax(ksel, False)

        def eager_execute(self, s):
            return torch.softmax(s, dim=-1)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_softmax(kb, False)

    @CustomOp.register(library=library)
    class attend_softmax_masked(CustomOp):
        signature = "attend_softmax_masked(Tensor s, Tensor m) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_softmax(ksel, True)

        def eager_execute(self, s, m):
            return torch.softmax(s + m, dim=-1)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_softmax(kb, True)

    def select_slice(ksel: KernelSelection, blocked: bool) -> None:
        kv, like = ksel.arg_tensor(0), ksel.arg_tensor(1)
        kv.specialize_all_dims()
        (h, _, d), n = kv.t.shape, like.t.shape[0]
        ksel.return_new_tensor([h, n // ATTEND_STEP, ATTEND_STEP, d] if blocked else [h, n, d], dtype=kv.t.dtype)

    def generate_slice(kb: KernelBuilder, blocked: bool) -> None:
        (h, s, d), types = shape(kb, 0), [str(RankedTensorType(kb.arg_value(i).type).element_type) for i in (0, 1)]
        name = f"eddy_first_{'blocks' if blocked else 'slots'}_{h}x{s}x{d}x{types[0]}_{types[1]}"
        emit(kb, name, (_FIRST_BLOCKS if blocked else _FIRST_SLOTS).format(
            name=name, h=h, s=s, sb=s // ATTEND_STEP, d=d, e=types[0], le=types[1], step=ATTEND_STEP))

    @CustomOp.register(library=library)
    class first_slots(CustomOp):
        signature = "first_slots(Tensor kv, Tensor like) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_slice(ksel, False)

        def eager_execute(self, kv, like):
            return kv[:, : like.shape[0]].clone()

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_slice(kb, False)

    @CustomOp.register(library=library)
    class first_blocks(CustomOp):
        signature = "first_blocks(Tensor kv, Tensor like) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_slice(ksel, True)

        def eager_execute(self, kv, like):
            return kv[:, : like.shape[0]].unflatten(1, (-1, ATTEND_STEP)).clone()

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_slice(kb, True)

    return {"q4": mmt_q4, "q4_parts": mmt_q4_parts, "i8": mmt_i8, "qk": attend_qk, "pv": attend_pv,
            "pv_rows": attend_pv_rows, "qk_rows": attend_qk_rows, "attend_rows": attend_rows, "softmax": attend_softmax,
            "softmax_masked": attend_softmax_masked, "slots": first_slots, "blocks": first_blocks}


def _mlir_isinstance_shim() -> None:
    """iree-turbine 3.9's custom-op expansion calls `IrType.isinstance(x)`, which the MLIR Python bindings of
    iree-base-compiler 3.13 no longer have (Python's isinstance works on them now): give the classes that static
    method back. Only the export (a build's child process) loads this."""
    import iree.compiler.ir as ir

    for name in dir(ir):
        cls = getattr(ir, name)
        if isinstance(cls, type) and not name.startswith("_") and not hasattr(cls, "isinstance"):
            try:
                cls.isinstance = staticmethod(lambda value, cls=cls: isinstance(value, cls))
            except (AttributeError, TypeError):
                pass  # a class the bindings seal; turbine asks none of those
