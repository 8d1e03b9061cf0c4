"""q4's decode product written by hand for x86: an integer dot product of the 4-bit codes with x quantised to int8
per group, as llama.cpp does it (no torch; the text is MLIR that the export places in the model).

Why by hand. As one `linalg.generic` the product widens every code to float32 and multiplies-adds it there: ~15
instructions per 32 weights, compute-bound at ~14 G weights/s on two cores, under what memory gives
(docs/BENCHMARKS.md, "Why the q4 product as one linalg.generic..."). Integer products over groups need a sum inside
each group and another across groups, which IREE lowers one lane at a time. So the product is a `stream.executable`
whose function is written over memrefs with `vector` ops and x86 intrinsics (`llvm.call_intrinsic`); iree-compile
compiles it like its own dispatches (no C compiler), and turbine copies it from the custom op's template into the
exported module, where `flow.dispatch` calls it.

Layout it reads (engine/build/q4.py, `tile_q4`): tiles of Q4_TILE_ROWS = 16 rows (one zmm of int32, two ymm); per
tile and group of 32 positions, four blocks of 64 bytes; in block h, byte 4r + j holds row r's code for position
4h + j in its low nibble and for 4h + 16 + j in its high nibble. One 64-byte load and two masks give two sets of 16 rows x 4 positions, the shape of
one `vpdpbusd` (u8 x s8, four products summed into each int32 lane); x's four int8 for those positions are one
int32 broadcast. Per group, one conversion and two fused multiply-adds apply the scale times x's scale and the
offset times x's scale times x's group sum: out = sum_g d_g dx_g sum(code q) + m_g dx_g sum(q).

Each workgroup first quantises x (symmetric, per group: dx = max|x| / 127) into its stack: no extra dispatch per
product (fewer, larger workgroups, which quantise x fewer times, were no faster on the default model).

Forms (`_GROUP_BODIES`, chosen by engine/devices.py's Q4_FORMS): "vnni" (AVX-512 VNNI, zmm: 16 rows a register),
"avx2" (AVX2: `vpmaddubsw` + `vpmaddwd` on two ymm halves; codes <= 15 and |q| <= 127 keep the 16-bit sums of a
whole group, 8 x 2 x 15 x 127 = 30480, unsaturated).
"""
from __future__ import annotations

from ..config import Q4_GROUP
from ..config import Q4_TILE_ROWS as TILE

# Bytes of one tile's group: TILE rows x Q4_GROUP codes, half a byte each.
GROUP_BYTES = TILE * Q4_GROUP // 2
# Workgroups a product aims at: enough for two to eight threads to share; more would each quantise x again.
WORKGROUPS = 16


