"""Attention's pieces over many rows written by hand on a cpu (`stream.executable`s): the softmax over the attended
slots (prefill's and decode's) and prefill's output (probabilities times values); and prefill's whole attention in
one dispatch (attend_rows_executable, below), which the other two serve only where it does not apply (a soft cap
on the scores, a local layer's own ring, a head size not in whole vectors).

The softmax. The attended slot count is a dynamic dimension, and IREE vectorises no softmax over a dynamic innermost
dimension; `model.softmax_in_blocks` gets vectors back by taking it per block of ATTEND_STEP slots, then over the
blocks, but that is five dispatches a layer (maxima and sums per block, then over the blocks, then the scaling),
each going over the scores again: 6 of a 30-token turn's 46 ms of dispatches at 1000 of context. Here a row of
scores (a few kB) is read into L1 once and gone over three times there: the mask added and the maximum, then the
exponentials and their sum, then the scaling.

probs[row, s] = softmax over s of (scores[row, s] + mask[row % n, s]): rows are [kv heads x rep x n] (the scores'
layout), the mask [n, slots] (one row per query; decode's one query has its mask in the scores already and passes
none). The slot count is a multiple of ATTEND_STEP (engine/config.py).

The output. As a generic with a per-query lowering (attention._WEIGHTED_VALUES_ROWS) each query read every value of
its kv head again: 0.22 ms a layer for 30 queries over 1000 slots, 3.1 ms for 512 over 512 (default model). Here
a block of queries shares each load of a value row: 0.10 and 0.88 ms.
"""
from __future__ import annotations

