"""4-bit weights (`--dtype q4`): groups of Q4_GROUP weights along a row, each an unsigned 4-bit code with a
float32 scale and offset (w = code * scale + offset), the codes of GGUF's Q4_1 (needs torch).

The matrix product is one custom op, written as MLIR: the packed bytes are bitcast to i4 and dequantised inside
the op's dispatch, so a product reads the 4-bit codes (plus two float32 numbers per group) and never a widened
matrix. A torch formulation cannot get there: torch has no 4-bit type, and unpacking nibbles with shifts and masks
makes the dequantisation a separate dispatch that writes the whole float32 matrix on every call.

Layouts. `quantise_q4` gives rows: codes [out, in/2] (two to a byte, low nibble first: IREE's i4 layout), scales
and offsets [out, in/Q4_GROUP]; an embedding, which is looked up by row, stays so. A matrix that is multiplied is
stored tiled (`tile_q4`): rows in tiles of Q4_TILE, interleaved, codes [out/T, in, T/2] and scales [out/T, groups,
T], so that at each input position the codes of T consecutive output rows are T/2 consecutive bytes. Decode's
matrix-vector product then keeps one output row per vector lane and needs no horizontal sum: with the rows layout
IREE reduced every group of 32 to a scalar (30-35 % of the bandwidth floor at 1-3B). Prefill widens the tile back
to rows inside its dequantising dispatch and multiplies as before.

Bytes are stored in int8 tensors: the bytes are what matter, and int8 is the byte type turbine's parameters carry
unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import Q4_GROUP, Q4_TILE


def packable(in_features: int, out_features: int | None = None) -> bool:
    """Whether a matrix can be stored in q4: whole groups along its rows (and, if it is multiplied, so tiled,
    whole tiles of rows: `out_features`)."""
    return in_features % Q4_GROUP == 0 and (out_features is None or out_features % Q4_TILE == 0)


def quantise_q4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"weight": int8 [out, in/2], "scale", "offset": float32 [out, in/Q4_GROUP]} for a float matrix [out, in].

    Each group's minimum maps to code 0 and its maximum to 15, as llama.cpp's Q4_1 quantiser does: a Q4_1 GGUF's
    dequantised weights come back as the same codes, scales within float32 rounding of its own."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return {"weight": pack_q4(codes.reshape(rows, cols)), "scale": scale.contiguous(), "offset": low.contiguous()}


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., n] -> int8 [..., n/2], two to a byte, low nibble first."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., n/2] of packed codes -> uint8 [..., n] codes 0..15 (a byte a code: tile_q4 moves an 8B model's
    largest matrix, whose codes in int64 would add ~2 GB to the build's peak)."""
    low, high = packed & 15, (packed >> 4) & 15
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1).to(torch.uint8)


