"""Attention on a GPU whose IREE pipeline has no attention op of its own (vulkan: SPIR-V rejects
`iree_linalg_ext.online_attention`), written by hand (no torch; the text is MLIR that the export places in the model,
as dot_products.py's is on x86): `stream.executable`s over memrefs with `gpu` ops, compiled by iree-compile's SPIR-V
lowering as they are.

One workgroup a query row, query head and split of the slots, one thread a position of the head (workgroup size =
head_dim). A split's slots go by in tiles of head_dim slots, softmax online (flash attention's running maximum and
sum):
1. thread t scores slot tile + t (q . key, Gemma 2's soft cap, the mask) into workgroup memory;
2. every thread reads the tile's maximum from there (the same value in each: no reduction tree to synchronise);
3. thread t turns its score into a probability, and after a barrier adds the tile's probabilities times the values'
   position t to its output, rescaled by the new maximum.
Keys and values are read where the cache holds them (the layer's [kvh, size, d], as stored: float16 or float32),
only the call's attended slots. q comes scaled (model.Attention.q_scale); the mask is additive, -inf where a slot
is not seen. The running maximum starts finite, so a tile of masked slots adds exp(-inf) = 0, never NaN.

Split over the slots where a call has few rows (decode: one), as flash decoding is: a workgroup per head alone would
walk a thousand slots in sequence while the GPU's other cores idle (the default model's 9 heads on a GPU of 100+).
Each split then writes its unscaled output, running maximum and sum, and a second dispatch joins a head's splits
(each rescaled by exp(its maximum - the largest)). A call of many rows (prefill) has workgroups enough and takes one
split, in one dispatch.
"""
from __future__ import annotations

# The running maximum before any slot: finite (exp of -inf minus it is 0; -inf minus -inf would be NaN).
_START = "-3.0e+38"
# Workgroups a call wants before its slots are split: a few for each of a large GPU's cores (an H100 has 132).
WORKGROUPS = 512

