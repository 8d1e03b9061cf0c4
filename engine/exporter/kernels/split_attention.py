"""Decode's attention split over the slots on cuda (flash decoding), through IREE's own attention op.

IREE's fused attention op (`iree_linalg_ext.attention`, what `scaled_dot_product_attention` becomes) spreads a call
over its query heads, rows and output columns, never over the slots, which it walks in turn: for `sm_89` a decode
step of the default model was 36 workgroups (9 heads, 4 quarters of a head's 64 values) each reading every attended
slot. Here the slots are cut into blocks of ATTEND_STEP, each a batch of the op's partial form,
`iree_linalg_ext.online_attention`, which returns a block's unscaled output with its running maximum and sum; one
more dispatch joins a head's blocks, each rescaled to the largest maximum. At 256 slots that is 576 workgroups of
one block each, and a join of 18 (IREE's configuration for `sm_89`). Keys and values come as the cache's layer seen
in blocks, its first C / ATTEND_STEP taken (kernels.first_blocks), which IREE reads in place (a slice reshaped into
blocks was two copies a layer), so a cuda cache holds a whole number of blocks (model.StreamingLlama).

The running maximum and sum are IREE's, in its decomposition's units: it takes exp2 of the scores times
log2(e) (with the scale), so the maximum is in log2 units, and the join rescales by exp2 of the difference of two
maxima. That is IREE's code generation's convention, the same for every backend, and tested on the CPU: the op alone
at real widths against softmax attention (tests/test_kernels.py), and a whole cuda export compiled for this CPU
against the CPU build's logits (tests/test_cuda.py).
"""
from __future__ import annotations

from ...config import ATTEND_STEP

