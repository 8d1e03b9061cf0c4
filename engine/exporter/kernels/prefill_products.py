"""Prefill's and scoring's q4 matrix products (many rows of x) written by hand for x86, as decode's are
(engine/exporter/kernels/dot_products.py): integer dot products of the 4-bit codes with x quantised to int8 per group of 32,
llama.cpp's way of multiplying a 4-bit matrix by a batch, but in two steps: x, then x's rounding error.

Why. IREE's own path for a product of many rows widens every weight to float32 (and packs it for its data-tiled
matmul) in a dispatch of its own on every call: 60 of a 30-token turn's 145 ms on the default model went there
(docs/BENCHMARKS.md). Here nothing is widened: each call reads the codes as they are stored and multiplies
integers, so a short turn costs its few rows' arithmetic, not a pass over every weight in float32.

Why two steps. With x in 8 bits alone (llama.cpp's Q8_1 activations) the default model's greedy answer to "What
is the capital of France?" became llama.cpp's own on the same Q4_1 file, "L'Etoile, la Marse...", looping
(tests/test_cli.py); a prompt's every product rounded so moves a 135M model's hidden states that far. Rounding
x's error again and multiplying it too leaves ~2e-5 of the product (float32's own order), and the answer is
"The capital of France is Paris." again. The first token's margin there is thin (0.03 of a logit, 'The' over
'L'): with one step for every product but `down`, 'L' still won by 0.04. The two steps double the integer work,
and that work runs at `vpdpbusd`'s one-a-cycle throughput: gate|up at 30 rows 0.12 -> 0.28 ms, still under the
widening form (1.24 ms). Decode's products keep one step, as before.

Where the two steps are taken (x_steps): in models narrower than ONE_STEP_FROM_WIDTH. From 1B up the products are
most of prefill's time (Llama 3.2 1B's shape, q4: 82 % of a 512-token chunk, 71 % of a 30-token turn, dispatch
profiles), and the second step is half of them; there x is rounded once, as llama.cpp rounds it for every model
(its Q8_K / Q8_1 activations), and as Eddy's decode does for every model. The one model seen to answer worse with
one rounding is the 135M default, whose first token's margin was 0.03 of a logit.

Two dispatches a product:
  * `quantise_rows_executable`: x [rows, k] f32 -> xq [steps x rows, groups, 8] i32 (each group's 32 int8) and
    xs [steps x rows, groups, 2] f32 (dx, dx * sum q): in two steps row 2i is x's row i, rounded as decode rounds it
    (dot_products.quantise_group), row 2i + 1 that rounding's error, rounded the same way; in one, row i is x's;
  * `q4_rows_executable`: out [rows, n] f32 from those and the tiled codes, scales and offsets, each row of x's
    steps rows of xq summed into one accumulator. A workgroup takes up to ROWS_PER_WORKGROUP rows of xq (the rows
    split evenly between the groups) against a few tiles of weights (small enough to stay in L2 while it goes over
    its rows; fewer in a short call: FEW_ROW_GROUPS) and, within that, ROW_BLOCK at a time: each 64-byte load of
    codes, split into its two nibble sets, feeds `vpdpbusd` for every row of the block, so the unpacking is shared
    by ROW_BLOCK rows. A block past the last row repeats the last row and stores nothing. (The pairs were summed in
    a dispatch of their own at first: 0.04 ms more for gate|up at 30 rows.) The codes are prefetched a few groups
    ahead, as decode's are (dot_products.q4_prefetch): a short call's first pass over its tiles reads memory, and
    without it did so between its arithmetic, not under it (default model, 30-token turn at 1000: the products
    21.2-21.6 -> 20.2-20.9 ms; at 2 tokens 4.8 -> 3.3 ms; 512 tokens -4 %).

The row count is dynamic (the function's `%rows`, the dispatch's workload): prefill chunks and scoring take any.
"""
from __future__ import annotations

from ...config import Q4_GROUP
from ...config import Q4_TILE_ROWS as Q4_TILE
from .dot_products import (Q4_GROUP_BYTES, Q4_NUMBER_BINDINGS, index_constants, q4_group_numbers, q4_number_subspans,
                           q4_number_types, q4_prefetch, q4_prefetch_constants, q4_super_units, quantise_group,
                           quantise_vector)

