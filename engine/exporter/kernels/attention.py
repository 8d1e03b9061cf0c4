"""Attention's custom ops (needs torch and turbine at export), which read the KV cache in place. Decode's:
`query_keys` (the query heads against the cached keys, plus the mask) and `weighted_values` (the probabilities
times the cached values). Prefill's on a cpu: `query_keys_rows` and `weighted_values_rows` (the latter in the
output projection's order), `softmax_over_slots` (one dispatch a layer) and `attend_rows` (the whole attention in
one dispatch: attention_rows.py). On vulkan, `attend_one_dispatch` (decode's and prefill's alike: gpu_attention.py).

As batch matmuls IREE data-tiles them and so re-packs the whole cache's keys and values on every step; as generics
whose body is not a plain multiply-add (math.fma(a, b, 0) + acc) they are not taken for contractions, and carry a
cpu lowering instead: 0.16 + 0.15 ms a layer for a 1B's 8 x 4 heads over 1024 slots against 0.38 + 0.28 ms as
batch matmuls (bench: iree-benchmark-module on the ops alone, a Xeon).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import ATTEND_STEP
from . import attention_rows, gpu_attention, split_attention
from .plan import active
from .registry import Kit, registered

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


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


def attend_one_dispatch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                        softcap: float | None) -> torch.Tensor:
    """softmax(cap(q . keys) + mask) . values -> [n, kvh, rep, d] (a call's attention, in the order the output
    projection takes it, on a GPU without IREE's attention op: vulkan): the custom op, one dispatch a layer written
    by hand (engine/exporter/kernels/gpu_attention.py). q [n, kvh, rep, d] is scaled; keys and values [kvh, slots,
    d] are a layer of the cache as stored (float16 or float32), read in place; mask [n, C], C the slots attended.
    Shapes are fixed (a GPU build's calls: engine/shapes.py)."""
    return _ops()["attend_one"](q, keys, values, mask, 0.0 if softcap is None else float(softcap))


def attend_split_slots(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """softmax(scale * q . keys + mask) . values -> [kvh, rep, d] (decode's attention on cuda): the custom op, IREE's
    attention op a block of ATTEND_STEP slots at a time and a join (engine/exporter/kernels/split_attention.py).
    q [kvh, rep, d] unscaled; keys and values float32 blocks [kvh, C / ATTEND_STEP, ATTEND_STEP, d]
    (first_blocks); mask [C]. Shapes are fixed."""
    return _ops()["attend_split"](q, keys, values, mask, float(scale))


def softmax_over_slots(scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scores [kvh, rep, C] or [kvh, rep, n, C] (+ mask [n, C])) over the slots, on a cpu: the custom op,
    one dispatch a layer (engine/exporter/kernels/attention_rows.py). Decode's scores hold their mask already."""
    return _ops()["softmax"](scores) if mask is None else _ops()["softmax_masked"](scores, mask)


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
_ATTEND_ONE = r"""
module {{
{executable}
util.func private @{name}(%q: tensor<{n}x{h}x{r}x{d}xf32>, %k: tensor<{h}x{size}x{d}x{e}>, %v: tensor<{h}x{size}x{d}x{e}>, %m: tensor<{n}x{c}xf32>) -> tensor<{n}x{h}x{r}x{d}xf32> {{
  {call}
  util.return %o : tensor<{n}x{h}x{r}x{d}xf32>
}}
}}
"""

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


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    CustomOp, library, emit, shape = kit.CustomOp, kit.library, kit.emit, kit.shape

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
        name = f"eddy_{'qk' if keys else 'pv'}{'_blocks' if blocked else ''}_{h}x{r}x{d}{'_cpu' if active().cpu_tuned else ''}"
        lowering, template = ((_BLOCKS_CPU, _QUERY_BLOCKS) if blocked else (_SCORES_CPU, _QUERY_KEYS)) if keys else (
            _VALUES_CPU, _WEIGHTED_VALUES)
        attrs = lowering.format(r=r, d=d, step=ATTEND_STEP) if active().cpu_tuned else ""
        emit(kb, name, template.format(name=name, h=h, r=r, d=d, step=ATTEND_STEP, attrs=attrs,
                                       **_MASK_FIRST[active().cpu_tuned]))

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
            e = kit.element_type(kb, 1)
            if active().cpu_tuned and d % 16 == 0 and attention_rows.values_block(r, d):
                name = f"eddy_pv_rows_{h}x{r}x{d}x{e}_hand"
                exe = f"{name}_e"
                emit(kb, name, _VALUES_BY_HAND.format(
                    name=name, h=h, r=r, d=d, e=e,
                    executable=attention_rows.weighted_values_executable(exe, h, r, d, e),
                    call=attention_rows.weighted_values_call(exe, h, r, d, e, "%p", "%v", "%n", "%cols", "%slots",
                                                             "%o")))
                return
            name = f"eddy_pv_rows_{h}x{r}x{d}x{e}{'_cpu' if active().cpu_tuned else ''}"
            attrs = _VALUES_ROWS_CPU.format(r=r, d=d) if active().cpu_tuned else ""
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
            e = kit.element_type(kb, 1)
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
            e = kit.element_type(kb, 1)
            name = f"eddy_attend_rows_{h}x{r}x{d}x{e}"
            exe = f"{name}_e"
            emit(kb, name, _ATTEND_BY_HAND.format(
                name=name, h=h, r=r, d=d, e=e, executable=attention_rows.attend_rows_executable(exe, h, r, d, e),
                call=attention_rows.attend_rows_call(exe, h, r, d, e, "%q", "%k", "%v", "%m", "%n", "%cols",
                                                     "%slots", "%o")))

    def select_fixed(ksel: KernelSelection) -> None:
        """q, keys, values and mask of fixed shapes and a float (the cap or the scale): the output is q's shape."""
        q, *rest = (ksel.arg_tensor(i) for i in range(4))
        for t in (q, *rest):
            t.specialize_all_dims()
        ksel.attr_float(4)
        ksel.return_new_tensor(list(q.t.shape), dtype=torch.float32)

    @CustomOp.register(library=library)
    class attend_one(CustomOp):
        signature = "attend_one(Tensor q, Tensor k, Tensor v, Tensor m, float cap) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_fixed(ksel)

        def eager_execute(self, q, k, v, m, cap):
            cols = m.shape[1]
            scores = torch.einsum("nhrd,hcd->nhrc", q, _eager_float(k[:, :cols]))
            if cap:
                scores = torch.tanh(scores / cap) * cap
            probs = torch.softmax(scores + m[:, None, None, :], -1)
            return torch.einsum("nhrc,hcd->nhrd", probs, _eager_float(v[:, :cols]))

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (n, h, r, d), (_, size, _), (_, c) = shape(kb, 0), shape(kb, 1), shape(kb, 3)
            e, cap = kit.element_type(kb, 1), ksel.arg_descs[4].v
            name = f"eddy_attend_one_{n}x{h}x{r}x{d}_{size}x{c}x{e}" + (f"_cap{cap:g}".replace(".", "p") if cap else "")
            exe = f"{name}_e"
            emit(kb, name, _ATTEND_ONE.format(
                name=name, n=n, h=h, r=r, d=d, size=size, c=c, e=e,
                executable=gpu_attention.attention_executable(exe, n, h, r, d, size, c, e, cap or None),
                call=gpu_attention.attention_call(exe, n, h, r, d, size, c, e, "%q", "%k", "%v", "%m", "%o")))

    @CustomOp.register(library=library)
    class attend_split(CustomOp):
        signature = "attend_split(Tensor q, Tensor k, Tensor v, Tensor m, float scale) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_fixed(ksel)

        def eager_execute(self, q, k, v, m, scale):
            probs = torch.softmax(torch.einsum("hrd,hcd->hrc", q, k.flatten(1, 2)) * scale + m, -1)
            return torch.einsum("hrc,hcd->hrd", probs, v.flatten(1, 2))

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (h, r, d), splits = shape(kb, 0), shape(kb, 1)[1]
            scale = ksel.arg_descs[4].v
            name = f"eddy_attend_split_{h}x{r}x{d}_s{splits}_" + f"{scale:.9g}".replace(".", "p").replace("-", "m")
            emit(kb, name, split_attention.split_attention(name, h, r, d, splits, scale))

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

    return {"qk": attend_qk, "pv": attend_pv, "pv_rows": attend_pv_rows, "qk_rows": attend_qk_rows,
            "attend_rows": attend_rows, "attend_one": attend_one, "attend_split": attend_split,
            "softmax": attend_softmax, "softmax_masked": attend_softmax_masked}
