"""Eddy's 4-bit weights (engine/build/q4.py) against GGUF's Q4_1, the layout the default model ships in.

The compiled kernel is held to float32 parity with the dequantised weights in test_engine.py; these check the
quantiser itself, with no build."""
from __future__ import annotations

import numpy as np
import torch

from engine.build.q4 import Q4_GROUP, dequantise_q4, quantise_q4, unpack_q4


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, cols], scale, offset [rows, cols/32]) from raw Q4_1 rows: per block of 32, float16 d and m,
    then 16 bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, -1)
    return codes, d, m


def test_a_q4_1_gguf_tensor_comes_back_as_the_same_codes():
    """Requantising a Q4_1 tensor's dequantised weights gives back its very codes, and scales and offsets equal
    to its float16 ones within float32 rounding: a Q4_1 GGUF passes through q4 unchanged."""
    import gguf

    q41 = gguf.GGMLQuantizationType.Q4_1
    w = np.random.RandomState(0).standard_normal((48, 4 * Q4_GROUP)).astype(np.float32)
    raw = gguf.quants.quantize(w, q41)
    codes, d, m = q4_1_blocks(raw)
    ours = quantise_q4(torch.from_numpy(gguf.quants.dequantize(raw, q41).astype(np.float32)))
    assert np.array_equal(unpack_q4(ours["weight"]).numpy(), codes)
    np.testing.assert_allclose(ours["scale"].numpy(), d, rtol=1e-6)
    np.testing.assert_allclose(ours["offset"].numpy(), m, rtol=1e-6)
    # And the weights they make are the GGUF's own (up to float32 rounding of code * scale + offset).
    np.testing.assert_allclose(dequantise_q4(*ours.values()).numpy(), gguf.quants.dequantize(raw, q41),
                               rtol=0, atol=1e-6)


def test_every_weight_lands_within_half_a_step_and_the_extremes_exactly():
    w = torch.from_numpy(np.random.RandomState(1).standard_normal((16, 8 * Q4_GROUP)).astype(np.float32)) * 3
    q = quantise_q4(w)
    assert q["weight"].dtype == torch.int8 and q["weight"].shape == (16, 4 * Q4_GROUP)
    back = dequantise_q4(*q.values())
    step = q["scale"].repeat_interleave(Q4_GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-5).all()
    groups = w.reshape(16, -1, Q4_GROUP)
    codes = unpack_q4(q["weight"]).reshape(16, -1, Q4_GROUP)
    assert torch.equal(codes.gather(-1, groups.argmin(-1, keepdim=True)), torch.zeros_like(codes[..., :1]))
    assert torch.equal(codes.gather(-1, groups.argmax(-1, keepdim=True)), torch.full_like(codes[..., :1], 15))
