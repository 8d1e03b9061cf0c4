"""Attention's pieces over many rows written by hand on a cpu (`stream.executable`s): the softmax over the attended
slots (prefill's and decode's) and prefill's output (probabilities times values).

The softmax. The attended slot count is a dynamic dimension, and IREE vectorises no softmax over a dynamic innermost
dimension; `model.softmax_in_blocks` gets vectors back by taking it per block of ATTEND_STEP slots, then over the
blocks, but that is five dispatches a layer (maxima and sums per block, then over the blocks, then the scaling),
each going over the scores again: 6 of a 30-token turn's 46 ms of dispatches at 1000 of context. Here a row of
scores (a few kB) is read into L1 once and gone over three times there: the mask added and the maximum, then the
exponentials and their sum, then the scaling.

probs[row, s] = softmax over s of (scores[row, s] + mask[row % n, s]): rows are [kv heads x rep x n] (the scores'
layout), the mask [n, slots] (one row per query; decode's one query has its mask in the scores already and passes
none). The slot count is a multiple of ATTEND_STEP (engine/config.py).

The output. As a generic with a per-query lowering (kernels._WEIGHTED_VALUES_ROWS) each query read every value of
its kv head again: 0.22 ms a layer for 30 queries over 1000 slots, 3.1 ms for 512 over 512 (default model). Here
a block of queries shares each load of a value row: 0.10 and 0.88 ms.
"""
from __future__ import annotations

from ..config import ATTEND_STEP

# Rows of scores a workgroup of the softmax takes.
ROWS_PER_WORKGROUP = 8