_EXECUTABLE = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %w = arith.constant {workgroups} : index
    %one = arith.constant 1 : index
    stream.return %w, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%at0: index, %qb: !stream.binding, %kb: !stream.binding, %vb: !stream.binding,
                      %mb: !stream.binding, %ob: !stream.binding) attributes {{
        translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.spirv_pipeline<BaseLowering>
                                                          workgroup_size = [{d}, 1, 1]>}} {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %cd = arith.constant {d} : index
      %cc = arith.constant {c} : index
      %crep = arith.constant {rep} : index
      %cheads = arith.constant {heads} : index
      %csplits = arith.constant {splits} : index
      %cper = arith.constant {per} : index
      %ninf = arith.constant 0xFF800000 : f32
      %start = arith.constant {start} : f32
      %zf = arith.constant 0.0 : f32
      %q = stream.binding.subspan %qb[%at0] : !stream.binding -> {qt}
      %k = stream.binding.subspan %kb[%at0] : !stream.binding -> {kt}
      %v = stream.binding.subspan %vb[%at0] : !stream.binding -> {kt}
      %mask = stream.binding.subspan %mb[%at0] : !stream.binding -> {mt}
      %o = stream.binding.subspan %ob[%at0] : !stream.binding -> {ot}
      %wg0 = stream.dispatch.workgroup.id[0] : index
      %wg = arith.divui %wg0, %csplits : index
      %sp = arith.remui %wg0, %csplits : index
      %lo = arith.muli %sp, %cper : index
      %lo_per = arith.addi %lo, %cper : index
      %hi = arith.minui %lo_per, %cc : index
      %i = arith.divui %wg, %cheads : index
      %hr = arith.remui %wg, %cheads : index
      %h = arith.divui %hr, %crep : index
      %r = arith.remui %hr, %crep : index
      %t = gpu.thread_id x
      %qs = memref.alloc() : memref<{d}xf32, #gpu.address_space<workgroup>>
      %ps = memref.alloc() : memref<{d}xf32, #gpu.address_space<workgroup>>
      %qt = memref.load %q[%i, %h, %r, %t] : {qt}
      memref.store %qt, %qs[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>
      gpu.barrier
      %res:3 = scf.for %s0 = %lo to %hi step %cd iter_args(%m = %start, %l = %zf, %acc = %zf) -> (f32, f32, f32) {{
        %s = arith.addi %s0, %t : index
        %seen = arith.cmpi ult, %s, %hi : index
        %score = scf.if %seen -> (f32) {{
          %dot = scf.for %j = %c0 to %cd step %c1 iter_args(%a = %zf) -> (f32) {{
            %qj = memref.load %qs[%j] : memref<{d}xf32, #gpu.address_space<workgroup>>
            %kj = memref.load %k[%h, %s, %j] : {kt}{widen_k}
            %a1 = math.fma %qj, {kf}, %a : f32
            scf.yield %a1 : f32
          }}{cap}
          %mk = memref.load %mask[%i, %s] : {mt}
          %sm = arith.addf {scored}, %mk : f32
          scf.yield %sm : f32
        }} else {{
          scf.yield %ninf : f32
        }}
        memref.store %score, %ps[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>
        gpu.barrier
        %mt = scf.for %u = %c0 to %cd step %c1 iter_args(%a = %m) -> (f32) {{
          %pu = memref.load %ps[%u] : memref<{d}xf32, #gpu.address_space<workgroup>>
          %a1 = arith.maximumf %a, %pu : f32
          scf.yield %a1 : f32
        }}
        gpu.barrier
        %sd = arith.subf %score, %mt : f32
        %p = math.exp %sd : f32
        memref.store %p, %ps[%t] : memref<{d}xf32, #gpu.address_space<workgroup>>
        gpu.barrier
        %left = arith.subi %hi, %s0 : index
        %count = arith.minui %left, %cd : index
        %sums:2 = scf.for %u = %c0 to %count step %c1 iter_args(%a = %zf, %b = %zf) -> (f32, f32) {{
          %pu = memref.load %ps[%u] : memref<{d}xf32, #gpu.address_space<workgroup>>
          %su = arith.addi %s0, %u : index
          %vu = memref.load %v[%h, %su, %t] : {kt}{widen_v}
          %a1 = arith.addf %a, %pu : f32
          %b1 = math.fma %pu, {vf}, %b : f32
          scf.yield %a1, %b1 : f32, f32
        }}
        gpu.barrier
        %dm = arith.subf %m, %mt : f32
        %alpha = math.exp %dm : f32
        %l1 = math.fma %l, %alpha, %sums#0 : f32
        %acc1 = math.fma %acc, %alpha, %sums#1 : f32
        scf.yield %mt, %l1, %acc1 : f32, f32, f32
      }}
{store}
      return
    }}
  }}
}}
"""

# One split's result: its unscaled output at position t, and thread 0 its running maximum and sum after them.
_STORE_PART = """      memref.store %res#2, %o[%i, %h, %r, %sp, %t] : {ot}
      %first = arith.cmpi eq, %t, %c0 : index
      scf.if %first {{
        %cm = arith.constant {d} : index
        %cl = arith.constant {d1} : index
        memref.store %res#0, %o[%i, %h, %r, %sp, %cm] : {ot}
        memref.store %res#1, %o[%i, %h, %r, %sp, %cl] : {ot}
      }}"""

# The call's only split: the output itself.
_STORE_OUT = """      %out = arith.divf %res#2, %res#1 : f32
      memref.store %out, %o[%i, %h, %r, %t] : {ot}"""

# A head's splits joined: one workgroup a query row and head, thread t its position; the largest running maximum
# first, then each split's output and sum rescaled to it.
_JOIN = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %w = arith.constant {workgroups} : index
    %one = arith.constant 1 : index
    stream.return %w, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%at0: index, %pb: !stream.binding, %ob: !stream.binding) attributes {{
        translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.spirv_pipeline<BaseLowering>
                                                          workgroup_size = [{d}, 1, 1]>}} {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %cm = arith.constant {d} : index
      %cl = arith.constant {d1} : index
      %crep = arith.constant {rep} : index
      %cheads = arith.constant {heads} : index
      %csplits = arith.constant {splits} : index
      %start = arith.constant {start} : f32
      %zf = arith.constant 0.0 : f32
      %p = stream.binding.subspan %pb[%at0] : !stream.binding -> {pt}
      %o = stream.binding.subspan %ob[%at0] : !stream.binding -> {qt}
      %wg = stream.dispatch.workgroup.id[0] : index
      %i = arith.divui %wg, %cheads : index
      %hr = arith.remui %wg, %cheads : index
      %h = arith.divui %hr, %crep : index
      %r = arith.remui %hr, %crep : index
      %t = gpu.thread_id x
      %top = scf.for %s = %c0 to %csplits step %c1 iter_args(%a = %start) -> (f32) {{
        %ms = memref.load %p[%i, %h, %r, %s, %cm] : {pt}
        %a1 = arith.maximumf %a, %ms : f32
        scf.yield %a1 : f32
      }}
      %sums:2 = scf.for %s = %c0 to %csplits step %c1 iter_args(%a = %zf, %b = %zf) -> (f32, f32) {{
        %ms = memref.load %p[%i, %h, %r, %s, %cm] : {pt}
        %ls = memref.load %p[%i, %h, %r, %s, %cl] : {pt}
        %os = memref.load %p[%i, %h, %r, %s, %t] : {pt}
        %dm = arith.subf %ms, %top : f32
        %wt = math.exp %dm : f32
        %a1 = math.fma %ls, %wt, %a : f32
        %b1 = math.fma %os, %wt, %b : f32
        scf.yield %a1, %b1 : f32, f32
      }}
      %out = arith.divf %sums#1, %sums#0 : f32
      memref.store %out, %o[%i, %h, %r, %t] : {qt}
      return
    }}
  }}
}}
"""


