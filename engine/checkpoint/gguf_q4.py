"""A GGUF's 4-bit blocks as Eddy's q4 rows, their codes kept (needs numpy).

Q4_0, Q4_1 and Q4_K all store a weight as a 4-bit code times a scale plus an offset, per group of 32 along a row,
which is exactly q4's numbers (engine/exporter/q4.py: w = code * scale + offset, float16 scale and offset). So a
build reads their codes and numbers as they are rather than dequantising to float32 and quantising again: no
float32 copy of the matrix (a fifth of a 1B build's time went to making and filling them), and the codes are the
file's own, where re-quantising moved them. In the rows layout Q4_0 and Q4_1 come back exactly; Q4_K's scale is
its block's d times a 6-bit factor, rounded to float16 (a relative 2^-11, far under the codes' own step). A matrix
that is multiplied then has its numbers split into 8-bit factors of a unit per super-block (q4.split_numbers), its
codes still the file's.

Every other type (Q6_K, Q8_0, F16, ...) takes the float path (engine/checkpoint/gguf.py).
"""
from __future__ import annotations

import numpy as np

# Block bytes: Q4_0: d, 16 bytes of codes; Q4_1: d, m, 16 bytes; Q4_K: d, dmin, 12 bytes of 6-bit factors, 128
# bytes of codes, for 256 weights.
Q4_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K")
F16_MAX = 65504.0
LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def q4_rows(raw: np.ndarray, qtype: str) -> dict[str, np.ndarray] | None:
    """uint8 [rows, row bytes] of one tensor's blocks -> {"weight": int8 [rows, cols/2] in q4.pair_q4's bytes
    (each group of 32: byte p holds code p and code p + 16), "scale", "offset": float16 [rows, cols/32]}, or None
    for a type whose codes cannot be kept (or numbers float16 cannot hold)."""
    rows = raw.shape[0]
    if qtype == "Q4_K":
        blocks = raw.reshape(rows, -1, 144)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, n, 1]
        dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        from gguf.quants import Q4_K

        n = blocks.shape[1]
        sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(rows * n, 12))
        sc = sc.reshape(rows, n, 8).astype(np.float32)
        m = m.reshape(rows, n, 8).astype(np.float32)
        scale, offset = d * sc, -(dmin * m)
        # Each 32-byte chunk holds 64 weights: group 2c in its low nibbles, group 2c + 1 in its high ones, byte l
        # holding position l of both. Paired, a group's byte p holds its positions p and p + 16. Worked 8 bytes
        # at a time (a block is 18 words, its codes words 2-17): masks keep every shift within its byte.
        words = np.ascontiguousarray(raw).view(np.uint64).reshape(rows, n, 18)[..., 2:].reshape(rows, n, 4, 2, 2)
        first, second = words[..., 0, :], words[..., 1, :]  # positions 0-15 and 16-31
        paired = np.empty((rows, n, 4, 2, 2), dtype=np.uint64)
        np.bitwise_or(first & LOW_NIBBLES, (second & LOW_NIBBLES) << np.uint64(4), out=paired[..., 0, :])
        np.bitwise_or((first >> np.uint64(4)) & LOW_NIBBLES, second & ~LOW_NIBBLES, out=paired[..., 1, :])
        paired = paired.reshape(rows, -1).view(np.uint8)
    elif qtype in ("Q4_0", "Q4_1"):
        size = 18 if qtype == "Q4_0" else 20
        blocks = raw.reshape(rows, -1, size)
        scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        if qtype == "Q4_0":
            offset = -8.0 * scale  # w = d * (code - 8)
        else:
            offset = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        paired = blocks[..., size - 16:].reshape(rows, -1)  # ggml's own pairing
    else:
        return None
    scale, offset = scale.reshape(rows, -1), offset.reshape(rows, -1)
    if not (np.abs(scale).max(initial=0) <= F16_MAX and np.abs(offset).max(initial=0) <= F16_MAX):
        return None
    return {"weight": np.ascontiguousarray(paired).view(np.int8), "scale": scale.astype(np.float16),
            "offset": offset.astype(np.float16)}