from ...config import ATTEND_STEP

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
    bfloat16's bits, engine/exporter/model.py's KV_STORAGE) as float32; none for f32, whose `value` is used as it is."""
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


# Prefill's attention in one dispatch a layer (flash-style): scores, softmax and output for a block of queries,
# the keys and values read in place. Laid out for the vector unit with no transpose of the cache: a vector holds
# 16 queries of one (kv head, rep) pair, so a score is q's vector times one key element broadcast (the keys as
# stored, [slot, d]), the softmax's maximum and sum over the slots are elementwise across slot vectors, and the
# output, kept transposed [d, 16 queries], is the probabilities' vector times one value element broadcast. A
# workgroup takes a kv head and `vectors` such vectors of queries; per block of ATTEND_STEP slots it widens the keys
# into its stack (shared by its vectors), takes the scores from a mask (transposed: [slots, queries]) plus the
# products, rescales what it holds by the new maximum (the online softmax), then widens the values into the same
# stack and adds the block's probabilities times values.
# What it replaced: the scores (a matmul for which IREE widened and packed the attended keys on every call), the
# softmax and the output, three dispatches each going over scores held in memory: [kv heads, rep, n, slots] float32
# twice, 19 MB each for a 512-token chunk at 1024 slots. Default model (AMD EPYC, dispatch profiles): the same time
# (a 30-token turn at 1000: 17.2 against 17.7 ms; a 512-token chunk: 127-133 against 135 ms), 90 dispatches fewer a
# call, and a 1024-token prefill's peak resident memory 331 -> 246 MB.
#
# Its stack holds the widened keys or values of `staged` slots [staged, d], and per vector of queries the block's
# scores [16, 16] and the output's sums [d, 16], all float32: it grows with d, and IREE refuses a dispatch whose
# stack passes 32 kB (on every CPU: it counts the allocations, not the registers spilled). attend_plan takes the
# most vectors, then the most staged slots, whose stack fits ATTEND_STACK: two vectors and all 16 slots up to a
# head_dim of 128 (Llama 3 8B, Mistral, Qwen3), one vector staging 8 slots at a time at 256 (Gemma).
ATTEND_STACK = 28 << 10
# Slots whose scores (and outputs' dimensions whose sums) are accumulated at once: independent chains of
# multiply-adds for the latency, within the registers.
SCORE_SLOTS = 8
OUT_DIMS = 8


def attend_stack(d: int, vectors: int, staged: int) -> int:
    """Bytes of stack a workgroup of attend_rows_executable takes."""
    return 4 * (staged * d + vectors * (16 * 16 + d * 16))


def attend_plan(d: int) -> tuple[int, int] | None:
    """(vectors of queries a workgroup takes, slots of keys or values it widens at a time) for head_dim d, or None
    where no plan's stack fits (prefill then takes the attention's pieces: kernels.query_keys_rows and after)."""
    if d % 16:
        return None
    return next(((vectors, staged) for vectors in (2, 1) for staged in (16, SCORE_SLOTS)
                 if attend_stack(d, vectors, staged) <= ATTEND_STACK), None)


_ATTEND = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%n: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    %c16 = arith.constant 16 : index
    %cr = arith.constant {r} : index
    %per = arith.constant {vecs} : index
    %h = arith.constant {h} : index
    %nv = arith.ceildivui %n, %c16 : index
    %all = arith.muli %nv, %cr : index
    %w = arith.ceildivui %all, %per : index
    stream.return %w, %h, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%qb: !stream.binding, %kb: !stream.binding, %vb: !stream.binding, %mb: !stream.binding,
                      %n: index, %cols: index, %slots: index, %ob: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c16 = arith.constant 16 : index
      %ch = arith.constant {h} : index
      %cr = arith.constant {r} : index
      %per = arith.constant {vecs} : index
      %cd = arith.constant {d} : index
      %cso = arith.constant {so} : index
      %cod = arith.constant {od} : index
      %cst = arith.constant {staged} : index
      %zv = arith.constant dense<0.0> : vector<16xf32>
      %lowest = arith.constant dense<-3.0e+38> : vector<16xf32>
      %one = arith.constant dense<1.0> : vector<16xf32>
      %stride = arith.constant dense<{hrd}> : vector<16xindex>
      %lane = arith.constant dense<[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]> : vector<16xindex>
{constants}
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> memref<{h}x{r}x{d}x?xf32>{{%n}}
      %k = stream.binding.subspan %kb[%c0] : !stream.binding -> memref<{h}x?x{d}x{e}>{{%slots}}
      %v = stream.binding.subspan %vb[%c0] : !stream.binding -> memref<{h}x?x{d}x{e}>{{%slots}}
      %m = stream.binding.subspan %mb[%c0] : !stream.binding -> memref<?x?xf32>{{%cols, %n}}
      %o4 = stream.binding.subspan %ob[%c0] : !stream.binding -> memref<?x{h}x{r}x{d}xf32>{{%n}}
      %o = memref.collapse_shape %o4 [[0, 1, 2, 3]] : memref<?x{h}x{r}x{d}xf32> into memref<?xf32>
      %wx = stream.dispatch.workgroup.id[0] : index
      %kh = stream.dispatch.workgroup.id[1] : index
      %nv = arith.ceildivui %n, %c16 : index
      %all = arith.muli %nv, %cr : index
      %last = arith.subi %all, %c1 : index
      %first = arith.muli %wx, %per : index{vectors}
      %st = memref.alloca() : memref<{staged}x{d}xf32>
      %ps = memref.alloca() : memref<{vecs}x16x16xf32>
      %os = memref.alloca() : memref<{vecs}x{d}x16xf32>
      scf.for %j = %c0 to %cd step %c1 {{{zero_out}
      }}
      %fin:{state} = scf.for %sb = %c0 to %cols step %c16 iter_args({iter_args}) -> ({state_types}) {{
        scf.for %ks = %c0 to %c16 step %cst {{
          scf.for %s = %c0 to %cst step %c1 {{
            %kbs = arith.addi %sb, %ks : index
            %slot = arith.addi %kbs, %s : index{widen_keys}
          }}
          scf.for %g = %c0 to %cst step %cso {{{scores}
          }}
        }}{softmax}
        scf.for %vs = %c0 to %c16 step %cst {{
          scf.for %s = %c0 to %cst step %c1 {{
            %vbs = arith.addi %sb, %vs : index
            %slot = arith.addi %vbs, %s : index{widen_values}
          }}
          scf.for %j = %c0 to %cd step %cod {{{output}
          }}
        }}
        scf.yield {yields} : {state_types}
      }}{stores}
      return
    }}
  }}
}}
"""