def splits(n: int, heads: int, c: int, d: int) -> tuple[int, int]:
    """(splits, slots a split) for `n` query rows of `heads` heads over `c` slots in tiles of `d`: one split where
    the rows and heads make WORKGROUPS already, else as many as take the call there, each a whole number of tiles
    and none empty."""
    tiles = -(-c // d)
    want = min(tiles, -(-WORKGROUPS // (n * heads)))
    if want <= 1:
        return 1, tiles * d
    per = -(-tiles // want) * d
    return -(-c // per), per


def _binding(dims: tuple[int, ...], e: str) -> str:
    """A binding's memref type, at an offset in its buffer (see attention_call)."""
    strides = [1]
    for size in reversed(dims[1:]):
        strides.insert(0, strides[0] * size)
    return f"memref<{'x'.join(map(str, dims))}x{e}, strided<[{', '.join(map(str, strides))}], offset: ?>>"


def _widen(value: str, e: str, indent: int) -> tuple[str, str]:
    """The stored %{value} as float32: the line that widens it (none for float32) and the name it then has."""
    if e == "f32":
        return "", f"%{value}"
    return f"\n{' ' * indent}%{value}f = arith.extf %{value} : {e} to f32", f"%{value}f"


def attention_executable(name: str, n: int, kvh: int, rep: int, d: int, size: int, c: int, e: str,
                         softcap: float | None = None) -> str:
    """The `stream.executable`s of attention_call @name: out [n, kvh, rep, d] f32 from q [n, kvh, rep, d] f32
    (scaled), one layer's keys and values [kvh, size, d] of type `e` (f16 or f32) of which the first `c` slots are
    attended, and the additive mask [n, c] f32; `softcap`: Gemma 2's cap on the scores, before the mask. Split over
    the slots (`splits`), @name writes each split's part and @name_join joins them."""
    if e not in ("f16", "f32"):
        raise ValueError(f"attention's kernel reads a float16 or float32 cache, not {e}")
    cap, scored = "", "%dot"
    if softcap is not None:
        scored = "%capped"
        cap = f"""
          %cap = arith.constant {float(softcap)!r} : f32
          %over = arith.divf %dot, %cap : f32
          %th = math.tanh %over : f32
          %capped = arith.mulf %th, %cap : f32"""
    (widen_k, kf), (widen_v, vf) = _widen("kj", e, 12), _widen("vu", e, 10)
    heads = kvh * rep
    count, per = splits(n, heads, c, d)
    qt = _binding((n, kvh, rep, d), "f32")
    ot = qt if count == 1 else _binding((n, kvh, rep, count, d + 2), "f32")
    store = (_STORE_OUT if count == 1 else _STORE_PART).format(ot=ot, d=d, d1=d + 1)
    text = _EXECUTABLE.format(name=name, qt=qt, ot=ot, kt=_binding((kvh, size, d), e), mt=_binding((n, c), "f32"),
                              n=n, kvh=kvh, rep=rep, d=d, size=size, c=c, e=e, heads=heads, splits=count, per=per,
                              workgroups=n * heads * count, start=_START, cap=cap, scored=scored,
                              widen_k=widen_k, kf=kf, widen_v=widen_v, vf=vf, store=store)
    if count == 1:
        return text
    return text + _JOIN.format(name=f"{name}_join", qt=qt, pt=ot, d=d, d1=d + 1, rep=rep, heads=heads,
                               splits=count, workgroups=n * heads, start=_START)


def attention_call(name: str, n: int, kvh: int, rep: int, d: int, size: int, c: int, e: str,
                   q: str, keys: str, values: str, mask: str, out: str) -> str:
    """The `flow.dispatch`es of attention_executable @name (and @name_join where it splits), binding `out`.

    Each binding sits at an offset in a buffer, which iree-compile passes as a push constant where the calls differ
    and folds where they all agree, and the types its SPIR-V lowering then wants differ: `offset: ?` for the former,
    none for an offset folded to zero (`iree-codegen-flatten-memref-subspan`; either way round it failed, "failed to
    legalize unresolved materialization"). So the executable adds an offset of its own, 0 behind an optimisation
    barrier: never a constant it can fold, every binding is at an offset it cannot see, and the types say so."""
    count, _ = splits(n, kvh * rep, c, d)
    qt = f"tensor<{n}x{kvh}x{rep}x{d}xf32>"
    pt = qt if count == 1 else f"tensor<{n}x{kvh}x{rep}x{count}x{d + 2}xf32>"
    first = out if count == 1 else f"%{name}_parts"
    text = (f"%{name}_c0 = arith.constant 0 : index\n  %{name}_at0 = util.optimization_barrier %{name}_c0 : index\n  "
            f"{first} = flow.dispatch @{name}::@{name}(%{name}_at0, {q}, {keys}, {values}, {mask}) : "
            f"(index, {qt}, tensor<{kvh}x{size}x{d}x{e}>, tensor<{kvh}x{size}x{d}x{e}>, "
            f"tensor<{n}x{c}xf32>) -> {pt}")
    if count == 1:
        return text
    return (text + f"\n  {out} = flow.dispatch @{name}_join::@{name}_join(%{name}_at0, {first}) : "
            f"(index, {pt}) -> {qt}")
