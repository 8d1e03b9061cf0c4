"""A GGUF's Q6_K blocks as Eddy's q6 rows (engine/exporter/q6.py), their codes, factors and units kept (needs
numpy): Q6_K is q6's own format, so nothing is rounded again."""
from __future__ import annotations

import numpy as np

# Q6_K's block of 256 weights: ql (low 4 bits) 128 bytes, qh (top 2 bits) 64, factors 16, unit 2.
Q6_K_BLOCK = 210


def q6_rows(raw: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [rows, row bytes] of a Q6_K tensor's blocks -> the rows' codes, factors and units (quantise_q6's
    layout) as the file holds them (ggml's dequantize_row_q6_K: in each half of 128 positions, ql byte l holds
    positions l (low nibble) and l + 64 (high), byte l + 32 positions l + 32 and l + 96; qh byte l the top bits of
    l, l + 32, l + 64 and l + 96, two bits each from bit 0)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q6_K_BLOCK)
    n = blocks.shape[1]
    ql = blocks[..., :128].reshape(rows, n, 2, 2, 32)  # [half, byte l or l + 32, l]
    qh = blocks[..., 128:192].reshape(rows, n, 2, 1, 32)
    codes = np.empty((rows, n, 2, 4, 32), dtype=np.uint8)  # [half, quarter of 32 positions, l]
    for quarter in range(4):
        low = ql[:, :, :, quarter % 2] if quarter < 2 else ql[:, :, :, quarter % 2] >> 4
        codes[:, :, :, quarter] = (low & 15) | (((qh[:, :, :, 0] >> (2 * quarter)) & 3) << 4)
    factors = blocks[..., 192:208].view(np.int8).reshape(rows, n * 16)
    units = blocks[..., 208:210].copy().view(np.float16).reshape(rows, n)
    return {"weight": codes.reshape(rows, n * 256), "scale": np.ascontiguousarray(factors), "units": units}
