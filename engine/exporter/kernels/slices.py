"""`first_slots` / `first_blocks` as custom ops (needs torch and turbine at export): a layer's keys or values in
the cache's first slots (what a call attends to: model.py), as a plain slice or in blocks of ATTEND_STEP slots."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...config import ATTEND_STEP
from .registry import Kit, registered

if TYPE_CHECKING:
    from iree.turbine.runtime.op_reg import KernelBuilder, KernelSelection


def first_blocks(kv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """first_slots as blocks of ATTEND_STEP slots, [kvh, len(like) / ATTEND_STEP, ATTEND_STEP, d]: decode's keys
    for query_keys, whose loops then have a static innermost extent (a view of the cache as blocks, then sliced:
    reshaping the slice instead made IREE copy it)."""
    return _ops()["blocks"](kv, like)


def first_slots(kv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """kv [kvh, slots, d][:, :len(like)]: the custom op. As a torch slice its strides would involve the slot
    count, whose contiguity checks make torch.export fix that count; in MLIR it is a plain extract_slice, which
    IREE reads in place."""
    return _ops()["slots"](kv, like)


def layer_of(t: torch.Tensor, layer: int) -> torch.Tensor:
    """t[layer] (t: a buffer of every layer's rows, the cache) with the layer as a value IREE does not fold: a constant
    offset went into every dispatch that read the slice, so each layer had executables of its own for them; as a
    value it is an operand of one shared executable."""
    return _ops()["layer"](t, layer)


_LAYER_OF = r"""
module {{
util.func private @{name}(%t: tensor<{l}x{rest}x{e}>) -> tensor<{rest}x{e}> {{
  %c = arith.constant {layer} : index
  %i = util.optimization_barrier %c : index
  %r = tensor.extract_slice %t[%i{zeros}] [1, {sizes}] [1{ones}] : tensor<{l}x{rest}x{e}> to tensor<{rest}x{e}>
  util.return %r : tensor<{rest}x{e}>
}}
}}
"""

_FIRST_BLOCKS = r"""
module {{
util.func private @{name}(%t: tensor<{h}x{s}x{d}x{e}>, %like: tensor<?x{le}>) -> tensor<{h}x?x{step}x{d}x{e}> {{
  %c0 = arith.constant 0 : index
  %step = arith.constant {step} : index
  %len = tensor.dim %like, %c0 : tensor<?x{le}>
  %blocks = arith.divui %len, %step : index
  %tb = tensor.expand_shape %t [[0], [1, 2], [3]] output_shape [{h}, {sb}, {step}, {d}] : tensor<{h}x{s}x{d}x{e}> into tensor<{h}x{sb}x{step}x{d}x{e}>
  %r = tensor.extract_slice %tb[0, 0, 0, 0] [{h}, %blocks, {step}, {d}] [1, 1, 1, 1] : tensor<{h}x{sb}x{step}x{d}x{e}> to tensor<{h}x?x{step}x{d}x{e}>
  util.return %r : tensor<{h}x?x{step}x{d}x{e}>
}}
}}
"""

_FIRST_SLOTS = r"""
module {{
util.func private @{name}(%t: tensor<{h}x{s}x{d}x{e}>, %like: tensor<?x{le}>) -> tensor<{h}x?x{d}x{e}> {{
  %c0 = arith.constant 0 : index
  %len = tensor.dim %like, %c0 : tensor<?x{le}>
  %n = util.assume.int %len<umin = {step}, umax = {s}, udiv = {step}> : index
  %r = tensor.extract_slice %t[0, 0, 0] [{h}, %n, {d}] [1, 1, 1] : tensor<{h}x{s}x{d}x{e}> to tensor<{h}x?x{d}x{e}>
  util.return %r : tensor<{h}x?x{d}x{e}>
}}
}}
"""


def _ops() -> dict:
    return registered(__name__, register)


def register(kit: Kit) -> dict:
    CustomOp, library, emit, shape = kit.CustomOp, kit.library, kit.emit, kit.shape

    def select_slice(ksel: KernelSelection, blocked: bool) -> None:
        kv, like = ksel.arg_tensor(0), ksel.arg_tensor(1)
        kv.specialize_all_dims()
        (h, _, d), n = kv.t.shape, like.t.shape[0]
        ksel.return_new_tensor([h, n // ATTEND_STEP, ATTEND_STEP, d] if blocked else [h, n, d], dtype=kv.t.dtype)

    def generate_slice(kb: KernelBuilder, blocked: bool) -> None:
        (h, s, d), types = shape(kb, 0), [kit.element_type(kb, i) for i in (0, 1)]
        name = f"eddy_first_{'blocks' if blocked else 'slots'}_{h}x{s}x{d}x{types[0]}_{types[1]}"
        emit(kb, name, (_FIRST_BLOCKS if blocked else _FIRST_SLOTS).format(
            name=name, h=h, s=s, sb=s // ATTEND_STEP, d=d, e=types[0], le=types[1], step=ATTEND_STEP))

    @CustomOp.register(library=library)
    class first_slots(CustomOp):
        signature = "first_slots(Tensor kv, Tensor like) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_slice(ksel, False)

        def eager_execute(self, kv, like):
            return kv[:, : like.shape[0]].clone()

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_slice(kb, False)

    @CustomOp.register(library=library)
    class first_blocks(CustomOp):
        signature = "first_blocks(Tensor kv, Tensor like) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            select_slice(ksel, True)

        def eager_execute(self, kv, like):
            return kv[:, : like.shape[0]].unflatten(1, (-1, ATTEND_STEP)).clone()

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            generate_slice(kb, True)

    @CustomOp.register(library=library)
    class layer_of(CustomOp):
        signature = "layer_of(Tensor t, int layer) -> (Tensor)"

        def select(self, ksel: KernelSelection) -> None:
            t = ksel.arg_tensor(0)
            t.specialize_all_dims()
            ksel.attr_int(1)
            ksel.return_new_tensor(list(t.t.shape[1:]), dtype=t.t.dtype)

        def eager_execute(self, t, layer):
            return t[layer].clone()

        def generate(self, ksel: KernelSelection, kb: KernelBuilder) -> None:
            (l, *rest), e = shape(kb, 0), kit.element_type(kb, 0)
            layer, dims = ksel.arg_descs[1].v, "x".join(map(str, rest))
            name = f"eddy_layer_of_{l}x{dims}x{e}_{layer}"
            emit(kb, name, _LAYER_OF.format(name=name, l=l, rest=dims, e=e, layer=layer, zeros=", 0" * len(rest),
                                            sizes=", ".join(map(str, rest)), ones=", 1" * len(rest)))

    return {"slots": first_slots, "blocks": first_blocks, "layer": layer_of}