def _element(out: str, block: str, row: str, col: str, d: int, staged: int) -> str:
    """MLIR lines setting `out` to element [row, col] of the widened keys or values (memref<staged x d x f32>, on
    the stack) in all 16 lanes: the factor a vector of queries is multiplied by."""
    return f"""
          {out}_x = memref.load {block}[{row}, {col}] : memref<{staged}x{d}xf32>
          {out} = vector.broadcast {out}_x : f32 to vector<16xf32>"""


def _widen_rows(src: str, which: str, h: int, d: int, e: str, staged: int) -> str:
    """MLIR lines widening row %slot of a layer's keys or values `src` (stored as `e`) into row %s of %st."""
    lines = []
    for p in range(d // 16):
        loaded = f"%{which}{p}" if e == "f32" else f"%{which}w{p}"
        lines.append(f"""
            {loaded} = vector.load {src}[%kh, %slot, %j{16 * p}] : memref<{h}x?x{d}x{e}>, vector<16x{e}>""")
        lines += [f"\n            {line}" for line in widen(loaded, e, f"%{which}{p}", 16)]
        lines.append(f"""
            vector.store %{which}{p}, %st[%s, %j{16 * p}] : memref<{staged}x{d}xf32>, vector<16xf32>""")
    return "".join(lines)


def attend_rows_executable(name: str, h: int, r: int, d: int, e: str = "f32") -> str:
    """The `stream.executable` @name: out [n, h, r, d] = softmax(q . keys + mask) . values for prefill's n queries,
    from qT [h, r, d, n] (q scaled, transposed), a layer's keys and values [h, slots, d] stored as `e` (read in
    place, the first cols slots attended) and the mask transposed, [cols, n]. d has a plan (attend_plan); cols is
    a multiple of 16."""
    plan = attend_plan(d)
    assert plan, f"no attention plan fits a head_dim of {d}"
    (vecs, staged), so, od = plan, SCORE_SLOTS, OUT_DIMS
    ts = range(vecs)
    constants = "\n".join(f"      %t{t} = arith.constant {t} : index" for t in ts) + "\n" + "\n".join(
        f"      %s{g} = arith.constant {g} : index" for g in range(16)) + "\n" + "\n".join(
        f"      %j{j} = arith.constant {j} : index" for j in range(max(d, 16)))
    # Each vector: which (rep, block of 16 queries) it is, its lanes in range; one past the last repeats the last
    # and stores nothing.
    vectors = "".join(f"""
      %at{t} = arith.addi %first, %t{t} : index
      %vi{t} = arith.minui %at{t}, %last : index
      %rr{t} = arith.divui %vi{t}, %nv : index
      %ib{t} = arith.remui %vi{t}, %nv : index
      %i0{t} = arith.muli %ib{t}, %c16 : index
      %left{t} = arith.subi %n, %i0{t} : index
      %lanes{t} = vector.create_mask %left{t} : vector<16xi1>
      %real{t} = arith.cmpi ult, %at{t}, %all : index
      %keep{t} = arith.select %real{t}, %left{t}, %c0 : index
      %stored{t} = vector.create_mask %keep{t} : vector<16xi1>""" for t in ts)
    zero_out = "".join(f"""
        vector.store %zv, %os[%t{t}, %j, %c0] : memref<{vecs}x{d}x16xf32>, vector<16xf32>""" for t in ts)
    iter_args = ", ".join([f"%mx{t} = %lowest" for t in ts] + [f"%sum{t} = %zv" for t in ts])
    state_types = ", ".join(["vector<16xf32>"] * (2 * vecs))
    # Scores of SCORE_SLOTS slots at a time (%g among the staged ones, from %ks in the block): the mask's row (the
    # slot's, over the vector's queries) plus the sum over d of q's vector times the key's element.
    scores = []
    for g in range(so):
        scores.append(f"""
          %sl{g} = arith.addi %g, %s{g} : index
          %bl{g} = arith.addi %ks, %sl{g} : index
          %ms{g} = arith.addi %sb, %bl{g} : index""")
        for t in ts:
            scores.append(f"""
          %a{t}_{g}_0 = vector.maskedload %m[%ms{g}, %i0{t}], %lanes{t}, %zv : memref<?x?xf32>, vector<16xi1>, vector<16xf32> into vector<16xf32>""")
    for j in range(d):
        for t in ts:
            scores.append(f"""
          %q{t}_{j} = vector.maskedload %q[%kh, %rr{t}, %j{j}, %i0{t}], %lanes{t}, %zv : memref<{h}x{r}x{d}x?xf32>, vector<16xi1>, vector<16xf32> into vector<16xf32>""")
        for g in range(so):
            scores.append(_element(f"%kb{g}_{j}", "%st", f"%sl{g}", f"%j{j}", d, staged))
            scores += [f"""
          %a{t}_{g}_{j + 1} = math.fma %q{t}_{j}, %kb{g}_{j}, %a{t}_{g}_{j} : vector<16xf32>""" for t in ts]
    for t in ts:
        for g in range(so):
            scores.append(f"""
          vector.store %a{t}_{g}_{d}, %ps[%t{t}, %bl{g}, %c0] : memref<{vecs}x16x16xf32>, vector<16xf32>""")
    # The online softmax: the block's maximum per query, what is held rescaled to it, the block's exponentials.
    softmax = []
    for t in ts:
        softmax.append("".join(f"""
        %x{t}_{s} = vector.load %ps[%t{t}, %s{s}, %c0] : memref<{vecs}x16x16xf32>, vector<16xf32>""" for s in range(16)))
        prev = f"%mx{t}"
        for s in range(16):
            softmax.append(f"""
        %bm{t}_{s} = arith.maximumf {prev}, %x{t}_{s} : vector<16xf32>""")
            prev = f"%bm{t}_{s}"
        softmax.append(f"""
        %dm{t} = arith.subf %mx{t}, {prev} : vector<16xf32>
        %al{t} = math.exp %dm{t} : vector<16xf32>
        %sc{t} = arith.mulf %sum{t}, %al{t} : vector<16xf32>""")
        acc = f"%sc{t}"
        for s in range(16):
            softmax.append(f"""
        %y{t}_{s} = arith.subf %x{t}_{s}, {prev} : vector<16xf32>
        %p{t}_{s} = math.exp %y{t}_{s} : vector<16xf32>
        vector.store %p{t}_{s}, %ps[%t{t}, %s{s}, %c0] : memref<{vecs}x16x16xf32>, vector<16xf32>
        %ls{t}_{s} = arith.addf {acc}, %p{t}_{s} : vector<16xf32>""")
            acc = f"%ls{t}_{s}"
    softmax.append("""
        scf.for %j = %c0 to %cd step %c1 {""" + "".join(f"""
          %h{t} = vector.load %os[%t{t}, %j, %c0] : memref<{vecs}x{d}x16xf32>, vector<16xf32>
          %hs{t} = arith.mulf %h{t}, %al{t} : vector<16xf32>
          vector.store %hs{t}, %os[%t{t}, %j, %c0] : memref<{vecs}x{d}x16xf32>, vector<16xf32>""" for t in ts) + """
        }""")
    # The output: OUT_DIMS of d at a time, each a chain over the staged slots (from %vs in the block).
    output = [f"""
          %jj{u} = arith.addi %j, %j{u} : index""" for u in range(od)]
    output += [f"""
          %bs{s} = arith.addi %vs, %s{s} : index""" for s in range(staged)]
    for t in ts:
        for u in range(od):
            output.append(f"""
          %o{t}_{u}_0 = vector.load %os[%t{t}, %jj{u}, %c0] : memref<{vecs}x{d}x16xf32>, vector<16xf32>""")
    for s in range(staged):
        for t in ts:
            output.append(f"""
          %pp{t}_{s} = vector.load %ps[%t{t}, %bs{s}, %c0] : memref<{vecs}x16x16xf32>, vector<16xf32>""")
        for u in range(od):
            output.append(_element(f"%vb{u}_{s}", "%st", f"%s{s}", f"%jj{u}", d, staged))
            output += [f"""
          %o{t}_{u}_{s + 1} = math.fma %pp{t}_{s}, %vb{u}_{s}, %o{t}_{u}_{s} : vector<16xf32>""" for t in ts]
    for t in ts:
        for u in range(od):
            output.append(f"""
          vector.store %o{t}_{u}_{staged}, %os[%t{t}, %jj{u}, %c0] : memref<{vecs}x{d}x16xf32>, vector<16xf32>""")
    yields = ", ".join([f"%bm{t}_15" for t in ts] + [f"%ls{t}_15" for t in ts])
    # Each query's outputs scattered to out[i, kh, rr, j]: lane by lane d * h * r apart.
    stores = "".join(f"""
      %inv{t} = arith.divf %one, %fin#{vecs + t} : vector<16xf32>
      %row{t} = arith.muli %i0{t}, %ch : index
      %rowh{t} = arith.addi %row{t}, %kh : index
      %rowr{t} = arith.muli %rowh{t}, %cr : index
      %rowrr{t} = arith.addi %rowr{t}, %rr{t} : index
      %base{t} = arith.muli %rowrr{t}, %cd : index
      %offs{t} = arith.muli %lane, %stride : vector<16xindex>
      scf.for %j = %c0 to %cd step %c1 {{
        %f{t} = vector.load %os[%t{t}, %j, %c0] : memref<{vecs}x{d}x16xf32>, vector<16xf32>
        %w{t} = arith.mulf %f{t}, %inv{t} : vector<16xf32>
        %at{t}j = arith.addi %base{t}, %j : index
        vector.scatter %o[%at{t}j] [%offs{t}], %stored{t}, %w{t} : memref<?xf32>, vector<16xindex>, vector<16xi1>, vector<16xf32>
      }}""" for t in ts)
    return _ATTEND.format(
        name=name, h=h, r=r, d=d, e=e, vecs=vecs, staged=staged, so=so, od=od, hrd=h * r * d,
        constants=constants, vectors=vectors, zero_out=zero_out, state=2 * vecs, iter_args=iter_args,
        state_types=state_types, widen_keys=_widen_rows("%k", "k", h, d, e, staged),
        widen_values=_widen_rows("%v", "v", h, d, e, staged), scores="".join(scores), softmax="".join(softmax),
        output="".join(output), yields=yields, stores=stores)


def attend_rows_call(name: str, h: int, r: int, d: int, e: str, q: str, keys: str, values: str, mask: str, n: str,
                     cols: str, slots: str, out: str) -> str:
    """The `flow.dispatch` of attend_rows_executable @name, binding `out` (tensor<? x h x r x d x f32>)."""
    kv = f"tensor<{h}x?x{d}x{e}>{{{slots}}}"
    return (f"{out} = flow.dispatch @{name}::@{name}[{n}]({q}, {keys}, {values}, {mask}, {n}, {cols}, {slots}) : "
            f"(tensor<{h}x{r}x{d}x?xf32>{{{n}}}, {kv}, {kv}, tensor<?x?xf32>{{{cols}, {n}}}, index, index, index) "
            f"-> tensor<?x{h}x{r}x{d}xf32>{{{n}}}")