# Rows of xq a block of registers multiplies, each with an int32 accumulator per group: ROW_BLOCK / steps rows of x,
# each with its float32 accumulator. At most 9: dot_products.index_constants names rows %i0..%i8.
ROW_BLOCK = 6
# Rows of xq a row of x becomes: x rounded, then that rounding's error rounded (a model narrower than
# ONE_STEP_FROM_WIDTH); or x rounded once.
STEPS = 2
ONE_STEP_FROM_WIDTH = 2048
# Rows of xq a workgroup takes, in blocks of ROW_BLOCK, against its tiles of weights.
ROWS_PER_WORKGROUP = 6 * ROW_BLOCK
# Bytes of a workgroup's weights (codes, scales, offsets): kept in L2 while it goes over its rows.
WORKGROUP_WEIGHT_BYTES = 96 * 1024
# A short call (at most FEW_ROW_GROUPS groups of rows: a chat turn) takes its tiles in about FEW_ROWS_TILE_GROUPS
# workgroups a group of rows, and every call splits its rows evenly between its groups (in whole blocks). A worker
# that runs out of workgroups waits for the other's last one: in a 30-token turn the workgroups of 5-17 tiles and
# 18 or 12 rows left one of the two workers idle for 13-17 % of each product (its time in the dispatch profile
# against the product's), about 3.6 ms of the turn's 50; a 512-token chunk, with 29 groups of rows, lost 1-2 %.
FEW_ROW_GROUPS = 2
FEW_ROWS_TILE_GROUPS = 32
# Rows a workgroup of the quantising dispatch takes.
QUANTISE_ROWS = 8


def x_steps(hidden_size: int) -> int:
    """How many rounded rows (steps) a row of x becomes in the prefill products of a model `hidden_size` wide."""
    return 1 if hidden_size >= ONE_STEP_FROM_WIDTH else STEPS


def tiles_per_workgroup(tiles: int, k: int) -> int:
    """Tiles of weights per workgroup: as many as fit WORKGROUP_WEIGHT_BYTES, and at least 8 workgroups' worth
    of tiles for the threads to share when the rows are few."""
    tile_bytes = k // Q4_GROUP * (Q4_GROUP_BYTES + 2 * Q4_TILE)  # codes and 8-bit factors (units: a few more)
    return max(1, min(WORKGROUP_WEIGHT_BYTES // tile_bytes, -(-tiles // 8)))


_QUANTISE = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%rows: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index
    %per = arith.constant {per} : index
    %n = arith.ceildivui %rows, %per : index
    stream.return %n, %c1, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xb: !stream.binding, %rows: index, %qb: !stream.binding, %sb: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c32 = arith.constant 32 : index
      %cg = arith.constant {groups} : index
      %per = arith.constant {per} : index
      %zf = arith.constant 0.0 : f32
      %f127 = arith.constant 127.0 : f32
      %r127 = arith.constant 0.007874015748031496 : f32
      %xa = stream.binding.subspan %xb[%c0] : !stream.binding -> memref<?x{k}xf32>{{%rows}}
      %csteps = arith.constant {steps} : index
      %rows2 = arith.muli %rows, %csteps : index
      %xqa = stream.binding.subspan %qb[%c0] : !stream.binding -> memref<?x{groups}x8xi32>{{%rows2}}
      %xsa = stream.binding.subspan %sb[%c0] : !stream.binding -> memref<?x{groups}x2xf32>{{%rows2}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %per : index
      %r1a = arith.addi %r0, %per : index
      %r1 = arith.minui %r1a, %rows : index
      scf.for %row = %r0 to %r1 step %c1 {{
        %x = memref.subview %xa[%row, 0] [1, {k}] [1, 1] : memref<?x{k}xf32> to memref<{k}xf32, strided<[1], offset: ?>>
        %at = arith.muli %row, %csteps : index
        scf.for %c = %c0 to %cg step %c1 {{{group}
          vector.store %q32, %xqa[%at, %c, %c0] : memref<?x{groups}x8xi32>, vector<8xi32>
          memref.store %dx, %xsa[%at, %c, %c0] : memref<?x{groups}x2xf32>
          memref.store %dxs, %xsa[%at, %c, %c1] : memref<?x{groups}x2xf32>{second}
        }}
      }}
      return
    }}
  }}
}}
"""


def quantise_rows_executable(name: str, k: int, steps: int = STEPS) -> str:
    """The `stream.executable` @name quantising x [rows, k] f32 per group of 32 into xq [steps x rows, k/32, 8] i32
    and xs [steps x rows, k/32, 2] f32 (dx, dx * sum q): in one step row i is row i of x rounded to int8; in two
    row 2i is that and row 2i + 1 the error of that rounding rounded to int8 in its turn, so that the product of
    the two (summed) is x's to ~15 bits."""
    groups = k // Q4_GROUP
    group, second = quantise_group(f"memref<{k}xf32, strided<[1], offset: ?>>"), ""
    if steps == 2:
        # The rounding's error, x - q dx, rounded again: its own 8 bits.
        group += """
        %dxv = vector.broadcast %dx : f32 to vector<32xf32>
        %back = arith.mulf %rn, %dxv : vector<32xf32>
        %e = arith.subf %v, %back : vector<32xf32>""" + quantise_vector("e", "2")
        second = """
          %at2 = arith.addi %at, %c1 : index
          vector.store %q322, %xqa[%at2, %c, %c0] : memref<?x{groups}x8xi32>, vector<8xi32>
          memref.store %dx2, %xsa[%at2, %c, %c0] : memref<?x{groups}x2xf32>
          memref.store %dxs2, %xsa[%at2, %c, %c1] : memref<?x{groups}x2xf32>""".format(groups=groups)
    assert steps in (1, 2), steps
    return _QUANTISE.format(name=name, k=k, groups=groups, per=QUANTISE_ROWS, steps=steps, group=group,
                            second=second)


