"""Eddy's custom ops, written as MLIR templates (needs torch and turbine at export); how one is added and tested:
README.md beside this file.

One module per op family, each with its MLIR templates, its forms per device and the public functions the model
calls: q4_products (`q4_linear`, `q4_linear_parts`, `q4_linear_swiglu`), i8_products (`i8_linear`,
`i8_linear_scaled`), half_products (`f16_linear`), attention (`query_keys`, `weighted_values`, their prefill `_rows`
forms, `softmax_over_slots`, `attend_rows`, `attend_one_dispatch`, `attend_split_slots`), slices (`first_slots`,
`first_blocks`, `layer_of`); tiles holds q8's tiled layout. The parts written by hand, which those templates call: dot_products
(x86 decode's products), prefill_products (x86 prefill's q4 products), attention_rows (x86 prefill's attention),
gpu_attention (vulkan's attention), split_attention (cuda decode's attention in splits of the slots). norms:
`rms_norm_one_dispatch` (a norm as one kernel on a launch-bound device). Which form an op takes is the export's
KernelPlan (plan.py); registry registers the ops with turbine.

Tiles. A matrix that is multiplied is stored in tiles of rows (q8: TILE rows, 4 positions at a time,
[out/T, in/4, T x 4]; q4's own blocked layout of 16), so that decode's product (one row: a matrix-vector product)
keeps one output row per vector lane and needs no horizontal sum. With whole rows IREE's default reduced each
group (q4) or each vector of positions (q8) to a scalar inside the loop.
"""
from .attention import (attend_one_dispatch, attend_rows, attend_split_slots, query_keys, query_keys_rows,
                        softmax_over_slots, weighted_values, weighted_values_rows)
from .half_products import f16_linear
from .i8_products import i8_linear, i8_linear_scaled
from .norms import rms_norm_one_dispatch
from .plan import KernelPlan, lowering, lowering_for
from .q4_products import q4_linear, q4_linear_parts, q4_linear_swiglu
from .slices import first_blocks, first_slots, layer_of
from .tiles import tile_q8, tileable, tiled_rows, untile_q8

__all__ = ["KernelPlan", "lowering", "lowering_for", "q4_linear", "q4_linear_parts", "q4_linear_swiglu", "i8_linear",
           "i8_linear_scaled", "f16_linear",
           "query_keys", "weighted_values", "weighted_values_rows", "query_keys_rows", "attend_rows",
           "attend_one_dispatch", "attend_split_slots", "softmax_over_slots", "first_slots", "first_blocks",
           "layer_of", "tileable", "tile_q8", "untile_q8", "tiled_rows", "rms_norm_one_dispatch"]
