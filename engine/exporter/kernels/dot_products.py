"""Decode's quantised matrix-vector products written by hand for x86: integer dot products of the weights (q4's
4-bit codes, q8's int8) with x quantised to int8 per group of 32, as llama.cpp does it (no torch; the text is MLIR
that the export places in the model).

Why by hand. As one `linalg.generic` a product widens every weight to float32 and multiplies-adds it there: q4's
takes ~15 instructions per 32 weights, compute-bound at ~14 G weights/s on two cores, under what memory gives
(docs/BENCHMARKS.md, "Why the q4 product as one linalg.generic..."); q8's read a 1B's LM head at half the
bandwidth. Integer products over groups need a sum inside each group and another across groups, which IREE
lowers one lane at a time. So a product is a `stream.executable` whose function is written over memrefs with
`vector` ops and x86 intrinsics (`llvm.call_intrinsic`); iree-compile compiles it like its own dispatches (no C
compiler), and turbine copies it from the custom op's template into the exported module, where `flow.dispatch`
calls it.

Each workgroup first quantises x (symmetric, per group: dx = max|x| / 127, llama.cpp's Q8_1) into its stack: no
extra dispatch per product (fewer, larger workgroups, which quantise x fewer times, were no faster on the default
model). q4's product of SwiGLU's down matrix can take gate | up instead and make silu(gate) * up as it quantises
(`swiglu`), in fewer workgroups (swiglu_tiles_per_workgroup): the activation's own dispatch goes.

q4 (`q4_executable`). Layout (engine/exporter/q4.py, `tile_q4`): tiles of Q4_TILE_ROWS = 16 rows (one zmm of int32,
two ymm); per group of 32 positions four 64-byte blocks, block h's byte 4r + j holding row r's codes at positions
4h + j (low nibble) and 4h + 16 + j (high nibble). One 64-byte load and two masks give two sets of 16 rows x 4
positions, the shape of one `vpdpbusd` (u8 x s8, four products summed into each int32 lane); x's four int8 for
those positions are one int32 broadcast. Per group, one conversion and two fused multiply-adds apply the scale
times x's scale and the offset times x's scale times x's group sum: out = sum_g d_g dx_g sum(code q) +
m_g dx_g sum(q).

q8 (`q8_executable`). Layout (tiles.py, `tile_q8`): tiles of TILE_ROWS = 32 rows, per 4 positions
128 bytes, byte 4r + j holding row r's weight at position 4p + j: two `vpdpbusd` a load each. The weights are
signed and `vpdpbusd` wants one side unsigned: w xor 0x80 = w + 128 is, and the 128 sum(q) it adds is the same
for every row, so it is taken off once at the end: out = sum_g dx_g sum((w + 128) q) - 128 sum_g dx_g sum(q). The
row's scale is applied by the caller, as for q8's other forms.

Forms (`_Q4_GROUPS`, `_Q8_GROUPS`, chosen by engine/devices.py's DOT_FORMS): "vnni" (AVX-512 VNNI, zmm: 16 rows
a register), "avx2" (AVX2: `vpmaddubsw` + `vpmaddwd` on ymm). In q4's avx2 form codes <= 15 and |q| <= 127 keep
the 16-bit sums of a whole group, 8 x 2 x 15 x 127 = 30480, unsaturated; q8's cannot add 128 (255 x 127 x 2
saturates), so it takes |w| and q with w's sign (`vpsignb`), llama.cpp's trick, whose pair sums stay under
2 x 128 x 127.
"""
from __future__ import annotations

from ...config import Q4_GROUP, super_groups
from ...config import Q4_TILE_ROWS as Q4_TILE
from ...config import TILE_ROWS as Q8_TILE

