"""4-bit weights (`--dtype q4`): groups of Q4_GROUP weights along a row, each an unsigned 4-bit code with a
float32 scale and offset (w = code * scale + offset), the layout of GGUF's Q4_1 (needs torch).

The matrix product is one custom op, written as MLIR: the packed bytes are bitcast to i4 and the dequantisation is
a pure extension-and-multiply-add generic, the shape IREE clones into the consumer's dispatch, so decode reads
the 4-bit codes (plus two float32 numbers per group) and never a widened matrix. A torch formulation cannot get
there: torch has no 4-bit type, and unpacking nibbles with shifts and masks makes the dequantisation a separate
dispatch that writes the whole float32 matrix on every call.

Codes are packed two to a byte, low nibble first (IREE's i4 layout), stored in an int8 tensor: the bytes are what
matter, and int8 is the byte type turbine's parameters carry unchanged.
"""
from __future__ import annotations

import torch

from ..config import Q4_GROUP


def packable(in_features: int) -> bool:
    """Whether a matrix with rows this long can be stored in q4 (whole groups, whole bytes)."""
    return in_features % Q4_GROUP == 0


def quantise_q4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"weight": int8 [out, in/2], "scale", "offset": float32 [out, in/Q4_GROUP]} for a float matrix [out, in].

    Each group's minimum maps to code 0 and its maximum to 15, as llama.cpp's Q4_1 quantiser does: a Q4_1 GGUF's
    dequantised weights come back as the same codes, scales within float32 rounding of its own."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    codes = codes.reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return {"weight": packed.contiguous(), "scale": scale.contiguous(), "offset": low.contiguous()}


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., n/2] of packed codes -> int64 [..., n] codes 0..15."""
    low, high = packed & 15, (packed >> 4) & 15
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1).long()


def dequantise_q4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 rows [..., in] from their packed codes and group scales/offsets [..., in/Q4_GROUP]."""
    codes = unpack_q4(packed).float().reshape(*scale.shape, Q4_GROUP)
    return (codes * scale.unsqueeze(-1) + offset.unsqueeze(-1)).reshape(*packed.shape[:-1], -1)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ W.T for a q4 matrix W [out, in]: the fused custom op in an export, plain torch otherwise."""
    lead = x.shape[:-1]
    return _op()(x.reshape(-1, x.shape[-1]), packed, scale, offset).reshape(*lead, packed.shape[0])


_MMT_Q4 = r"""
module {{
util.func private @{name}(%a: tensor<?x{k}xf32>, %qs: tensor<{n}x{half}xi8>, %d: tensor<{n}x{groups}xf32>,
                          %m: tensor<{n}x{groups}xf32>) -> tensor<?x{n}xf32> {{
  %c0 = arith.constant 0 : index
  %rows = tensor.dim %a, %c0 : tensor<?x{k}xf32>
  %q = flow.tensor.bitcast %qs : tensor<{n}x{half}xi8> -> tensor<{n}x{k}xi4>
  %q3 = tensor.expand_shape %q [[0], [1, 2]] output_shape [{n}, {groups}, {g}] : tensor<{n}x{k}xi4> into tensor<{n}x{groups}x{g}xi4>
  %a3 = tensor.expand_shape %a [[0], [1, 2]] output_shape [%rows, {groups}, {g}] : tensor<?x{k}xf32> into tensor<?x{groups}x{g}xf32>
  %e = tensor.empty() : tensor<{n}x{groups}x{g}xf32>
  %w = linalg.generic {{
      indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>,
                       affine_map<(d0, d1, d2) -> (d0, d1)>, affine_map<(d0, d1, d2) -> (d0, d1, d2)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%q3, %d, %m : tensor<{n}x{groups}x{g}xi4>, tensor<{n}x{groups}xf32>, tensor<{n}x{groups}xf32>)
      outs(%e : tensor<{n}x{groups}x{g}xf32>) {{
  ^bb0(%qv: i4, %dv: f32, %mv: f32, %o: f32):
    %0 = arith.extui %qv : i4 to i32
    %1 = arith.uitofp %0 : i32 to f32
    %2 = arith.mulf %1, %dv : f32
    %3 = arith.addf %2, %mv : f32
    linalg.yield %3 : f32
  }} -> tensor<{n}x{groups}x{g}xf32>
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
        def load_template(self, kb: KernelBuilder, name: str, **sizes: int):
            return self._parse_module_asm(kb, _MMT_Q4.format(name=name, **sizes))

    template = Template()

    @CustomOp.register(library=def_library("eddy_q4"))
    class mmt_q4(CustomOp):
        signature = "mmt_q4(Tensor a, Tensor qs, Tensor d, Tensor m) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            a, qs, d, m = (ksel.arg_tensor(i) for i in range(4))
            for t in (qs, d, m):
                t.specialize_all_dims()
            a.specialize_dims(1)
            ksel.return_new_tensor([a.t.shape[0], qs.t.shape[0]], dtype=torch.float32)

        def eager_execute(self, a, qs, d, m):
            return a @ dequantise_q4(qs, d, m).T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            n, half = RankedTensorType(kb.arg_value(1).type).shape
            groups = RankedTensorType(kb.arg_value(2).type).shape[1]
            k = 2 * half
            name = f"eddy_mmt_q4_{n}x{k}_g{k // groups}"
            fn = template.inline_template_function(kb, name, name, n=n, k=k, half=half, groups=groups, g=k // groups)
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
