"""Which form of each op an export takes, as one object: the KernelPlan the export lowers its custom ops under.

The ops are traced as calls and given their MLIR when the export is lowered (after the model is traced), so the
plan is handed to that lowering (`lowering(plan)`, engine/exporter/export.py) rather than to each call, and each
op's `generate` reads the plan in force (`active()`): decode's products on a cpu written by hand in the build's
instruction form, or generic with llvm-cpu's lowering, or IREE's own choice on a GPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from ...devices import TABLE
from . import prefill_products


@dataclass(frozen=True)
class KernelPlan:
    """`cpu_tuned`: the generic forms carry the llvm-cpu lowering that keeps a vector accumulator per lane of output
    rows (IREE's default for these reductions tiles the reduction into the vector and sums it horizontally, or,
    with unit reduction tiles, lowers the multiply-add as one scalar per lane); off the cpu IREE chooses, and the
    decode products read bytes (no linalg.index, which SPIR-V cannot hold). `dot_form`: on a cpu, the instructions
    the hand-written products use (devices.dot_form: the build's target CPU's; None: none by hand). `x_steps`:
    the rounded rows a row of x becomes in the hand-written prefill products (prefill_products.x_steps: the model's
    width decides). `q4_rows_fused`: q4's generic product of many rows widens its matrix inside the product's
    dispatch (Device.q4_rows_fused). `matrix_units`: that product multiplies float16 into float32 sums, for the
    device's matrix units (Device.matrix_units)."""

    cpu_tuned: bool = False
    dot_form: str | None = None
    x_steps: int = prefill_products.STEPS
    q4_rows_fused: bool = False
    matrix_units: bool = False

    @classmethod
    def of(cls, device: str, dot_form: str | None = None, x_steps: int = prefill_products.STEPS) -> "KernelPlan":
        row = TABLE[device]
        return cls(cpu_tuned=row.llvm_cpu, dot_form=dot_form, x_steps=x_steps, q4_rows_fused=row.q4_rows_fused,
                   matrix_units=row.matrix_units)


_active = KernelPlan()


def active() -> KernelPlan:
    """The plan the ops being lowered take (a plain one outside `lowering`)."""
    return _active


@contextlib.contextmanager
def lowering(plan: KernelPlan) -> Iterator[None]:
    """Within it, the custom ops lowered take `plan`'s forms."""
    global _active
    before, _active = _active, plan
    try:
        yield
    finally:
        _active = before


def lowering_for(device: str, dot_form: str | None = None, x_steps: int = prefill_products.STEPS):
    """lowering(KernelPlan.of(device, dot_form, x_steps))."""
    return lowering(KernelPlan.of(device, dot_form, x_steps))
