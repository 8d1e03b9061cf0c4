"""q6's product as a custom op (needs torch and turbine at export): the LM head of a q4 build on an x86 CPU
(engine/exporter/q6.py). One form, decode's one row written by hand (dot_products.q6_executable): a head only ever
multiplies one row there (decode's, and a prefill's last), and a q6 matrix is made only for a plan with a dot form
(linear.matrix_dtype), so no other form is needed. Perplexity's many rows take the matrix widened in torch
(Linear.forward), as q8's generic form widens its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import Q4_GROUP, Q6_GROUP_BYTES, Q6_SUPER
from ...config import Q4_TILE_ROWS as TILE
from . import dot_products
from .plan import active
from .registry import MV_X86, Kit, registered

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


def q6_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """x [1, in] @ W.T for a tiled q6 matrix W [out, in] (its codes, factors and units): the custom op in an export,
    plain torch otherwise."""
    return _ops()["q6"](x, weight, scale, units)


_ARGS = ("%qs: tensor<{nb}x{groups}x{gb}xi8>, %f: tensor<{nb}x{groups}x2x{t}xi8>, "
         "%units: tensor<{nb}x{supers}x{t}xf16>")


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    from ..q6 import dequantise_tiled_q6

    CustomOp, library, select, emit, shape = kit.CustomOp, kit.library, kit.select, kit.emit, kit.shape

    @CustomOp.register(library=library)
    class mv_q6(CustomOp):
        signature = "mv_q6(Tensor a, Tensor qs, Tensor f, Tensor u) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select(ksel, 4, TILE)

        def eager_execute(self, a, qs, f, u):
            return a @ dequantise_tiled_q6(qs, f, u).T

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (rows, k), (nb, groups, gb) = shape(kb, 0), shape(kb, 1)
            form = active().dot_form
            if rows != 1 or form is None:
                raise NotImplementedError(f"q6's product has one form, one row by hand (asked: {rows} rows, "
                                          f"dot form {form})")
            sizes = dict(nb=nb, n=nb * TILE, k=k, gb=gb, groups=groups, supers=k // Q6_SUPER, t=TILE)
            assert gb == Q6_GROUP_BYTES and groups == k // Q4_GROUP
            name, exe = f"eddy_mv_q6_{nb * TILE}x{k}_{form}", f"eddy_q6_{nb * TILE}x{k}_{form}"
            emit(kb, name, MV_X86.format(
                name=name, args=_ARGS.format(**sizes),
                executable=dot_products.q6_executable(form, exe, nb, k),
                call=dot_products.q6_call(exe, nb, k, "%a1", ("%qs", "%f", "%units"), "%r"), **sizes))

    return {"q6": mv_q6}
