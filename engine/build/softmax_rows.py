"""Attention's softmax over the attended slots, one dispatch for all rows, written by hand (a `stream.executable`).

Why. The attended slot count is a dynamic dimension, and IREE vectorises no softmax over a dynamic innermost
dimension; `model.softmax_in_blocks` gets vectors back by taking it per block of ATTEND_STEP slots, then over the
blocks, but that is five dispatches a layer (maxima and sums per block, then over the blocks, then the scaling),
each going over the scores again: 6 of a 30-token turn's 46 ms of dispatches at 1000 of context. Here a row of
scores (a few kB) is read into L1 once and gone over three times there: the mask added and the maximum, then the
exponentials and their sum, then the scaling.

probs[row, s] = softmax over s of (scores[row, s] + mask[row % n, s]): rows are [kv heads x rep x n] (the scores'
layout), the mask [n, slots] (one row per query; decode's one query has its mask in the scores already and passes
none). The slot count is a multiple of ATTEND_STEP (engine/config.py).
"""
from __future__ import annotations

from ..config import ATTEND_STEP

# Rows a workgroup takes.
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