_SOFTMAX = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%rows: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    %per = arith.constant {per} : index
    %w = arith.ceildivui %rows, %per : index
    stream.return %w, %c1, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%sb: !stream.binding, {mask_arg}%rows: index, %n: index, %cols: index, %ob: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %cs = arith.constant {step} : index
      %per = arith.constant {per} : index
      %lowest = arith.constant dense<0xFF800000> : vector<{step}xf32>
      %zv = arith.constant dense<0.0> : vector<{step}xf32>
      %one = arith.constant 1.0 : f32
      %s = stream.binding.subspan %sb[%c0] : !stream.binding -> memref<?x?xf32>{{%rows, %cols}}{mask_subspan}
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> memref<?x?xf32>{{%rows, %cols}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %per : index
      %r1a = arith.addi %r0, %per : index
      %r1 = arith.minui %r1a, %rows : index
      scf.for %row = %r0 to %r1 step %c1 {{{query}
        %mx = scf.for %j = %c0 to %cols step %cs iter_args(%m = %lowest) -> (vector<{step}xf32>) {{
          {loaded} = vector.load %s[%row, %j] : memref<?x?xf32>, vector<{step}xf32>{add_mask}
          vector.store %v, %o[%row, %j] : memref<?x?xf32>, vector<{step}xf32>
          %m2 = arith.maximumf %m, %v : vector<{step}xf32>
          scf.yield %m2 : vector<{step}xf32>
        }}
        %max = vector.reduction <maximumf>, %mx : vector<{step}xf32> into f32
        %maxv = vector.broadcast %max : f32 to vector<{step}xf32>
        %sv = scf.for %j = %c0 to %cols step %cs iter_args(%t = %zv) -> (vector<{step}xf32>) {{
          %v = vector.load %o[%row, %j] : memref<?x?xf32>, vector<{step}xf32>
          %d = arith.subf %v, %maxv : vector<{step}xf32>
          %e = math.exp %d : vector<{step}xf32>
          vector.store %e, %o[%row, %j] : memref<?x?xf32>, vector<{step}xf32>
          %t2 = arith.addf %t, %e : vector<{step}xf32>
          scf.yield %t2 : vector<{step}xf32>
        }}
        %sum = vector.reduction <add>, %sv : vector<{step}xf32> into f32
        %inv = arith.divf %one, %sum : f32
        %invv = vector.broadcast %inv : f32 to vector<{step}xf32>
        scf.for %j = %c0 to %cols step %cs {{
          %e = vector.load %o[%row, %j] : memref<?x?xf32>, vector<{step}xf32>
          %p = arith.mulf %e, %invv : vector<{step}xf32>
          vector.store %p, %o[%row, %j] : memref<?x?xf32>, vector<{step}xf32>
        }}
      }}
      return
    }}
  }}
}}
"""


def softmax_rows_executable(name: str, masked: bool) -> str:
    """The `stream.executable` @name: probs [rows, cols] from scores [rows, cols] (and, `masked`, the mask
    [n, cols] added to each row first: row r takes the mask's row r % n)."""
    return _SOFTMAX.format(
        name=name, per=ROWS_PER_WORKGROUP, step=ATTEND_STEP,
        mask_arg="%mb: !stream.binding, " if masked else "",
        mask_subspan="\n      %mk = stream.binding.subspan %mb[%c0] : !stream.binding -> memref<?x?xf32>{%n, %cols}"
        if masked else "",
        query="\n        %q = arith.remui %row, %n : index" if masked else "",
        add_mask=f"""
          %mv = vector.load %mk[%q, %j] : memref<?x?xf32>, vector<{ATTEND_STEP}xf32>
          %v = arith.addf %v0, %mv : vector<{ATTEND_STEP}xf32>""" if masked else "",
        loaded="%v0" if masked else "%v")


def softmax_rows_call(name: str, masked: bool, scores: str, mask: str, rows: str, n: str, cols: str,
                      out: str) -> str:
    """The `flow.dispatch` of softmax_rows_executable @name, binding `out` (tensor<?x?xf32>, rows x cols) from
    `scores` (the same shape) and, `masked`, `mask` (tensor<?x?xf32>, n x cols)."""
    operands = f"{scores}, {mask}, " if masked else f"{scores}, "
    types = (f"tensor<?x?xf32>{{{rows}, {cols}}}, tensor<?x?xf32>{{{n}, {cols}}}, " if masked
             else f"tensor<?x?xf32>{{{rows}, {cols}}}, ")
    return (f"{out} = flow.dispatch @{name}::@{name}[{rows}]({operands}{rows}, {n}, {cols}) : "
            f"({types}index, index, index) -> tensor<?x?xf32>{{{rows}, {cols}}}")


# Prefill's attention output: out[i, h, r, j] = sum over s of probs[h, r, i, s] * values[h, s, j], in the output
# projection's order. A workgroup takes a kv head and a block of values_block() queries; for each slot it loads the
# value row once (d / 16 vectors) and multiplies it into every (query, rep) row's accumulators, so the values are
# read once per block of queries, not once per query.
_VALUES = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%n: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    %qb = arith.constant {qb} : index
    %h = arith.constant {h} : index
    %w = arith.ceildivui %n, %qb : index
    stream.return %w, %h, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%pb: !stream.binding, %vb: !stream.binding, %n: index, %cols: index, %slots: index,
                      %ob: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %qb = arith.constant {qb} : index
      %zv = arith.constant dense<0.0> : vector<16xf32>
{constants}
      %p = stream.binding.subspan %pb[%c0] : !stream.binding -> memref<{h}x{r}x?x?xf32>{{%n, %cols}}
      %v = stream.binding.subspan %vb[%c0] : !stream.binding -> memref<{h}x?x{d}x{e}>{{%slots}}
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> memref<?x{h}x{r}x{d}xf32>{{%n}}
      %wq = stream.dispatch.workgroup.id[0] : index
      %kh = stream.dispatch.workgroup.id[1] : index
      %last = arith.subi %n, %c1 : index
      %i0 = arith.muli %wq, %qb : index{queries}
      %acc:{count} = scf.for %s = %c0 to %cols step %c1 iter_args({iter_args}) -> ({types}) {{{values}{products}
        scf.yield {yields} : {types}
      }}{stores}
      return
    }}
  }}
}}
"""


def values_block(r: int, d: int) -> int:
    """Queries a workgroup of _VALUES takes: as many as keep its accumulators (queries x rep x d / 16 vectors of 16
    floats) within 24 of AVX-512's 32 registers; 0 when one query's do not fit (the caller keeps the generic)."""
    return 24 // (r * d // 16)


def widen(value: str, e: str, out: str, lanes: int = 0) -> list[str]:
    """MLIR lines setting `out` to `value` (a scalar, or a vector of `lanes`) of KV cache type `e` (f16, or i16:
    bfloat16's bits, engine/build/model.py's KV_STORAGE) as float32; none for f32, whose `value` is used as it is."""
    def of(t: str) -> str:
        return f"vector<{lanes}x{t}>" if lanes else t
    if e == "f32":
        return []
    if e == "f16":
        return [f"{out} = arith.extf {value} : {of('f16')} to {of('f32')}"]
    return [f"{out}_b = arith.bitcast {value} : {of('i16')} to {of('bf16')}",
            f"{out} = arith.extf {out}_b : {of('bf16')} to {of('f32')}"]


def weighted_values_executable(name: str, h: int, r: int, d: int, e: str = "f32") -> str:
    """The `stream.executable` @name: out [n, h, r, d] from probs [h, r, n, cols] and the first cols of values
    [h, slots, d] (slots >= cols: a layer of the cache, read in place), stored as `e` (f32, f16, i16 for bf16)."""
    qb, parts = values_block(r, d), d // 16
    accs = [(q, rr, k) for q in range(qb) for rr in range(r) for k in range(parts)]
    name_of = {a: f"%a{a[0]}_{a[1]}_{a[2]}" for a in accs}
    constants = "\n".join(f"      %k{k} = arith.constant {16 * k} : index" for k in range(parts)) + "\n" + "\n".join(
        f"      %r{rr} = arith.constant {rr} : index" for rr in range(r)) + "\n" + "\n".join(
        f"      %q{q} = arith.constant {q} : index" for q in range(qb))
    queries = "".join(f"""
      %ii{q} = arith.addi %i0, %q{q} : index
      %row{q} = arith.minui %ii{q}, %last : index
      %in{q} = arith.cmpi ult, %ii{q}, %n : index""" for q in range(qb))
    values = []
    for k in range(parts):
        loaded = f"%v{k}" if e == "f32" else f"%w{k}"  # a 16-bit row is widened as it is loaded
        values.append(f"""
        {loaded} = vector.load %v[%kh, %s, %k{k}] : memref<{h}x?x{d}x{e}>, vector<16x{e}>""")
        values += [f"\n        {line}" for line in widen(loaded, e, f"%v{k}", 16)]
    products = []
    for q in range(qb):
        for rr in range(r):
            products.append(f"""
        %p{q}_{rr} = memref.load %p[%kh, %r{rr}, %row{q}, %s] : memref<{h}x{r}x?x?xf32>
        %b{q}_{rr} = vector.broadcast %p{q}_{rr} : f32 to vector<16xf32>""")
            products += [f"""
        %n{q}_{rr}_{k} = math.fma %b{q}_{rr}, %v{k}, {name_of[(q, rr, k)]} : vector<16xf32>""" for k in range(parts)]
    out_type = f"memref<?x{h}x{r}x{d}xf32>"
    stores = "".join(f"""
      scf.if %in{q} {{""" + "".join(f"""
        vector.store %acc#{accs.index((q, rr, k))}, %o[%row{q}, %kh, %r{rr}, %k{k}] : {out_type}, vector<16xf32>"""
                                  for rr in range(r) for k in range(parts)) + """
      }""" for q in range(qb))
    types = ", ".join(["vector<16xf32>"] * len(accs))
    return _VALUES.format(
        name=name, h=h, r=r, d=d, e=e, qb=qb, constants=constants, queries=queries, count=len(accs),
        iter_args=", ".join(f"{name_of[a]} = %zv" for a in accs), types=types, values="".join(values),
        products="".join(products), yields=", ".join(f"%n{q}_{rr}_{k}" for q, rr, k in accs), stores=stores)


def weighted_values_call(name: str, h: int, r: int, d: int, e: str, probs: str, values: str, n: str, cols: str,
                         slots: str, out: str) -> str:
    """The `flow.dispatch` of weighted_values_executable @name, binding `out` (tensor<?x h x r x d x f32>)."""
    return (f"{out} = flow.dispatch @{name}::@{name}[{n}]({probs}, {values}, {n}, {cols}, {slots}) : "
            f"(tensor<{h}x{r}x?x?xf32>{{{n}, {cols}}}, tensor<{h}x?x{d}x{e}>{{{slots}}}, index, index, index) "
            f"-> tensor<?x{h}x{r}x{d}xf32>{{{n}}}")