def quantise_rows_call(name: str, k: int, x: str, rows: str, rows2: str, xq: str, xs: str) -> str:
    """The `flow.dispatch` of quantise_rows_executable @name: `xq`, `xs` (`rows2` = steps x `rows` rows: each row
    of x, then in two steps its rounding error) from x (tensor<?x k x f32>, rows `rows`)."""
    groups = k // Q4_GROUP
    return (f"{xq}, {xs} = flow.dispatch @{name}::@{name}[{rows}]({x}, {rows}) : (tensor<?x{k}xf32>{{{rows}}}, index) "
            f"-> (tensor<?x{groups}x8xi32>{{{rows2}}}, tensor<?x{groups}x2xf32>{{{rows2}}})")


_Q4_ROWS = """
stream.executable private @{name} {{
  stream.executable.export public @{name} workgroups(%rows: index) -> (index, index, index) {{
    %c1 = arith.constant 1 : index{tile_groups}
    stream.return %tw, %n, %c1 : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xqb: !stream.binding, %xsb: !stream.binding, %qb: !stream.binding, {number_bindings},
                      %rows: index, {out_bindings}) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c16 = arith.constant 16 : index
      %cg = arith.constant {groups} : index
      %cnb = arith.constant {nb} : index
      %crb = arith.constant {real} : index{tiles_per_workgroup}
      %even = arith.ceildivui %rows, %n : index
      %even_blocks = arith.ceildivui %even, %crb : index
      %crpw = arith.muli %even_blocks, %crb : index
      %zi = arith.constant dense<0> : vector<16xi32>
      %zv = arith.constant dense<0.0> : vector<16xf32>
      %mask = arith.constant dense<15> : vector<64xi8>
      %four = arith.constant dense<4> : vector<64xi8>
      %mask32 = arith.constant dense<15> : vector<32xi8>
      %four32 = arith.constant dense<4> : vector<32xi8>
      %ones16 = arith.constant dense<1> : vector<16xi16>
{offsets}
      %csteps = arith.constant {steps} : index
      %xrows = arith.muli %rows, %csteps : index
      %xq = stream.binding.subspan %xqb[%c0] : !stream.binding -> memref<?x{groups}x8xi32>{{%xrows}}
      %xs = stream.binding.subspan %xsb[%c0] : !stream.binding -> memref<?x{groups}x2xf32>{{%xrows}}
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> memref<{nb}x{groups}x{gb}xi8>
{prefetch_constants}{number_subspans}
{out_subspans}
      %last = arith.subi %rows, %c1 : index
      %wx = stream.dispatch.workgroup.id[0] : index
      %wy = stream.dispatch.workgroup.id[1] : index
      %t0 = arith.muli %wx, %ctpw : index
      %t1a = arith.addi %t0, %ctpw : index
      %t1 = arith.minui %t1a, %cnb : index
      %ra = arith.muli %wy, %crpw : index
      %rza = arith.addi %ra, %crpw : index
      %rz = arith.minui %rza, %rows : index
      scf.for %rb = %ra to %rz step %crb {{{rows_of_block}
        scf.for %b = %t0 to %t1 step %c1 {{
          %pft = arith.muli %b, %cg : index
          %acc:{real} = scf.for %sb = %c0 to %csup step %c1 iter_args({super_iter_args}) -> ({acc_types}) {{{units}
          %accs:{real} = scf.for %c = %cs0 to %cs1 step %c1 iter_args({iter_args}) -> ({acc_types}) {{{prefetch}{group}{numbers}{scale}
            scf.yield {yields} : {acc_types}
          }}
          scf.yield {super_yields} : {acc_types}
          }}
          %col = arith.muli %b, %c16 : index{stores}
        }}
      }}
      return
    }}
  }}
}}
"""


