"""RMSNorm in one dispatch, as a custom op (needs torch and turbine at export), for devices where each dispatch is
a kernel launch (Device.launch_bound).

Left to IREE, a norm is two dispatches: the sum of squares, then the scaling. Its dispatch formation fuses a
reduction's elementwise consumer only where the two share an outer parallel loop, and a decode step's norm (one
row, whose unit dimension IREE drops) has none; IREE's aggressive fusion joins them but also broke other dispatches
on lavapipe. So the op hands IREE the two as a region already formed (`flow.dispatch.region`), which dispatch
formation keeps as it is: one kernel on cuda and vulkan, from IREE's own code generation for each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .registry import Kit, registered

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


def rms_norm_one_dispatch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                          half: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2 over the last dimension) + eps) * (weight + offset) for a float32 x of fixed shape, in
    one dispatch (model.RMSNorm's meaning, reduced in one sum). `half`: the result rounded to float16, for a product
    that takes it so (kernels.f16_linear): the rounding in the norm's dispatch, where it would otherwise be one of
    its own."""
    return _ops()["rms_norm"](x, weight, float(eps), float(offset), int(half))


_RMS_NORM = r"""
module {{
util.func private @{name}(%x: tensor<{shape}xf32>, %w: tensor<{d}xf32>) -> tensor<{shape}x{out}> {{
  %r = flow.dispatch.region -> (tensor<{shape}x{out}>) {{
    %zero = arith.constant 0.000000e+00 : f32
    %e0 = tensor.empty() : tensor<{rows_shape}f32>
    %z = linalg.fill ins(%zero : f32) outs(%e0 : tensor<{rows_shape}f32>) -> tensor<{rows_shape}f32>
    %squares = linalg.generic {{
        indexing_maps = [affine_map<({dims}) -> ({dims})>, affine_map<({dims}) -> ({rows})>],
        iterator_types = [{parallel}"reduction"]}}
        ins(%x : tensor<{shape}xf32>) outs(%z : tensor<{rows_shape}f32>) {{
    ^bb0(%a: f32, %acc: f32):
      %sq = arith.mulf %a, %a : f32
      %s = arith.addf %acc, %sq : f32
      linalg.yield %s : f32
    }} -> tensor<{rows_shape}f32>
    %e1 = tensor.empty() : tensor<{shape}x{out}>
    %y = linalg.generic {{
        indexing_maps = [affine_map<({dims}) -> ({dims})>, affine_map<({dims}) -> ({rows})>,
                         affine_map<({dims}) -> ({last})>, affine_map<({dims}) -> ({dims})>],
        iterator_types = [{parallel}"parallel"]}}
        ins(%x, %squares, %w : tensor<{shape}xf32>, tensor<{rows_shape}f32>, tensor<{d}xf32>)
        outs(%e1 : tensor<{shape}x{out}>) {{
    ^bb0(%a: f32, %s: f32, %ww: f32, %o: {out}):
      %n = arith.constant {d}.0 : f32
      %eps = arith.constant {eps:.9e} : f32
      %mean = arith.divf %s, %n : f32
      %me = arith.addf %mean, %eps : f32
      %rs = math.rsqrt %me : f32
      %t = arith.mulf %a, %rs : f32
      {scale}%v = arith.mulf %t, {sc} : f32
      {result}
    }} -> tensor<{shape}x{out}>
    flow.return %y : tensor<{shape}x{out}>
  }}
  util.return %r : tensor<{shape}x{out}>
}}
}}
"""


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    CustomOp, library, emit, shape = kit.CustomOp, kit.library, kit.emit, kit.shape

    @CustomOp.register(library=library)
    class rms_norm(CustomOp):
        signature = "rms_norm(Tensor x, Tensor w, float eps, float offset, int half) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            x, w = ksel.arg_tensor(0), ksel.arg_tensor(1)
            x.specialize_all_dims()  # a launch-bound device's calls have fixed shapes (engine/shapes.py)
            w.specialize_all_dims()
            ksel.attr_float(2)
            ksel.attr_float(3)
            half = ksel.attr_int(4).v
            ksel.return_new_tensor(list(x.t.shape), dtype=torch.float16 if half else torch.float32)

        def eager_execute(self, x, w, eps, offset, half):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + offset if offset else w)
            return y.half() if half else y

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            dims_n = shape(kb, 0)
            eps, offset, half = ksel.arg_descs[2].v, ksel.arg_descs[3].v, ksel.arg_descs[4].v
            rank, d = len(dims_n), dims_n[-1]
            dims = [f"d{i}" for i in range(rank)]
            name = (f"eddy_rms_norm_{'x'.join(map(str, dims_n))}_eps{eps:g}" + (f"_off{offset:g}" if offset else "")
                    + ("_f16" if half else "")).replace(".", "p").replace("-", "m")
            # Gemma's norms scale by (1 + w).
            scale = (f"%off = arith.constant {offset:.9e} : f32\n      %sc = arith.addf %ww, %off : f32\n      "
                     if offset else "")
            emit(kb, name, _RMS_NORM.format(
                name=name, d=d, eps=eps, scale=scale, sc="%sc" if offset else "%ww", out="f16" if half else "f32",
                result=("%h = arith.truncf %v : f32 to f16\n      linalg.yield %h : f16" if half
                        else "linalg.yield %v : f32"),
                shape="x".join(map(str, dims_n)), rows_shape="".join(f"{n}x" for n in dims_n[:-1]),
                dims=", ".join(dims), rows=", ".join(dims[:-1]), last=dims[-1],
                parallel='"parallel", ' * (rank - 1)))

    return {"rms_norm": rms_norm}
