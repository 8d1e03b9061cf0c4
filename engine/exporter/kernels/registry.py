"""The custom ops' registration with turbine (needs torch and turbine at export): each op family's module
(q4_products, i8_products, attention, slices) registers its ops through its `register(kit)`, once per process, on
their first use (`registered`); the Kit holds what they share (the library, emitting a template, the shapes of the
arguments, the llvm-cpu lowering of the decode products)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ...config import TILE_ROWS as TILE

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection

_kit: "Kit | None" = None


def kit() -> "Kit":
    """The one Kit of this process (made on first use: it needs turbine), whose library every family's ops join."""
    global _kit
    if _kit is None:
        _kit = Kit()
    return _kit


_families: dict[str, dict] = {}


def registered(family: str, register: Callable[["Kit"], dict]) -> dict:
    """A family's ops by name (`family`: its module's name), registered by `register` on their first use."""
    if family not in _families:
        _families[family] = register(kit())
    return _families[family]


class Kit:
    """What every op family's registration uses."""

    def __init__(self) -> None:
        from iree.turbine.runtime.op_reg import CustomOp, def_library
        from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader, call_function
        from iree.turbine.support.ir_imports import RankedTensorType

        _mlir_isinstance_shim()

        class Template(TemplateLoader):
            def load_template(self, kb: KernelBuilder, name: str, asm: str):
                return self._parse_module_asm(kb, asm)

        self.CustomOp = CustomOp
        self.RankedTensorType = RankedTensorType
        self.library = def_library("eddy_quant")
        self._template = Template()
        self._call_function = call_function

    def select(self, ksel: KernelSelection, arity: int, tile: int, fixed_rows: bool = False) -> None:
        """A product's selection: x [rows, in] then the weights' tensors; the output [rows, tiles x tile].
        `fixed_rows`: a call's rows stay in the op's types where the export fixes them (a GPU build's)."""
        a, *weights = (ksel.arg_tensor(i) for i in range(arity))
        for t in weights:
            t.specialize_all_dims()
        # One row (decode's call, whose shapes are static) selects the matrix-vector form.
        if isinstance(a.t.shape[0], int) and (a.t.shape[0] == 1 or fixed_rows):
            a.specialize_all_dims()
        else:
            a.specialize_dims(1)
        ksel.return_new_tensor([a.t.shape[0], weights[0].t.shape[0] * tile], dtype=torch.float32)

    def emit(self, kb: KernelBuilder, name: str, asm: str) -> None:
        fn = self._template.inline_template_function(kb, name, name, asm=asm)
        # An attribute (an int argument of the op's signature) is no value of the IR: it has no binding.
        kb.yield_results(*self._call_function(fn, *(b for b in kb.arg_bindings if b is not None)))

    def shape(self, kb: KernelBuilder, i: int) -> list:
        return self.RankedTensorType(kb.arg_value(i).type).shape

    def element_type(self, kb: KernelBuilder, i: int) -> str:
        return str(self.RankedTensorType(kb.arg_value(i).type).element_type)


def with_rows(asm: str, rows: int) -> str:
    """A template written for a dynamic count of rows, as text (after format) for `rows` fixed ones (a GPU build's
    calls, engine/shapes.py; < 0: dynamic, left as it is). The op's types keep fixed rows (Kit.select's
    fixed_rows) because a formed dispatch (q4_products._MM_Q4_ONE, i8_products._MM_I8_ONE) needs them: with
    dynamic rows it failed iree-compile for llvm-cpu ("dispatch.tensor.store ... 0 dimension values are attached")."""
    if rows < 0:
        return asm
    return (asm.replace("tensor<?x", f"tensor<{rows}x").replace("tensor.empty(%rows)", "tensor.empty()")
            .replace("[%rows, ", f"[{rows}, ").replace("{%rows}", ""))


# x rounded to float16 inside a formed product (q4_products._MM_Q4_ONE, i8_products._MM_I8_ONE on matrix units).
_ROUND_X = """
  %xe = tensor.empty() : tensor<{dims}xf16>
  %xh = linalg.generic {{
      indexing_maps = [{same}, {same}],
      iterator_types = [{iterators}]}}
      ins({x} : tensor<{dims}xf32>) outs(%xe : tensor<{dims}xf16>) {{
  ^bb0(%xi: f32, %xo: f16):
    %xt = arith.truncf %xi : f32 to f16
    linalg.yield %xt : f16
  }} -> tensor<{dims}xf16>"""


def product_pieces(half: bool, x: str, dims: str) -> dict[str, str]:
    """A formed product's pieces in float16 (`half`: matrix units) or float32, for x `x` of shape `dims` ("17x64x4"):
    `wt` the multiplied type, `round_x` x's rounding (none in float32), `xa` the x it multiplies, `widen` and `xv`,
    `yv`: the product's operands widened to float32 in its body."""
    if not half:
        return dict(wt="f32", round_x="", xa=x, widen="", xv="%x", yv="%y")
    rank = dims.count("x") + 1
    loops = ", ".join(f"d{i}" for i in range(rank))
    same = f"affine_map<({loops}) -> ({loops})>"
    return dict(wt="f16", xa="%xh", xv="%xf", yv="%yf",
                round_x=_ROUND_X.format(dims=dims, same=same, iterators=", ".join(['"parallel"'] * rank), x=x),
                widen="\n    %xf = arith.extf %x : f16 to f32\n    %yf = arith.extf %y : f16 to f32")


def cpu_lowering(tiles: int, reduction_dims: int, tile: int = TILE) -> str:
    """The decode product's compilation_info for llvm-cpu: workgroups of a few tiles (at least ~16 workgroups for
    the threads to share once a matrix has the tiles for it), one tile of rows per vector, the reduction one
    step at a time, accumulated per lane."""
    per_group = max(1, min(16, tiles // 16))
    zeros, ones = ", ".join(["0"] * reduction_dims), ", ".join(["1"] * reduction_dims)
    return ("attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [{per_group}, {tile}, {zeros}], vector_common_parallel = [1, {tile}, {zeros}], "
            f"vector_reduction = [0, 0, {ones}]>, translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}")


# q4 or q8, decode (one row) on an x86 CPU: a call of the hand-written dispatch (dot_products.py).
MV_X86 = r"""
module {{
{executable}
util.func private @{name}(%a: tensor<1x{k}xf32>, {args}) -> tensor<1x{n}xf32> {{
  %a1 = tensor.collapse_shape %a [[0, 1]] : tensor<1x{k}xf32> into tensor<{k}xf32>
  {call}
  %r1 = tensor.collapse_shape %r [[0, 1]] : tensor<{nb}x{t}xf32> into tensor<{n}xf32>
  %r2 = tensor.expand_shape %r1 [[0, 1]] output_shape [1, {n}] : tensor<{n}xf32> into tensor<1x{n}xf32>
  util.return %r2 : tensor<1x{n}xf32>
}}
}}
"""


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