def _rows_of_block(block: int, steps: int) -> str:
    """%out{j}: the block's rows of x, the last row standing in for those past it; %in{j}: whether it is real;
    %row{i}: the rows of xq (`steps` a row of x) the block multiplies."""
    lines = []
    for j in range(block // steps):
        lines.append(f"""
        %rr{j} = arith.addi %rb, %i{j} : index
        %out{j} = arith.minui %rr{j}, %last : index
        %in{j} = arith.cmpi ult, %rr{j}, %rows : index
        %row{steps * j} = arith.muli %out{j}, %csteps : index""")
        lines += [f"""
        %row{steps * j + s} = arith.addi %row{steps * j}, %i{s} : index""" for s in range(1, steps)]
    return "".join(lines)


def _x_word(name: str, i: int, word: int, lanes: int) -> str:
    """Row i's 4 int8 of x at word `word` of group %c, broadcast to `lanes` int32 lanes, viewed as bytes."""
    return f"""
            %{name}s = memref.load %xq[%row{i}, %c, %i{word}] : memref<?x{{groups}}x8xi32>
            %{name}v = vector.broadcast %{name}s : i32 to vector<{lanes}xi32>
            %{name} = vector.bitcast %{name}v : vector<{lanes}xi32> to vector<{4 * lanes}xi8>"""


def _q4_vnni(block: int) -> tuple[str, list[str]]:
    """One group of tile %b for the block's rows: the body, and per row the value of its 16 integer sums."""
    lines = []
    for h in range(4):
        lines.append(f"""
            %w{h} = vector.load %q[%b, %c, %o{h}] : memref<{{nb}}x{{groups}}x{Q4_GROUP_BYTES}xi8>, vector<64xi8>
            %l{h} = arith.andi %w{h}, %mask : vector<64xi8>
            %s{h} = arith.shrui %w{h}, %four : vector<64xi8>
            %u{h} = arith.andi %s{h}, %mask : vector<64xi8>""")
    acc = ["%zi"] * block
    for h in range(4):
        for i in range(block):
            lines.append(_x_word(f"xl{i}_{h}", i, h, 16) + _x_word(f"xh{i}_{h}", i, h + 4, 16) + f"""
            %p{i}_{h} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"({acc[i]}, %l{h}, %xl{i}_{h}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>
            %r{i}_{h} = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%p{i}_{h}, %u{h}, %xh{i}_{h}) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>""")
            acc[i] = f"%r{i}_{h}"
    return "".join(lines), acc


def _q4_avx2(block: int) -> tuple[str, list[str]]:
    """_q4_vnni in AVX2: per row two ymm halves of 8 rows of the tile, `vpmaddubsw` pairs summed in 16 bits (codes
    <= 15 and |q| <= 127 keep a group's sums unsaturated: dot_products), then `vpmaddwd` by ones."""
    lines = []
    for half in range(2):
        for h in range(4):
            v = f"{h}_{half}"
            lines.append(f"""
            %w{v} = vector.load %q[%b, %c, %o{h}h{half}] : memref<{{nb}}x{{groups}}x{Q4_GROUP_BYTES}xi8>, vector<32xi8>
            %l{v} = arith.andi %w{v}, %mask32 : vector<32xi8>
            %s{v} = arith.shrui %w{v}, %four32 : vector<32xi8>
            %u{v} = arith.andi %s{v}, %mask32 : vector<32xi8>""")
    sums = []
    for i in range(block):
        lines += [_x_word(f"xl{i}_{h}", i, h, 8) + _x_word(f"xh{i}_{h}", i, h + 4, 8) for h in range(4)]
        for half in range(2):
            prods = []
            for h in range(4):
                v, p = f"{h}_{half}", f"{i}_{h}_{half}"
                lines.append(f"""
            %pl{p} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"(%l{v}, %xl{i}_{h}) : (vector<32xi8>, vector<32xi8>) -> vector<16xi16>
            %pu{p} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"(%u{v}, %xh{i}_{h}) : (vector<32xi8>, vector<32xi8>) -> vector<16xi16>""")
                prods += [f"%pl{p}", f"%pu{p}"]
            total = prods[0]
            for j, p in enumerate(prods[1:]):
                lines.append(f"\n            %t{i}_{j}_{half} = arith.addi {total}, {p} : vector<16xi16>")
                total = f"%t{i}_{j}_{half}"
            lines.append(f"""
            %e{i}_{half} = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"({total}, %ones16) : (vector<16xi16>, vector<16xi16>) -> vector<8xi32>""")
        lines.append(f"\n            %isum{i} = vector.shuffle %e{i}_0, %e{i}_1 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, "
                     "13, 14, 15] : vector<8xi32>, vector<8xi32>")
        sums.append(f"%isum{i}")
    return "".join(lines), sums


_Q4_FORMS = {"vnni": _q4_vnni, "avx2": _q4_avx2}


def _by_row_groups(out: str, many: int, few: int, indent: str, steps: int) -> str:
    """MLIR lines setting %n to the groups of rows a call of %rows rows takes and `out` to `many`, or to `few` in a
    short call (at most FEW_ROW_GROUPS groups): the dispatch's workgroup count and its workgroups' share agree."""
    lines = [f"%per = arith.constant {ROWS_PER_WORKGROUP // steps} : index", "%n = arith.ceildivui %rows, %per : index",
             f"%few_rows = arith.constant {FEW_ROW_GROUPS} : index", "%few = arith.cmpi ule, %n, %few_rows : index",
             f"{out}_many = arith.constant {many} : index", f"{out}_few = arith.constant {few} : index",
             f"{out} = arith.select %few, {out}_few, {out}_many : index"]
    return "".join(f"\n{indent}{line}" for line in lines)


def _store_in_part(value: str, row: str, parts: tuple[int, ...], first: int = 0) -> str:
    """Stores `value` (16 columns of a row, tile %b's) in the output that holds tile %b, at its own column: the
    parts after `first` (tiles each), the last taking the rest."""
    if len(parts) == 1:
        return f"""
            %pc{first} = arith.subi %col, %cpart{first} : index
            vector.store {value}, %res{first}[{row}, %pc{first}] : memref<?x{parts[0] * Q4_TILE}xf32>, vector<16xf32>"""
    inner = _store_in_part(value, row, parts[1:], first + 1).replace("\n", "\n  ")
    return f"""
            %inpart{first} = arith.cmpi ult, %b, %tpart{first + 1} : index
            scf.if %inpart{first} {{{_store_in_part(value, row, parts[:1], first).replace(chr(10), chr(10) + "  ")}
            }} else {{{inner}
            }}"""


def _part_constants(parts: tuple[int, ...]) -> str:
    """%tpart{i}, %cpart{i}: the first tile and column of output i."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return "".join(f"""
      %tpart{i} = arith.constant {t} : index
      %cpart{i} = arith.constant {t * Q4_TILE} : index""" for i, t in enumerate(starts))


def q4_rows_executable(form: str, name: str, tiles: int, k: int, parts: tuple[int, ...] = (),
                       steps: int = STEPS) -> str:
    """The `stream.executable` @name computing out [rows, tiles x 16] f32 from x quantised
    (quantise_rows_executable's xq, xs: `steps` rows each), the codes [tiles x groups x Q4_GROUP_BYTES] i8 and
    group numbers (dot_products.q4_number_types); with `parts` (tiles each, summing to `tiles`), as that many outputs
    [rows, part x 16] (q, k and v from one product, each stored where its consumers read it whole)."""
    parts = parts or (tiles,)
    assert sum(parts) == tiles, (parts, tiles)
    groups, block = k // Q4_GROUP, ROW_BLOCK
    per_tiles = tiles_per_workgroup(tiles, k)
    few_tiles = max(1, -(-tiles // FEW_ROWS_TILE_GROUPS))
    body, sums = _Q4_FORMS[form](block)
    scale = []
    for i in range(block):
        j = i // steps
        acc = f"%af{j}" if i % steps == 0 else f"%n{i - 1}"
        scale.append(f"""
            %fs{i} = arith.sitofp {sums[i]} : vector<16xi32> to vector<16xf32>
            %dx{i} = memref.load %xs[%row{i}, %c, %c0] : memref<?x{groups}x2xf32>
            %dm{i} = memref.load %xs[%row{i}, %c, %c1] : memref<?x{groups}x2xf32>
            %dxv{i} = vector.broadcast %dx{i} : f32 to vector<16xf32>
            %dmv{i} = vector.broadcast %dm{i} : f32 to vector<16xf32>
            %sc{i} = arith.mulf %dv, %dxv{i} : vector<16xf32>
            %a{i} = math.fma %fs{i}, %sc{i}, {acc} : vector<16xf32>
            %n{i} = math.fma %mv, %dmv{i}, %a{i} : vector<16xf32>""")
    real = block // steps
    stores = "".join(f"""
          scf.if %in{j} {{{_store_in_part(f"%acc#{j}", f"%out{j}", parts)}
          }}""" for j in range(real))
    acc_types = ", ".join(["vector<16xf32>"] * real)
    return _Q4_ROWS.format(
        name=name, groups=groups, nb=tiles, n=tiles * Q4_TILE, gb=Q4_GROUP_BYTES, block=block,
        prefetch_constants=q4_prefetch_constants(tiles, groups), prefetch=q4_prefetch(tiles, groups),
        number_bindings=Q4_NUMBER_BINDINGS, number_subspans=q4_number_subspans(tiles, groups),
        numbers=q4_group_numbers(tiles, groups, "            "),
        real=real, steps=steps,
        tile_groups=_by_row_groups("%tw", -(-tiles // per_tiles), -(-tiles // few_tiles), "    ", steps),
        tiles_per_workgroup=_by_row_groups("%ctpw", per_tiles, few_tiles, "      ", steps),
        offsets=index_constants() + _part_constants(parts), rows_of_block=_rows_of_block(block, steps),
        out_bindings=", ".join(f"%ob{i}: !stream.binding" for i in range(len(parts))),
        out_subspans="\n".join(f"      %res{i} = stream.binding.subspan %ob{i}[%c0] : !stream.binding -> "
                               f"memref<?x{p * Q4_TILE}xf32>{{%rows}}" for i, p in enumerate(parts)),
        super_iter_args=", ".join(f"%as{j} = %zv" for j in range(real)),
        iter_args=", ".join(f"%af{j} = %as{j}" for j in range(real)), acc_types=acc_types,
        super_yields=", ".join(f"%accs#{j}" for j in range(real)), units=q4_super_units(tiles, groups, "          "),
        group=body.format(nb=tiles, groups=groups), scale="".join(scale),
        yields=", ".join(f"%n{steps * j + steps - 1}" for j in range(real)), stores=stores)


def q4_rows_call(name: str, tiles: int, k: int, xq: str, xs: str, rows: str, rows2: str, q: str,
                 numbers: tuple[str, ...], out: str, parts: tuple[int, ...] = ()) -> str:
    """The `flow.dispatch` of q4_rows_executable @name, binding `out` (tensor<?x tiles*16 x f32>, `rows` rows; xq
    and xs have `rows2` = steps x `rows`; `numbers`: the matrix's group numbers, q4.Q4_NUMBERS' order); with
    `parts`, `out` names their results (`%r:3`, one per part)."""
    groups = k // Q4_GROUP
    results = ", ".join(f"tensor<?x{p * Q4_TILE}xf32>{{{rows}}}" for p in parts or (tiles,))
    return (f"{out} = flow.dispatch @{name}::@{name}[{rows}]({xq}, {xs}, {q}, {', '.join(numbers)}, {rows}) : "
            f"(tensor<?x{groups}x8xi32>{{{rows2}}}, tensor<?x{groups}x2xf32>{{{rows2}}}, "
            f"tensor<{tiles}x{groups}x{Q4_GROUP_BYTES}xi8>, {q4_number_types(tiles, groups)}, index) -> ({results})")
