"""GGUF blocks dequantised to float32 in torch, a chunk of rows in a handful of whole-array operations (torch is
imported when one is: the runtime imports this package's modules and never torch).

gguf-py's `dequantize` is numpy over groups of 16 rows, joined by a concatenate: for an 8B's Q6_K tensors (the LM
head, half the down projections and value matrices of a Q4_K_M file) 13k calls and 6.7 s of a build; these
whole-chunk operations took 2.2 s and give the same floats, bit for bit (tests/test_gguf_q4.py). Types not here go
to gguf-py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch

# Q6_K, 210 bytes for 256 weights: ql (128 bytes: low 4 bits), qh (64: high 2 bits), 16 int8 scales (one per 16
# weights), d (float16). Within each half of 128 weights, qh byte l holds the high bits of weights l, l + 32,
# l + 64, l + 96 (2 bits each, from the lowest), and ql byte l the low bits of weights l (low nibble) and l + 64
# (high nibble) for l < 64.
Q6_K_BYTES = 210


def _q6_k(raw: np.ndarray, out: "torch.Tensor") -> None:
    import torch

    b = torch.from_numpy(raw).reshape(-1, Q6_K_BYTES)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], 2).reshape(n, 2, 4, 32)
    # Codes 0..63 less 32 wrap in uint8 to the int8 bytes of -32..31; the product widens them as it reads them.
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).sub_(32).view(torch.int8).reshape(n, 16, 16)
    scale = b[:, 192:208].view(torch.int8).float() * b[:, 208:210].contiguous().view(torch.float16).float()
    torch.mul(q, scale.unsqueeze(-1), out=out.view(n, 16, 16))


DEQUANTISERS: dict[str, Callable[[np.ndarray, "torch.Tensor"], None]] = {"Q6_K": _q6_k}


def dequantise_into(raw: np.ndarray, qtype: str, out: np.ndarray) -> bool:
    """uint8 [rows, row bytes] of one type's blocks dequantised into float32 `out` [rows, weights a row] (which
    must be contiguous); False, and `out` untouched, for a type not here."""
    fn = DEQUANTISERS.get(qtype)
    if fn is None:
        return False
    import torch

    assert out.flags.c_contiguous and out.dtype == np.float32
    fn(raw, torch.from_numpy(out))
    return True
