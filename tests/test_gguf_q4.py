"""A GGUF's 4-bit blocks taken as q4 rows with their codes kept (engine/checkpoint/gguf_q4.py), held to the
gguf package's own dequantisation of the same bytes: Q4_0 and Q4_1 exactly, Q4_K within float16's rounding of
its scales. A whole build through them, q/k rows permuted back included, is tests/test_real_shapes.py's q4 case
(a Q4_1 file at each family's real shape)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.checkpoint.gguf_q4 import q4_rows
from engine.exporter.q4 import dequantise_q4, pack_q4, pair_q4, quantise_q4, tile_paired, tile_q4, unpack_q4, unpair_q4


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of valid blocks: random codes and factors, small positive float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, size=(rows, cols // block, 2)).astype(np.float16)
    raw[..., :4] = scales.view(np.uint8).reshape(rows, cols // block, 4)
    if qtype == "Q4_0":
        raw[..., :2] = scales[..., :1].view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_kept_codes_give_the_weights_the_file_holds(qtype: str) -> None:
    rows, cols = 48, 512
    raw = random_blocks(qtype, rows, cols)
    want = dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    got = q4_rows(raw, qtype)
    assert got is not None and got["weight"].shape == (rows, cols // 2) and got["scale"].shape == (rows, cols // 32)
    packed = pack_q4(unpair_q4(torch.from_numpy(got["weight"])))
    w = dequantise_q4(packed, torch.from_numpy(got["scale"]), torch.from_numpy(got["offset"])).numpy()
    if qtype == "Q4_K":
        # The block's d times a 6-bit factor, rounded to float16: a relative 2^-11 of each group's scale and
        # offset, far under one code's step.
        step = np.abs(dequantize(raw, GGMLQuantizationType[qtype])).max() / 15
        assert np.abs(w - want).max() < 0.02 * step
        assert np.abs(w - want).max() > 0  # the rounding is real: this is not the float path
    else:
        np.testing.assert_array_equal(w, want)


def test_other_types_and_unheld_numbers_take_the_float_path() -> None:
    assert q4_rows(random_blocks("Q4_1", 4, 64), "Q6_K") is None
    raw = random_blocks("Q4_0", 4, 64).reshape(4, 2, 18)
    raw[..., 0:2] = np.array([np.float16(65000)]).view(np.uint8)  # -8 d overflows float16
    assert q4_rows(raw.reshape(4, -1), "Q4_0") is None


def test_tiling_paired_bytes_is_tiling_the_codes() -> None:
    """The tiled layout from ggml-paired bytes (a move of whole bytes) equals tile_q4 of the same codes."""
    rows = quantise_q4(torch.randn(48, 256))
    codes = unpack_q4(rows["weight"])
    assert torch.equal(unpair_q4(pair_q4(codes)), codes)
    paired = tile_paired({**rows, "weight": pair_q4(codes)})
    for name, t in tile_q4(rows).items():
        assert torch.equal(paired[name], t), name


def test_own_q6_k_dequantiser_gives_gguf_pys_floats_bit_for_bit() -> None:
    """engine/checkpoint/gguf_dequant.py's Q6_K (every bit pattern of codes and int8 scales, float16 d of both
    signs) against gguf-py's on the same bytes; a type it does not have is left to gguf-py."""
    from engine.checkpoint.gguf_dequant import dequantise_into

    rows, cols = 40, 768
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(-2e-3, 2e-3, size=(rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    want = dequantize(raw, GGMLQuantizationType.Q6_K).reshape(rows, cols)
    got = np.full((rows, cols), np.nan, dtype=np.float32)
    assert dequantise_into(raw, "Q6_K", got)
    np.testing.assert_array_equal(got, want)
    assert not dequantise_into(random_blocks("Q4_1", 4, 64), "Q4_1", np.zeros((4, 64), dtype=np.float32))