# Bytes of one q4 tile's group: Q4_TILE rows x Q4_GROUP codes, half a byte each.
Q4_GROUP_BYTES = Q4_TILE * Q4_GROUP // 2
# Bytes of one q8 tile's 4 positions.
Q8_QUAD_BYTES = Q8_TILE * 4
# Workgroups a product aims at: enough for two to eight threads to share; more would each quantise x again.
WORKGROUPS = 16
# How far ahead (in q4 groups of a tile: 256 bytes of codes each) the codes are prefetched: the integer work
# between loads otherwise leaves the memory idle. 590 MB microbenchmark (bench/decode_product.py --rows 229376),
# this Xeon: 29.0 -> 24.8 ms at 8 groups; 2 gave 26.8, 16 25.8; two of the four lines only, ~7 %. q8's product,
# with less work per byte, gained nothing from 2 kB ahead (LM head 128256 x 2048: 11.5 -> 11.8 ms).
Q4_PREFETCH_GROUPS = 8


def tiles_per_workgroup(tiles: int) -> int:
    """Tiles of rows each workgroup computes."""
    return max(1, tiles // WORKGROUPS)


# Tiles a workgroup of the SwiGLU down product takes at least: each workgroup makes the whole of silu(gate) * up
# (an exp and a division a weight of x) before its rows, so it needs rows enough to outweigh that. The default
# model's decode, 36 tiles: 16 workgroups made it 0.936x as fast as a dispatch of its own for the activation, 4
# 1.043x, 2 1.062x and 1.089x (bench/decode_ab.py, 20-32 pairs, Zen 5: docs/BENCHMARKS.md).
SWIGLU_MIN_TILES = 16


def swiglu_tiles_per_workgroup(tiles: int) -> int:
    """Tiles each workgroup of the SwiGLU down product computes: as few workgroups as give each SWIGLU_MIN_TILES,
    a power of two (an even share for two or more threads), at most WORKGROUPS."""
    workgroups = 1
    while workgroups * 2 <= min(WORKGROUPS, tiles // SWIGLU_MIN_TILES):
        workgroups *= 2
    return -(-tiles // workgroups)


def quantise_group(x_type: str, swiglu: int = 0) -> str:
    """Body that quantises group %c of %x (`x_type`, k floats) into %q32 (vector<8xi32>: its 32 int8), %dx (its
    scale, max|x| / 127) and %dxs (dx * sum q), rounding to nearest even: the one definition of x's rounding,
    decode's and prefill's alike (engine/exporter/kernels/prefill_products.py). `maximumf`, not `maxnumf`: |x| holds no NaN
    that the latter's extra compares would skip, and without them the quantising dispatch of 512 rows x 576 took
    0.15 ms instead of 0.20.

    `swiglu` (k): x is SwiGLU's gate and up, [2k], and the group is silu(gate) * up (x / (1 + exp(-x)), as torch's
    silu), made here so that the down product needs no dispatch of its own for it."""
    if not swiglu:
        return f"""
        %p = arith.muli %c, %c32 : index
        %v = vector.load %x[%p] : {x_type}, vector<32xf32>""" + quantise_vector("v", "")
    return f"""
        %p = arith.muli %c, %c32 : index
        %g = vector.load %x[%p] : {x_type}, vector<32xf32>
        %pu = arith.addi %p, %cup : index
        %up = vector.load %x[%pu] : {x_type}, vector<32xf32>
        %ng = arith.negf %g : vector<32xf32>
        %eg = math.exp %ng : vector<32xf32>
        %dg = arith.addf %eg, %ones32 : vector<32xf32>
        %sg = arith.divf %g, %dg : vector<32xf32>
        %v = arith.mulf %sg, %up : vector<32xf32>""" + quantise_vector("v", "")


def quantise_vector(v: str, n: str) -> str:
    """Body that quantises the vector<32xf32> %`v` as quantise_group does, its values named with the suffix `n`:
    %q32`n`, %dx`n`, %dxs`n`, and %rn`n` (the codes as floats, q)."""
    return f"""
        %a{n} = math.absf %{v} : vector<32xf32>
        %amax{n} = vector.reduction <maximumf>, %a{n} : vector<32xf32> into f32
        %dx{n} = arith.mulf %amax{n}, %r127 : f32
        %pos{n} = arith.cmpf ogt, %amax{n}, %zf : f32
        %inv0{n} = arith.divf %f127, %amax{n} : f32
        %inv{n} = arith.select %pos{n}, %inv0{n}, %zf : f32
        %invv{n} = vector.broadcast %inv{n} : f32 to vector<32xf32>
        %s{n} = arith.mulf %{v}, %invv{n} : vector<32xf32>
        %rn{n} = math.roundeven %s{n} : vector<32xf32>
        %qi{n} = arith.fptosi %rn{n} : vector<32xf32> to vector<32xi32>
        %sum{n} = vector.reduction <add>, %qi{n} : vector<32xi32> into i32
        %q8{n} = arith.trunci %qi{n} : vector<32xi32> to vector<32xi8>
        %q32{n} = vector.bitcast %q8{n} : vector<32xi8> to vector<8xi32>
        %sumf{n} = arith.sitofp %sum{n} : i32 to f32
        %dxs{n} = arith.mulf %dx{n}, %sumf{n} : f32"""


def _quantise_x(k: int, groups: int, swiglu: bool = False) -> str:
    """Body that quantises %x [k] into %xq [groups x 8] i32 (the group's 32 int8), %xd [groups] (dx) and %xm
    [groups] (dx * sum q); with `swiglu`, silu(gate) * up of %x [2k] (quantise_group)."""
    constants = f"""
      %cup = arith.constant {k} : index
      %ones32 = arith.constant dense<1.0> : vector<32xf32>""" if swiglu else ""
    return constants + f"""
      %xq = memref.alloca() : memref<{groups}x8xi32>
      %xd = memref.alloca() : memref<{groups}xf32>
      %xm = memref.alloca() : memref<{groups}xf32>
      scf.for %c = %c0 to %cg step %c1 {{{quantise_group(f"memref<{2 * k if swiglu else k}xf32>", k if swiglu else 0)}
        vector.store %q32, %xq[%c, %c0] : memref<{groups}x8xi32>, vector<8xi32>
        memref.store %dx, %xd[%c] : memref<{groups}xf32>
        memref.store %dxs, %xm[%c] : memref<{groups}xf32>
      }}"""


def _x_bytes(name: str, word: int, lanes: int) -> str:
    """x's 4 int8 at word `word` of group %c (from _quantise_x), broadcast to `lanes` int32 lanes and viewed as
    bytes: %name, the signed operand of the dot products."""
    return f"""
          %{name}s = memref.load %xq[%c, %i{word}] : memref<{{groups}}x8xi32>
          %{name}v = vector.broadcast %{name}s : i32 to vector<{lanes}xi32>
          %{name} = vector.bitcast %{name}v : vector<{lanes}xi32> to vector<{4 * lanes}xi8>"""


def _q4_vnni() -> tuple[str, str]:
    """One group of one tile (%b, %c): its body and the value holding the 16 rows' integer sums."""
    lines = []
    acc = "%zi"
    for h in range(4):
        lines.append(f"""
          %w{h} = vector.load %q[%b, %c, %o{h}] : memref<{{nb}}x{{groups}}x{Q4_GROUP_BYTES}xi8>, vector<64xi8>
          %l{h} = arith.andi %w{h}, %mask : vector<64xi8>
          %s{h} = arith.shrui %w{h}, %four : vector<64xi8>
          %u{h} = arith.andi %s{h}, %mask : vector<64xi8>""" + _x_bytes(f"xl{h}", h, 16) + _x_bytes(f"xh{h}", h + 4, 16) + f"""
          %p{h} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc}, %l{h}, %xl{h}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>
          %r{h} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%p{h}, %u{h}, %xh{h}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>""")
        acc = f"%r{h}"
    return "".join(lines), acc


def _q4_avx2() -> tuple[str, str]:
    """One group of one tile in two ymm halves of 8 rows: its body and the value holding the integer sums."""
    lines = [_x_bytes(f"xl{h}", h, 8) + _x_bytes(f"xh{h}", h + 4, 8) for h in range(4)]
    for half in range(2):
        prods = []
        for h in range(4):
            at = f"%o{h}h{half}"
            lines.append(f"""
          %w{h}_{half} = vector.load %q[%b, %c, {at}] : memref<{{nb}}x{{groups}}x{Q4_GROUP_BYTES}xi8>, vector<32xi8>
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


def _q8_vnni() -> tuple[str, str, str]:
    """One group of 32 positions of one q8 tile (%b, %c): its body and the values holding the integer sums of rows
    0-15 and 16-31."""
    lines = ["""
          %c8 = arith.muli %c, %i8 : index"""]
    acc = {"l": "%zi", "h": "%zi"}
    for p in range(8):
        lines.append(f"""
          %p{p} = arith.addi %c8, %i{p} : index""" + _x_bytes(f"x{p}", p, 16))
        for half, at in (("l", "%c0"), ("h", "%c64")):
            lines.append(f"""
          %w{p}{half} = vector.load %w[%b, %p{p}, {at}] : memref<{{nb}}x{{quads}}x{Q8_QUAD_BYTES}xi8>, vector<64xi8>
          %u{p}{half} = arith.xori %w{p}{half}, %x80 : vector<64xi8>
          %s{p}{half} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc[half]}, %u{p}{half}, %x{p}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>""")
            acc[half] = f"%s{p}{half}"
    return "".join(lines), acc["l"], acc["h"]


def _q8_avx2() -> tuple[str, str, str]:
    """_q8_vnni in AVX2: four ymm of 8 rows per 4 positions, |w| times q with w's sign."""
    lines = ["""
          %c8 = arith.muli %c, %i8 : index"""]
    acc = ["%zi8"] * 4
    for p in range(8):
        lines.append(f"""
          %p{p} = arith.addi %c8, %i{p} : index""" + _x_bytes(f"x{p}", p, 8))
        for qr in range(4):
            v = f"{p}_{qr}"
            lines.append(f"""
          %w{v} = vector.load %w[%b, %p{p}, %y{qr}] : memref<{{nb}}x{{quads}}x{Q8_QUAD_BYTES}xi8>, vector<32xi8>
          %a{v} = math.absi %w{v} : vector<32xi8>
          %g{v} = llvm.call_intrinsic "llvm.x86.avx2.psign.b"(%x{p}, %w{v}) : (vector<32xi8>, vector<32xi8>) -> vector<32xi8>
          %m{v} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"(%a{v}, %g{v}) : (vector<32xi8>, vector<32xi8>) -> vector<16xi16>
          %d{v} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"(%m{v}, %ones16) : (vector<16xi16>, vector<16xi16>) -> vector<8xi32>
          %s{v} = arith.addi {acc[qr]}, %d{v} : vector<8xi32>""")
            acc[qr] = f"%s{v}"
    lines.append(f"""
          %il = vector.shuffle {acc[0]}, {acc[1]} [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] : vector<8xi32>, vector<8xi32>
          %ih = vector.shuffle {acc[2]}, {acc[3]} [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] : vector<8xi32>, vector<8xi32>""")
    return "".join(lines), "%il", "%ih"


_Q4_GROUPS = {"vnni": _q4_vnni, "avx2": _q4_avx2}
_Q8_GROUPS = {"vnni": _q8_vnni, "avx2": _q8_avx2}

_EXECUTABLE = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %w = arith.constant {workgroups} : index
    %one = arith.constant 1 : index
    stream.return %w, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xb: !stream.binding, {bindings}, %ob: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c32 = arith.constant 32 : index
      %c64 = arith.constant 64 : index
      %cg = arith.constant {groups} : index
      %cnb = arith.constant {nb} : index
      %ctpw = arith.constant {per_workgroup} : index
      %zf = arith.constant 0.0 : f32
      %f127 = arith.constant 127.0 : f32
      %r127 = arith.constant 0.007874015748031496 : f32
      %zi = arith.constant dense<0> : vector<16xi32>
      %zi8 = arith.constant dense<0> : vector<8xi32>
      %zv = arith.constant dense<0.0> : vector<16xf32>
      %mask = arith.constant dense<15> : vector<64xi8>
      %four = arith.constant dense<4> : vector<64xi8>
      %x80 = arith.constant dense<-128> : vector<64xi8>
      %mask32 = arith.constant dense<15> : vector<32xi8>
      %four32 = arith.constant dense<4> : vector<32xi8>
      %ones16 = arith.constant dense<1> : vector<16xi16>
{offsets}
      %x = stream.binding.subspan %xb[%c0] : !stream.binding -> memref<{xk}xf32>
{subspans}
{quantise}
      %wg = stream.dispatch.workgroup.id[0] : index
      %t0 = arith.muli %wg, %ctpw : index
      %t1a = arith.addi %t0, %ctpw : index
      %t1 = arith.minui %t1a, %cnb : index
      scf.for %b = %t0 to %t1 step %c1 {{{tile}
      }}
      return
    }}
  }}
}}
"""

# Decode sums a super-block's groups before its units: sum_g (u f_g) dx_g isum_g + (b + v e_g) dm_g = u sum_g f_g
# (dx_g isum_g) + v sum_g e_g dm_g + b sum_g dm_g, so a group costs its two factors' conversions and two fused
# multiply-adds, and the units three per super-block (the default model's decode, nearer compute-bound at 135M, was
# ~2 % slower than before the split numbers with the units multiplied in every group, and is not now:
# bench/decode_ab.py, docs/BENCHMARKS.md).
_Q4_TILE = """
        %pft = arith.muli %b, %cg : index
        %acc = scf.for %sb = %c0 to %csup step %c1 iter_args(%as = %zv) -> vector<16xf32> {{{units}
        %accs:3 = scf.for %c = %cs0 to %cs1 step %c1 iter_args(%af = %zv, %bf = %zv, %cf = %zf) -> (vector<16xf32>, vector<16xf32>, f32) {{{prefetch}{group}
          %fs = arith.sitofp {isum} : vector<16xi32> to vector<16xf32>{factors}
          %dxs = memref.load %xd[%c] : memref<{groups}xf32>
          %dms = memref.load %xm[%c] : memref<{groups}xf32>
          %dxv = vector.broadcast %dxs : f32 to vector<16xf32>
          %dmv = vector.broadcast %dms : f32 to vector<16xf32>
          %t = arith.mulf %fs, %dxv : vector<16xf32>
          %a1 = math.fma %t, %dqf, %af : vector<16xf32>
          %b1 = math.fma %mqf, %dmv, %bf : vector<16xf32>
          %c1s = arith.addf %cf, %dms : f32
          scf.yield %a1, %b1, %c1s : vector<16xf32>, vector<16xf32>, f32
        }}
        %csv = vector.broadcast %accs#2 : f32 to vector<16xf32>
        %s1 = math.fma %accs#0, %dhf, %as : vector<16xf32>
        %s2 = math.fma %accs#1, %mhf, %s1 : vector<16xf32>
        %s3 = math.fma %csv, %bhf, %s2 : vector<16xf32>
        scf.yield %s3 : vector<16xf32>
        }}
        vector.store %acc, %o[%b, %c0] : memref<{nb}x16xf32>, vector<16xf32>"""

# The 128 sum(q) that vnni's w + 128 adds is taken off once (%bias: 128 sum_g dx_g sum(q), the same for every
# row).
_Q8_TILE = """
        %acc:2 = scf.for %c = %c0 to %cg step %c1 iter_args(%al = %zv, %ah = %zv) -> (vector<16xf32>, vector<16xf32>) {{{group}
          %fl = arith.sitofp {il} : vector<16xi32> to vector<16xf32>
          %fh = arith.sitofp {ih} : vector<16xi32> to vector<16xf32>
          %dxs = memref.load %xd[%c] : memref<{groups}xf32>
          %dxv = vector.broadcast %dxs : f32 to vector<16xf32>
          %nl = math.fma %fl, %dxv, %al : vector<16xf32>
          %nh = math.fma %fh, %dxv, %ah : vector<16xf32>
          scf.yield %nl, %nh : vector<16xf32>, vector<16xf32>
        }}
        %rl = arith.subf %acc#0, %biasv : vector<16xf32>
        %rh = arith.subf %acc#1, %biasv : vector<16xf32>
        vector.store %rl, %o[%b, %c0] : memref<{nb}x32xf32>, vector<16xf32>
        vector.store %rh, %o[%b, %c16] : memref<{nb}x32xf32>, vector<16xf32>"""

_Q8_BIAS = """
      %c16 = arith.constant 16 : index
      %f128 = arith.constant 128.0 : f32
      %xms = scf.for %c = %c0 to %cg step %c1 iter_args(%s = %zf) -> f32 {{
        %v = memref.load %xm[%c] : memref<{groups}xf32>
        %n = arith.addf %s, %v : f32
        scf.yield %n : f32
      }}
      %bias = arith.mulf %xms, %f128 : f32
      %biasv = vector.broadcast %bias : f32 to vector<16xf32>"""

_Q8_NO_BIAS = """
      %c16 = arith.constant 16 : index
      %biasv = arith.constant dense<0.0> : vector<16xf32>"""


def index_constants() -> str:
    """Index constants (decode's and prefill's products): %i0..%i8; q4's %o0..%o3 (blocks) and %o{h}h{half} (their ymm halves); q8's %y0..%y3 (ymm
    quarters of 4 positions)."""
    lines = [f"      %i{i} = arith.constant {i} : index" for i in range(9)]
    lines += [f"      %o{h} = arith.constant {64 * h} : index" for h in range(4)]
    lines += [f"      %y{q} = arith.constant {32 * q} : index" for q in range(4)]
    lines += [f"      %o{h}h{half} = arith.constant {64 * h + 32 * half} : index" for h in range(4) for half in range(2)]
    return "\n".join(lines)


# The bindings of a q4 product's group numbers (engine/exporter/q4.py, split_numbers): the scale and offset factors,
# and their super-blocks' units.
Q4_NUMBER_BINDINGS = "%db: !stream.binding, %mb: !stream.binding, %ub: !stream.binding"


def q4_number_types(tiles: int, groups: int) -> str:
    """The tensor types of a q4 product's group numbers, in Q4_NUMBER_BINDINGS' order."""
    factors, units = f"tensor<{tiles}x{groups}x16xi8>", f"tensor<{tiles}x{groups // super_groups(groups)}x3x16xf16>"
    return f"{factors}, {factors}, {units}"


def q4_number_subspans(tiles: int, groups: int) -> str:
    """The group numbers' memrefs: %d, %m (factors), %u (units); %cper (groups a super-block), %csup (super-blocks
    a row)."""
    per = super_groups(groups)
    return f"""
      %cper = arith.constant {per} : index
      %csup = arith.constant {groups // per} : index
      %cbase = arith.constant 2 : index
      %d = stream.binding.subspan %db[%c0] : !stream.binding -> memref<{tiles}x{groups}x16xi8>
      %m = stream.binding.subspan %mb[%c0] : !stream.binding -> memref<{tiles}x{groups}x16xi8>
      %u = stream.binding.subspan %ub[%c0] : !stream.binding -> memref<{tiles}x{groups // per}x3x16xf16>"""


def q4_super_units(tiles: int, groups: int, indent: str) -> str:
    """Super-block %sb of tile %b: its units as float32 (%dhf scale's, %mhf offset's, %bhf offset's base) and its
    groups %cs0 to %cs1. The products go over a row's groups a super-block at a time so that the units are loaded
    and widened once a block, not once a group."""
    units = f"memref<{tiles}x{groups // super_groups(groups)}x3x16xf16>"
    lines = [f"%dh = vector.load %u[%b, %sb, %c0, %c0] : {units}, vector<16xf16>",
             f"%mh = vector.load %u[%b, %sb, %c1, %c0] : {units}, vector<16xf16>",
             f"%bh = vector.load %u[%b, %sb, %cbase, %c0] : {units}, vector<16xf16>",
             "%dhf = arith.extf %dh : vector<16xf16> to vector<16xf32>",
             "%mhf = arith.extf %mh : vector<16xf16> to vector<16xf32>",
             "%bhf = arith.extf %bh : vector<16xf16> to vector<16xf32>",
             "%cs0 = arith.muli %sb, %cper : index",
             "%cs1 = arith.addi %cs0, %cper : index"]
    return "".join(f"\n{indent}{line}" for line in lines)


def q4_group_factors(tiles: int, groups: int, indent: str) -> str:
    """Group %c of tile %b's 16 scale and offset factors as float32: %dqf, %mqf."""
    factors = f"memref<{tiles}x{groups}x16xi8>"
    lines = [f"%dq = vector.load %d[%b, %c, %c0] : {factors}, vector<16xi8>",
             f"%mq = vector.load %m[%b, %c, %c0] : {factors}, vector<16xi8>",
             "%dqf = arith.uitofp %dq : vector<16xi8> to vector<16xf32>",
             "%mqf = arith.uitofp %mq : vector<16xi8> to vector<16xf32>"]
    return "".join(f"\n{indent}{line}" for line in lines)


def q4_group_numbers(tiles: int, groups: int, indent: str) -> str:
    """Group %c of tile %b's 16 scales %dv and offsets %mv (vector<16xf32>) from its factors and its super-block's
    units (q4_super_units), in float32 as q4.join_numbers computes them (a multiply; a fused multiply-add)."""
    return q4_group_factors(tiles, groups, indent) + "".join(
        f"\n{indent}{line}" for line in ("%dv = arith.mulf %dqf, %dhf : vector<16xf32>",
                                         "%mv = math.fma %mqf, %mhf, %bhf : vector<16xf32>"))


def q4_prefetch_constants(tiles: int, groups: int) -> str:
    """What q4_prefetch needs: the codes (binding %qb) as one flat array %qf, and its constants."""
    return f"""
      %qf = stream.binding.subspan %qb[%c0] : !stream.binding -> memref<{tiles * groups * Q4_GROUP_BYTES}xi8>
      %cpfd = arith.constant {Q4_PREFETCH_GROUPS} : index
      %clast = arith.constant {tiles * groups - 1} : index
      %cgb = arith.constant {Q4_GROUP_BYTES} : index"""


def q4_prefetch(tiles: int, groups: int) -> str:
    """The codes of the group Q4_PREFETCH_GROUPS after group %c of tile %b prefetched (one per 64-byte line), in a
    loop over a tile's groups (decode's and prefill's q4 products); %pft = %b x groups, index_constants' %o1-%o3."""
    flat = tiles * groups * Q4_GROUP_BYTES
    lines = ["%pfg = arith.addi %pft, %c : index", "%pfa = arith.addi %pfg, %cpfd : index",
             "%pfm = arith.minui %pfa, %clast : index", "%pf0 = arith.muli %pfm, %cgb : index"]
    lines += [f"%pf{i} = arith.addi %pf0, %o{i} : index" for i in range(1, 4)]
    lines += [f"memref.prefetch %qf[%pf{i}], read, locality<3>, data : memref<{flat}xi8>" for i in range(4)]
    return "".join(f"\n          {line}" for line in lines)


def _executable(name: str, tiles: int, k: int, bindings: str, subspans: str, tile: str, swiglu: bool = False) -> str:
    groups = k // Q4_GROUP
    per_workgroup = tiles_per_workgroup(tiles) if not swiglu else swiglu_tiles_per_workgroup(tiles)
    return _EXECUTABLE.format(
        name=name, workgroups=-(-tiles // per_workgroup), groups=groups, nb=tiles, per_workgroup=per_workgroup, k=k,
        xk=2 * k if swiglu else k, bindings=bindings, offsets=index_constants(), subspans=subspans,
        quantise=_quantise_x(k, groups, swiglu), tile=tile)


def q4_executable(form: str, name: str, tiles: int, k: int, swiglu: bool = False) -> str:
    """The `stream.executable` @name (export and function both named so) computing out [tiles x 16] f32 from
    x [k] f32, the codes [tiles x groups x Q4_GROUP_BYTES] i8 and the group numbers (q4_number_types); with
    `swiglu`, from silu(gate) * up of x [2k] = gate | up (the FFN's down product)."""
    groups = k // Q4_GROUP
    body, isum = _Q4_GROUPS[form]()
    subspans = f"""
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> memref<{tiles}x{groups}x{Q4_GROUP_BYTES}xi8>
{q4_prefetch_constants(tiles, groups)}{q4_number_subspans(tiles, groups)}
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> memref<{tiles}x16xf32>"""
    tile = _Q4_TILE.format(nb=tiles, groups=groups, group=body.format(nb=tiles, groups=groups), isum=isum,
                           prefetch=q4_prefetch(tiles, groups), units=q4_super_units(tiles, groups, "        "),
                           factors=q4_group_factors(tiles, groups, "          "))
    return _executable(name, tiles, k, f"%qb: !stream.binding, {Q4_NUMBER_BINDINGS}", subspans, tile, swiglu)


def q4_call(name: str, tiles: int, k: int, x: str, q: str, numbers: tuple[str, ...], out: str,
            swiglu: bool = False) -> str:
    """The `flow.dispatch` of q4_executable @name, binding `out` (tensor<tiles x 16 x f32>); `numbers`: the
    values of the matrix's group numbers (q4.Q4_NUMBERS' order); `swiglu`: x is gate | up, [2k]."""
    groups = k // Q4_GROUP
    xk = 2 * k if swiglu else k
    return (f"{out} = flow.dispatch @{name}::@{name}({x}, {q}, {', '.join(numbers)}) : (tensor<{xk}xf32>, "
            f"tensor<{tiles}x{groups}x{Q4_GROUP_BYTES}xi8>, {q4_number_types(tiles, groups)}) "
            f"-> tensor<{tiles}x16xf32>")


def q8_executable(form: str, name: str, tiles: int, k: int) -> str:
    """The `stream.executable` @name computing out [tiles x 32] f32 (before the rows' scales) from x [k] f32 and
    the weights [tiles x k/4 x Q8_QUAD_BYTES] i8. k is a multiple of 32 (x's groups)."""
    groups, quads = k // Q4_GROUP, k // 4
    subspans = f"""
      %w = stream.binding.subspan %wb[%c0] : !stream.binding -> memref<{tiles}x{quads}x{Q8_QUAD_BYTES}xi8>
      %o = stream.binding.subspan %ob[%c0] : !stream.binding -> memref<{tiles}x32xf32>"""
    # Only the vnni form adds 128 to the weights (avx2 multiplies |w| by q with w's sign).
    quantise_and_bias = _Q8_BIAS.format(groups=groups) if form == "vnni" else _Q8_NO_BIAS
    body, il, ih = _Q8_GROUPS[form]()
    tile = _Q8_TILE.format(nb=tiles, groups=groups, group=body.format(nb=tiles, groups=groups, quads=quads),
                           il=il, ih=ih)
    text = _executable(name, tiles, k, "%wb: !stream.binding", subspans, tile)
    # x's groups are quantised before the bias is summed from them.
    return text.replace("      %wg = stream.dispatch.workgroup.id[0]", quantise_and_bias + "\n      %wg = stream.dispatch.workgroup.id[0]")


def q8_call(name: str, tiles: int, k: int, x: str, w: str, out: str) -> str:
    """The `flow.dispatch` of q8_executable @name, binding `out` (tensor<tiles x 32 x f32>)."""
    return (f"{out} = flow.dispatch @{name}::@{name}({x}, {w}) : (tensor<{k}xf32>, "
            f"tensor<{tiles}x{k // 4}x{Q8_QUAD_BYTES}xi8>) -> tensor<{tiles}x32xf32>")