def tile_q4(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows layout (quantise_q4) -> the tiled one: codes int8 [out/T, in, T/2], scale and offset float32
    [out/T, groups, T], T = Q4_TILE. The same codes and numbers, moved."""
    codes = unpack_q4(rows["weight"])
    out, cols = codes.shape
    tiled = codes.reshape(out // Q4_TILE, Q4_TILE, cols).transpose(1, 2)
    lay = lambda t: t.reshape(out // Q4_TILE, Q4_TILE, -1).transpose(1, 2).contiguous()  # noqa: E731
    return {"weight": pack_q4(tiled), "scale": lay(rows["scale"]), "offset": lay(rows["offset"])}


def untile_q4(tiled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiled layout -> the rows layout (tile_q4's inverse)."""
    codes = unpack_q4(tiled["weight"])  # [out/T, in, T]
    rows = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()  # noqa: E731
    return {"weight": pack_q4(rows(codes)), "scale": rows(tiled["scale"]), "offset": rows(tiled["offset"])}


def dequantise_q4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 rows [..., in] from their packed codes and group scales/offsets [..., in/Q4_GROUP] (rows layout)."""
    codes = unpack_q4(packed).float().reshape(*scale.shape, Q4_GROUP)
    return (codes * scale.unsqueeze(-1) + offset.unsqueeze(-1)).reshape(*packed.shape[:-1], -1)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W.T for a tiled q4 matrix W [out, in]: the fused custom op in an export, plain torch otherwise."""
    lead = x.shape[:-1]
    out = packed.shape[0] * Q4_TILE
    return _op()(x.reshape(-1, x.shape[-1]), packed, scale, offset).reshape(*lead, out)


_cpu_tuned = False


@contextlib.contextmanager
def lowering_for(device: str) -> Iterator[None]:
    """Within it, the op's decode form carries the llvm-cpu lowering that keeps a vector accumulator per lane of
    output rows (IREE's default for this reduction tiles the groups into the vector and sums them horizontally,
    or, with unit reduction tiles, lowers the multiply-add as one scalar per lane). Other devices get IREE's own
    choice: the attribute names llvm-cpu's pipeline."""
    global _cpu_tuned
    before, _cpu_tuned = _cpu_tuned, device == "cpu"
    try:
        yield
    finally:
        _cpu_tuned = before


# Prefill (any number of rows): the tile is widened back to float32 rows in one generic, which IREE fuses with
# the packing of the data-tiled matmul, then a contraction over the groups and their weights.
_MM_Q4 = r"""
module {{
util.func private @{name}(%a: tensor<?x{k}xf32>, %qs: tensor<{nb}x{k}x{half}xi8>, %d: tensor<{nb}x{groups}x{t}xf32>,
                          %m: tensor<{nb}x{groups}x{t}xf32>) -> tensor<?x{n}xf32> {{
  %c0 = arith.constant 0 : index
  %rows = tensor.dim %a, %c0 : tensor<?x{k}xf32>
  %q = flow.tensor.bitcast %qs : tensor<{nb}x{k}x{half}xi8> -> tensor<{nb}x{k}x{t}xi4>
  %q4 = tensor.expand_shape %q [[0], [1, 2], [3]] output_shape [{nb}, {groups}, {g}, {t}] : tensor<{nb}x{k}x{t}xi4> into tensor<{nb}x{groups}x{g}x{t}xi4>
  %a3 = tensor.expand_shape %a [[0], [1, 2]] output_shape [%rows, {groups}, {g}] : tensor<?x{k}xf32> into tensor<?x{groups}x{g}xf32>
  %e = tensor.empty() : tensor<{nb}x{t}x{groups}x{g}xf32>
  %w4 = linalg.generic {{
      indexing_maps = [affine_map<(b, r, c, k) -> (b, c, k, r)>, affine_map<(b, r, c, k) -> (b, c, r)>,
                       affine_map<(b, r, c, k) -> (b, c, r)>, affine_map<(b, r, c, k) -> (b, r, c, k)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%q4, %d, %m : tensor<{nb}x{groups}x{g}x{t}xi4>, tensor<{nb}x{groups}x{t}xf32>, tensor<{nb}x{groups}x{t}xf32>)
      outs(%e : tensor<{nb}x{t}x{groups}x{g}xf32>) {{
  ^bb0(%qv: i4, %dv: f32, %mv: f32, %o: f32):
    %0 = arith.extui %qv : i4 to i32
    %1 = arith.uitofp %0 : i32 to f32
    %2 = arith.mulf %1, %dv : f32
    %3 = arith.addf %2, %mv : f32
    linalg.yield %3 : f32
  }} -> tensor<{nb}x{t}x{groups}x{g}xf32>
  %w = tensor.collapse_shape %w4 [[0, 1], [2], [3]] : tensor<{nb}x{t}x{groups}x{g}xf32> into tensor<{n}x{groups}x{g}xf32>
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty(%rows) : tensor<?x{n}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<?x{n}xf32>) -> tensor<?x{n}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d1, d2, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%a3, %w : tensor<?x{groups}x{g}xf32>, tensor<{n}x{groups}x{g}xf32>) outs(%acc : tensor<?x{n}xf32>) {{
  ^bb0(%x: f32, %y: f32, %o: f32):
    %0 = arith.mulf %x, %y : f32
    %1 = arith.addf %0, %o : f32
    linalg.yield %1 : f32
  }} -> tensor<?x{n}xf32>
  util.return %r : tensor<?x{n}xf32>
}}
}}
"""

# Decode (one row): out[b, r] = sum over groups c and positions k of (code * d + m) * x, vectorised along the
# tile's rows r. The product is math.fma(w, x, 0) and not a mulf: IREE turns a reduction of a mulf into a
# vector.contract, which it lowers here as one scalar multiply-add per lane.
_MV_Q4 = r"""
module {{
util.func private @{name}(%a: tensor<1x{k}xf32>, %qs: tensor<{nb}x{k}x{half}xi8>, %d: tensor<{nb}x{groups}x{t}xf32>,
                          %m: tensor<{nb}x{groups}x{t}xf32>) -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  %a2 = tensor.expand_shape %a1 [[0, 1]] output_shape [{groups}, {g}] : tensor<{k}xf32> into tensor<{groups}x{g}xf32>
  %q = flow.tensor.bitcast %qs : tensor<{nb}x{k}x{half}xi8> -> tensor<{nb}x{k}x{t}xi4>
  %q4 = tensor.expand_shape %q [[0], [1, 2], [3]] output_shape [{nb}, {groups}, {g}, {t}] : tensor<{nb}x{k}x{t}xi4> into tensor<{nb}x{groups}x{g}x{t}xi4>
  %zero = arith.constant 0.000000e+00 : f32
  %oe = tensor.empty() : tensor<{nb}x{t}xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%oe : tensor<{nb}x{t}xf32>) -> tensor<{nb}x{t}xf32>
  %r = linalg.generic {{
      indexing_maps = [affine_map<(b, r, c, k) -> (c, k)>, affine_map<(b, r, c, k) -> (b, c, k, r)>,
                       affine_map<(b, r, c, k) -> (b, c, r)>, affine_map<(b, r, c, k) -> (b, c, r)>,
                       affine_map<(b, r, c, k) -> (b, r)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%a2, %q4, %d, %m : tensor<{groups}x{g}xf32>, tensor<{nb}x{groups}x{g}x{t}xi4>, tensor<{nb}x{groups}x{t}xf32>,
                             tensor<{nb}x{groups}x{t}xf32>)
      outs(%acc : tensor<{nb}x{t}xf32>) {attrs} {{
  ^bb0(%x: f32, %qv: i4, %dv: f32, %mv: f32, %o: f32):
    %0 = arith.uitofp %qv : i4 to f32
    %1 = arith.mulf %0, %dv : f32
    %2 = arith.addf %1, %mv : f32
    %3 = math.fma %2, %x, %zero : f32
    %4 = arith.addf %3, %o : f32
    linalg.yield %4 : f32
  }} -> tensor<{nb}x{t}xf32>
  %r1 = tensor.collapse_shape %r [[0, 1]] : tensor<{nb}x{t}xf32> into tensor<{n}xf32>
  %r2 = tensor.expand_shape %r1 [[0, 1]] output_shape [1, {n}] : tensor<{n}xf32> into tensor<1x{n}xf32>
  util.return %r2 : tensor<1x{n}xf32>
}}
}}
"""


def _cpu_lowering(tiles: int) -> str:
    """The decode product's compilation_info for llvm-cpu: workgroups of a few tiles (at least ~16 workgroups for
    the threads to share once a matrix has the tiles for it), one tile of rows per vector, the groups and their
    positions one at a time, accumulated per lane."""
    per_group = max(1, min(16, tiles // 16))
    return ("attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [{per_group}, {Q4_TILE}, 0, 0], vector_common_parallel = [1, {Q4_TILE}, 0, 0], "
            "vector_reduction = [0, 0, 1, 1]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}")


_registered = None


def _op():
    """The registered custom op (registered on first use: it needs turbine, and once per process)."""
    global _registered
    if _registered is None:
        _registered = _register()
    return _registered


def _register():
    from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library
    from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader, call_function
    from iree.turbine.support.ir_imports import RankedTensorType

    _mlir_isinstance_shim()

    class Template(TemplateLoader):
        def load_template(self, kb: KernelBuilder, name: str, asm: str):
            return self._parse_module_asm(kb, asm)

    template = Template()

    @CustomOp.register(library=def_library("eddy_q4"))
    class mmt_q4(CustomOp):
        signature = "mmt_q4(Tensor a, Tensor qs, Tensor d, Tensor m) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            a, qs, d, m = (ksel.arg_tensor(i) for i in range(4))
            for t in (qs, d, m):
                t.specialize_all_dims()
            # One row (decode's call, whose shapes are static) selects the matrix-vector form.
            if isinstance(a.t.shape[0], int) and a.t.shape[0] == 1:
                a.specialize_all_dims()
            else:
                a.specialize_dims(1)
            ksel.return_new_tensor([a.t.shape[0], qs.t.shape[0] * Q4_TILE], dtype=torch.float32)

        def eager_execute(self, a, qs, d, m):
            return a @ dequantise_q4(*untile_q4({"weight": qs, "scale": d, "offset": m}).values()).T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            rows = RankedTensorType(kb.arg_value(0).type).shape[0]
            nb, k, half = RankedTensorType(kb.arg_value(1).type).shape
            groups = RankedTensorType(kb.arg_value(2).type).shape[1]
            sizes = dict(nb=nb, n=nb * Q4_TILE, k=k, half=half, t=Q4_TILE, groups=groups, g=k // groups)
            if rows == 1:
                tuned = _cpu_tuned
                name = f"eddy_mv_q4_{nb * Q4_TILE}x{k}_g{k // groups}{'_cpu' if tuned else ''}"
                asm = _MV_Q4.format(name=name, attrs=_cpu_lowering(nb) if tuned else "", **sizes)
            else:
                name = f"eddy_mm_q4_{nb * Q4_TILE}x{k}_g{k // groups}"
                asm = _MM_Q4.format(name=name, **sizes)
            fn = template.inline_template_function(kb, name, name, asm=asm)
            kb.yield_results(*call_function(fn, *kb.arg_bindings))

    return mmt_q4


def _mlir_isinstance_shim() -> None:
    """iree-turbine 3.9's custom-op expansion calls `IrType.isinstance(x)`, which the MLIR Python bindings of
    iree-base-compiler 3.13 no longer have (Python's isinstance works on them now): give the classes that static
    method back. Only the export (a build's child process) loads this."""
    import iree.compiler.ir as ir

    for name in dir(ir):
        cls = getattr(ir, name)
        if isinstance(cls, type) and not name.startswith("_") and not hasattr(cls, "isinstance"):
            try:
                cls.isinstance = staticmethod(lambda value, cls=cls: isinstance(value, cls))
            except (AttributeError, TypeError):
                pass  # a class the bindings seal; turbine asks none of those