_TEMPLATE = r"""
module {{
util.func private @{name}(%q: tensor<{h}x{r}x{d}xf32>, %k4: tensor<{h}x{s}x{per}x{d}xf32>, %v4: tensor<{h}x{s}x{per}x{d}xf32>, %m: tensor<{c}xf32>) -> tensor<{h}x{r}x{d}xf32> {{
  %scale = arith.constant {scale} : f32
  %zero = arith.constant 0.000000e+00 : f32
  %low = arith.constant -3.40282347E+38 : f32
  %m2 = tensor.expand_shape %m [[0, 1]] output_shape [{s}, {per}] : tensor<{c}xf32> into tensor<{s}x{per}xf32>
  %oe = tensor.empty() : tensor<{h}x{s}x{r}x{d}xf32>
  %re = tensor.empty() : tensor<{h}x{s}x{r}xf32>
  %o0 = linalg.fill ins(%zero : f32) outs(%oe : tensor<{h}x{s}x{r}x{d}xf32>) -> tensor<{h}x{s}x{r}x{d}xf32>
  %x0 = linalg.fill ins(%low : f32) outs(%re : tensor<{h}x{s}x{r}xf32>) -> tensor<{h}x{s}x{r}xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%re : tensor<{h}x{s}x{r}xf32>) -> tensor<{h}x{s}x{r}xf32>
  %p:3 = iree_linalg_ext.online_attention <indexing_maps = [
      affine_map<(h, s, m, k1, k2, n) -> (h, m, k1)>, affine_map<(h, s, m, k1, k2, n) -> (h, s, k2, k1)>,
      affine_map<(h, s, m, k1, k2, n) -> (h, s, k2, n)>, affine_map<(h, s, m, k1, k2, n) -> ()>,
      affine_map<(h, s, m, k1, k2, n) -> (s, k2)>, affine_map<(h, s, m, k1, k2, n) -> (h, s, m, n)>,
      affine_map<(h, s, m, k1, k2, n) -> (h, s, m)>, affine_map<(h, s, m, k1, k2, n) -> (h, s, m)>]>
      ins(%q, %k4, %v4, %scale, %m2 : tensor<{h}x{r}x{d}xf32>, tensor<{h}x{s}x{per}x{d}xf32>, tensor<{h}x{s}x{per}x{d}xf32>, f32, tensor<{s}x{per}xf32>)
      outs(%o0, %x0, %l0 : tensor<{h}x{s}x{r}x{d}xf32>, tensor<{h}x{s}x{r}xf32>, tensor<{h}x{s}x{r}xf32>) {{
  ^bb0(%score: f32):
    iree_linalg_ext.yield %score : f32
  }} -> tensor<{h}x{s}x{r}x{d}xf32>, tensor<{h}x{s}x{r}xf32>, tensor<{h}x{s}x{r}xf32>
  %je = tensor.empty() : tensor<{h}x{r}x{d}xf32>
  %j0 = linalg.fill ins(%zero : f32) outs(%je : tensor<{h}x{r}x{d}xf32>) -> tensor<{h}x{r}x{d}xf32>
  %t0 = linalg.fill ins(%low : f32) outs(%je : tensor<{h}x{r}x{d}xf32>) -> tensor<{h}x{r}x{d}xf32>
  %j:3 = linalg.generic {{
      indexing_maps = [affine_map<(h, m, n, s) -> (h, s, m, n)>, affine_map<(h, m, n, s) -> (h, s, m)>,
                       affine_map<(h, m, n, s) -> (h, s, m)>, affine_map<(h, m, n, s) -> (h, m, n)>,
                       affine_map<(h, m, n, s) -> (h, m, n)>, affine_map<(h, m, n, s) -> (h, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%p#0, %p#1, %p#2 : tensor<{h}x{s}x{r}x{d}xf32>, tensor<{h}x{s}x{r}xf32>, tensor<{h}x{s}x{r}xf32>)
      outs(%j0, %j0, %t0 : tensor<{h}x{r}x{d}xf32>, tensor<{h}x{r}x{d}xf32>, tensor<{h}x{r}x{d}xf32>) {{
  ^bb0(%a: f32, %x: f32, %l: f32, %o: f32, %sum: f32, %top: f32):
    %top1 = arith.maximumf %top, %x : f32
    %d0 = arith.subf %top, %top1 : f32
    %w0 = math.exp2 %d0 : f32
    %d1 = arith.subf %x, %top1 : f32
    %w1 = math.exp2 %d1 : f32
    %ow = arith.mulf %o, %w0 : f32
    %o1 = math.fma %a, %w1, %ow : f32
    %sw = arith.mulf %sum, %w0 : f32
    %s1 = math.fma %l, %w1, %sw : f32
    linalg.yield %o1, %s1, %top1 : f32, f32, f32
  }} -> (tensor<{h}x{r}x{d}xf32>, tensor<{h}x{r}x{d}xf32>, tensor<{h}x{r}x{d}xf32>)
  %oute = tensor.empty() : tensor<{h}x{r}x{d}xf32>
  %out = linalg.generic {{
      indexing_maps = [affine_map<(h, m, n) -> (h, m, n)>, affine_map<(h, m, n) -> (h, m, n)>,
                       affine_map<(h, m, n) -> (h, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%j#0, %j#1 : tensor<{h}x{r}x{d}xf32>, tensor<{h}x{r}x{d}xf32>) outs(%oute : tensor<{h}x{r}x{d}xf32>) {{
  ^bb0(%a: f32, %sum: f32, %o: f32):
    %y = arith.divf %a, %sum : f32
    linalg.yield %y : f32
  }} -> tensor<{h}x{r}x{d}xf32>
  util.return %out : tensor<{h}x{r}x{d}xf32>
}}
}}
"""


def split_attention(name: str, h: int, r: int, d: int, splits: int, scale: float) -> str:
    """The function @name: out [h, r, d] from q [h, r, d] (unscaled), the attended keys and values as `splits` blocks
    [h, splits, ATTEND_STEP, d] and the additive mask [splits * ATTEND_STEP], all float32."""
    return _TEMPLATE.format(name=name, h=h, r=r, d=d, s=splits, per=ATTEND_STEP, c=splits * ATTEND_STEP,
                            scale=repr(float(scale)))
