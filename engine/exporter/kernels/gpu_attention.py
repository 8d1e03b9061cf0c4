"""Attention as one dispatch a layer on a GPU whose IREE pipeline has no attention op of its own (vulkan: SPIR-V
rejects `iree_linalg_ext.online_attention`), written by hand (no torch; the text is MLIR that the export places in
the model, as dot_products.py's is on x86): a `stream.executable` over memrefs with `gpu` ops, compiled by
iree-compile's SPIR-V lowering as it is.

One workgroup a query row and query head, one thread a position of the head (workgroup size = head_dim). The
attended slots go by in tiles of head_dim slots, softmax online (flash attention's running maximum and sum):
1. thread t scores slot tile + t (q . key, Gemma 2's soft cap, the mask) into workgroup memory;
2. every thread reads the tile's maximum from there (the same value in each: no reduction tree to synchronise);
3. thread t turns its score into a probability, and after a barrier adds the tile's probabilities times the values'
   position t to its output, rescaled by the new maximum.
Keys and values are read where the cache holds them (the layer's [kvh, size, d], as stored: float16 or float32),
only the call's attended slots. q comes scaled (model.Attention.q_scale); the mask is additive, -inf where a slot
is not seen. The running maximum starts finite, so a tile of masked slots adds exp(-inf) = 0, never NaN.
"""
from __future__ import annotations

# The running maximum before any slot: finite (exp of -inf minus it is 0; -inf minus -inf would be NaN).
_START = "-3.0e+38"

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
      %ninf = arith.constant 0xFF800000 : f32
      %start = arith.constant {start} : f32
      %zf = arith.constant 0.0 : f32
      %q = stream.binding.subspan %qb[%at0] : !stream.binding -> {qt}
      %k = stream.binding.subspan %kb[%at0] : !stream.binding -> {kt}
      %v = stream.binding.subspan %vb[%at0] : !stream.binding -> {kt}
      %mask = stream.binding.subspan %mb[%at0] : !stream.binding -> {mt}
      %o = stream.binding.subspan %ob[%at0] : !stream.binding -> {qt}
      %wg = stream.dispatch.workgroup.id[0] : index
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
      %res:3 = scf.for %s0 = %c0 to %cc step %cd iter_args(%m = %start, %l = %zf, %acc = %zf) -> (f32, f32, f32) {{
        %s = arith.addi %s0, %t : index
        %seen = arith.cmpi ult, %s, %cc : index
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
        %left = arith.subi %cc, %s0 : index
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
      %out = arith.divf %res#2, %res#1 : f32
      memref.store %out, %o[%i, %h, %r, %t] : {qt}
      return
    }}
  }}
}}
"""


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
    """The `stream.executable` @name: out [n, kvh, rep, d] f32 from q [n, kvh, rep, d] f32 (scaled), one layer's keys
    and values [kvh, size, d] of type `e` (f16 or f32) of which the first `c` slots are attended, and the additive
    mask [n, c] f32; `softcap`: Gemma 2's cap on the scores, before the mask."""
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
    return _EXECUTABLE.format(name=name, qt=_binding((n, kvh, rep, d), "f32"), kt=_binding((kvh, size, d), e),
                              mt=_binding((n, c), "f32"),
                              n=n, kvh=kvh, rep=rep, d=d, size=size, c=c, e=e, heads=kvh * rep,
                              workgroups=n * kvh * rep, start=_START, cap=cap, scored=scored,
                              widen_k=widen_k, kf=kf, widen_v=widen_v, vf=vf)


def attention_call(name: str, n: int, kvh: int, rep: int, d: int, size: int, c: int, e: str,
                   q: str, keys: str, values: str, mask: str, out: str) -> str:
    """The `flow.dispatch` of attention_executable @name, binding `out`.

    Each binding sits at an offset in a buffer, which iree-compile passes as a push constant where the calls differ
    and folds where they all agree, and the types its SPIR-V lowering then wants differ: `offset: ?` for the former,
    none for an offset folded to zero (`iree-codegen-flatten-memref-subspan`; either way round it failed, "failed to
    legalize unresolved materialization"). So the executable adds an offset of its own, 0 behind an optimisation
    barrier: never a constant it can fold, every binding is at an offset it cannot see, and the types say so."""
    return (f"%{name}_c0 = arith.constant 0 : index\n  %{name}_at0 = util.optimization_barrier %{name}_c0 : index\n  "
            f"{out} = flow.dispatch @{name}::@{name}(%{name}_at0, {q}, {keys}, {values}, {mask}) : "
            f"(index, tensor<{n}x{kvh}x{rep}x{d}xf32>, tensor<{kvh}x{size}x{d}x{e}>, tensor<{kvh}x{size}x{d}x{e}>, "
            f"tensor<{n}x{c}xf32>) -> tensor<{n}x{kvh}x{rep}x{d}xf32>")