def tiles_per_workgroup(tiles: int) -> int:
    """Tiles of rows each workgroup computes."""
    return max(1, tiles // WORKGROUPS)


def _quantise_x(k: int, groups: int) -> str:
    """Body that quantises %x [k] into %xq [groups x 8] i32 (the group's 32 int8), %xd [groups] (dx) and %xm
    [groups] (dx * sum q)."""
    return f"""
      %xq = memref.alloca() : memref<{groups}x8xi32>
      %xd = memref.alloca() : memref<{groups}xf32>
      %xm = memref.alloca() : memref<{groups}xf32>
      scf.for %c = %c0 to %cg step %c1 {{
        %p = arith.muli %c, %c32 : index
        %v = vector.load %x[%p] : memref<{k}xf32>, vector<32xf32>
        %a = math.absf %v : vector<32xf32>
        %amax = vector.reduction <maxnumf>, %a : vector<32xf32> into f32
        %dx = arith.mulf %amax, %r127 : f32
        %pos = arith.cmpf ogt, %amax, %zf : f32
        %inv0 = arith.divf %f127, %amax : f32
        %inv = arith.select %pos, %inv0, %zf : f32
        %invv = vector.broadcast %inv : f32 to vector<32xf32>
        %s = arith.mulf %v, %invv : vector<32xf32>
        %rn = math.roundeven %s : vector<32xf32>
        %qi = arith.fptosi %rn : vector<32xf32> to vector<32xi32>
        %sum = vector.reduction <add>, %qi : vector<32xi32> into i32
        %q8 = arith.trunci %qi : vector<32xi32> to vector<32xi8>
        %q32 = vector.bitcast %q8 : vector<32xi8> to vector<8xi32>
        vector.store %q32, %xq[%c, %c0] : memref<{groups}x8xi32>, vector<8xi32>
        %sumf = arith.sitofp %sum : i32 to f32
        %dxs = arith.mulf %dx, %sumf : f32
        memref.store %dx, %xd[%c] : memref<{groups}xf32>
        memref.store %dxs, %xm[%c] : memref<{groups}xf32>
      }}"""


def _group_vnni() -> tuple[str, str]:
    """One group of one tile (%b, %c): its body and the value holding the 16 rows' integer sums."""
    lines = []
    acc = "%zi"
    for h in range(4):
        lines.append(f"""
          %w{h} = vector.load %q[%b, %c, %o{h}] : memref<{{nb}}x{{groups}}x{GROUP_BYTES}xi8>, vector<64xi8>
          %l{h} = arith.andi %w{h}, %mask : vector<64xi8>
          %s{h} = arith.shrui %w{h}, %four : vector<64xi8>
          %u{h} = arith.andi %s{h}, %mask : vector<64xi8>
          %xl{h}s = memref.load %xq[%c, %i{h}] : memref<{{groups}}x8xi32>
          %xh{h}s = memref.load %xq[%c, %i{h + 4}] : memref<{{groups}}x8xi32>
          %xl{h}v = vector.broadcast %xl{h}s : i32 to vector<16xi32>
          %xh{h}v = vector.broadcast %xh{h}s : i32 to vector<16xi32>
          %xl{h} = vector.bitcast %xl{h}v : vector<16xi32> to vector<64xi8>
          %xh{h} = vector.bitcast %xh{h}v : vector<16xi32> to vector<64xi8>
          %p{h} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc}, %l{h}, %xl{h}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>
          %r{h} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%p{h}, %u{h}, %xh{h}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>""")
        acc = f"%r{h}"
    return "".join(lines), acc


def _group_avx2() -> tuple[str, str]:
    """One group of one tile in two ymm halves of 8 rows: its body and the value holding the integer sums."""
    lines = [f"""
          %xl{h}s = memref.load %xq[%c, %i{h}] : memref<{{groups}}x8xi32>
          %xh{h}s = memref.load %xq[%c, %i{h + 4}] : memref<{{groups}}x8xi32>
          %xl{h}v = vector.broadcast %xl{h}s : i32 to vector<8xi32>
          %xh{h}v = vector.broadcast %xh{h}s : i32 to vector<8xi32>
          %xl{h} = vector.bitcast %xl{h}v : vector<8xi32> to vector<32xi8>
          %xh{h} = vector.bitcast %xh{h}v : vector<8xi32> to vector<32xi8>""" for h in range(4)]
    for half in range(2):
        prods = []
        for h in range(4):
            at = f"%o{h}h{half}"
            lines.append(f"""
          %w{h}_{half} = vector.load %q[%b, %c, {at}] : memref<{{nb}}x{{groups}}x{GROUP_BYTES}xi8>, vector<32xi8>
          %l{h}_{half} = arith.andi %w{h}_{half}, %mask32 : vector<32xi8>
          %s{h}_{half} = arith.shrui %w{h}_{half}, %four32 : vector<32xi8>
          %u{h}_{half} = arith.andi %s{h}_{half}, %mask32 : vector<32xi8>
          %pl{h}_{half} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"(%l{h}_{half}, %xl{h}) : (vector<32xi8>, vector<32xi8>) -> vector<16xi16>
          %pu{h}_{half} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"(%u{h}_{half}, %xh{h}) : (vector<32xi8>, vector<32xi8>) -> vector<16xi16>""")
            prods += [f"%pl{h}_{half}", f"%pu{h}_{half}"]
        total = prods[0]
        for i, p in enumerate(prods[1:]):
            lines.append(f"\n          %t{i}_{half} = arith.addi {total}, {p} : vector<16xi16>")
            total = f"%t{i}_{half}"
        lines.append(f"""
          %d{half} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({total}, %ones16) : (vector<16xi16>, vector<16xi16>) -> vector<8xi32>""")
    lines.append("\n          %isum = vector.shuffle %d0, %d1 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] : "
                 "vector<8xi32>, vector<8xi32>")
    return "".join(lines), "%isum"


_GROUP_BODIES = {"vnni": _group_vnni, "avx2": _group_avx2}

_EXECUTABLE = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %w = arith.constant {workgroups} : index
    %one = arith.constant 1 : index
    stream.return %w, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xb: !stream.binding, %qb: !stream.binding, %db: !stream.binding, %mb: !stream.binding,
                      %ob: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c32 = arith.constant 32 : index
      %cg = arith.constant {groups} : index
      %cnb = arith.constant {nb} : index
      %ctpw = arith.constant {per_workgroup} : index
      %zf = arith.constant 0.0 : f32
      %f127 = arith.constant 127.0 : f32
      %r127 = arith.constant 0.007874015748031496 : f32
      %zi = arith.constant dense<0> : vector<16xi32>
      %zv = arith.constant dense<0.0> : vector<16xf32>
      %mask = arith.constant dense<15> : vector<64xi8>
      %four = arith.constant dense<4> : vector<64xi8>
      %mask32 = arith.constant dense<15> : vector<32xi8>
      %four32 = arith.constant dense<4> : vector<32xi8>
      %ones16 = arith.constant dense<1> : vector<16xi16>
{offsets}
      %x = stream.binding.subspan %xb[%c0] : !stream.binding -> memref<{k}xf32>
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> memref<{nb}x{groups}x{group_bytes}xi8>
      %d = stream.binding.subspan %db[%c0] : !stream.binding -> memref<{nb}x{groups}x16xf16>
      %m = stream.binding.subspan %mb[%c0] : !stream.binding -> memref<{nb}x{groups}x16xf16>
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> memref<{nb}x16xf32>
{quantise}
      %wg = stream.dispatch.workgroup.id[0] : index
      %t0 = arith.muli %wg, %ctpw : index
      %t1a = arith.addi %t0, %ctpw : index
      %t1 = arith.minui %t1a, %cnb : index
      scf.for %b = %t0 to %t1 step %c1 {{
        %acc = scf.for %c = %c0 to %cg step %c1 iter_args(%af = %zv) -> vector<16xf32> {{{group}
          %fs = arith.sitofp {isum} : vector<16xi32> to vector<16xf32>
          %dh = vector.load %d[%b, %c, %c0] : memref<{nb}x{groups}x16xf16>, vector<16xf16>
          %mh = vector.load %m[%b, %c, %c0] : memref<{nb}x{groups}x16xf16>, vector<16xf16>
          %dv = arith.extf %dh : vector<16xf16> to vector<16xf32>
          %mv = arith.extf %mh : vector<16xf16> to vector<16xf32>
          %dxs = memref.load %xd[%c] : memref<{groups}xf32>
          %dms = memref.load %xm[%c] : memref<{groups}xf32>
          %dxv = vector.broadcast %dxs : f32 to vector<16xf32>
          %dmv = vector.broadcast %dms : f32 to vector<16xf32>
          %sc = arith.mulf %dv, %dxv : vector<16xf32>
          %a1 = math.fma %fs, %sc, %af : vector<16xf32>
          %a2 = math.fma %mv, %dmv, %a1 : vector<16xf32>
          scf.yield %a2 : vector<16xf32>
        }}
        vector.store %acc, %o[%b, %c0] : memref<{nb}x16xf32>, vector<16xf32>
      }}
      return
    }}
  }}
}}
"""


def _offsets() -> str:
    """Index constants: %i0..%i7 (x's int32 words in a group), %o0..%o3 (blocks), %o{h}h{half} (ymm halves)."""
    lines = [f"      %i{i} = arith.constant {i} : index" for i in range(8)]
    lines += [f"      %o{h} = arith.constant {64 * h} : index" for h in range(4)]
    lines += [f"      %o{h}h{half} = arith.constant {64 * h + 32 * half} : index" for h in range(4) for half in range(2)]
    return "\n".join(lines)


def executable(form: str, name: str, tiles: int, k: int) -> str:
    """The `stream.executable` @name (export and function both named so) computing out [tiles x 16] f32 from
    x [k] f32, the codes [tiles x groups x GROUP_BYTES] i8 and scales, offsets [tiles x groups x 16] f16."""
    groups = k // Q4_GROUP
    per_workgroup = tiles_per_workgroup(tiles)
    body, isum = _GROUP_BODIES[form]()
    return _EXECUTABLE.format(
        name=name, workgroups=-(-tiles // per_workgroup), groups=groups, nb=tiles, per_workgroup=per_workgroup, k=k,
        group_bytes=GROUP_BYTES, offsets=_offsets(), quantise=_quantise_x(k, groups),
        group=body.format(nb=tiles, groups=groups), isum=isum)


def call(name: str, tiles: int, k: int, x: str, q: str, d: str, m: str, out: str) -> str:
    """The `flow.dispatch` of @name's executable, binding `out` (tensor<tiles x 16 x f32>)."""
    groups = k // Q4_GROUP
    return (f"{out} = flow.dispatch @{name}::@{name}({x}, {q}, {d}, {m}) : (tensor<{k}xf32>, "
            f"tensor<{tiles}x{groups}x{GROUP_BYTES}xi8>, tensor<{tiles}x{groups}x16xf16>, "
            f"tensor<{tiles}x{groups}x16xf16>) -> tensor<{tiles}x16xf32>")
