"""q8's tiled layout of a multiplied matrix (each tile's rows 4 positions at a time: the operand of the x86
products' `vpdpbusd`, and a row per vector lane in the generic ones), and reading rows back out of it."""
from __future__ import annotations

import torch

from ...config import TILE_ROWS as TILE


def tileable(out_features: int, in_features: int) -> bool:
    """Whether a multiplied q8 matrix makes whole tiles: of rows, and of 4 positions along them."""
    return out_features % TILE == 0 and in_features % 4 == 0


def tile_q8(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/T, in/4, T x 4]: each tile's rows 4 positions at a time, byte 4r + j of step p holding
    row r's weight at position 4p + j (the operand of `vpdpbusd`: engine/exporter/kernels/dot_products.py)."""
    out, cols = w.shape
    return w.reshape(out // TILE, TILE, cols // 4, 4).transpose(1, 2).reshape(out // TILE, cols // 4, TILE * 4)


def untile_q8(t: torch.Tensor) -> torch.Tensor:
    """tile_q8's inverse."""
    tiles, quads, _ = t.shape
    return t.reshape(tiles, quads, TILE, 4).transpose(1, 2).reshape(tiles * TILE, quads * 4)


def tiled_rows(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of a tiled q8 matrix (tile_q8), as [n, in] (a tied embedding's lookup, decode's refined logits):
    each row's bytes picked out of its tile by one gather. Taking each row's whole tile first and then the row copied
    32 rows for each: 4 MB for 64 ids of a 1B's head, 5 ms where this takes 0.17."""
    tiles, quads, _ = tiled.shape
    # Each row's 4 bytes at each step: [tiles x steps x TILE, 4], row r of tile t at step q being (t x steps + q) x
    # TILE + r. An embedding lookup, where advanced indexing over a dynamic count failed to lower in IREE.
    tile, row = torch.div(ids, TILE, rounding_mode="floor").reshape(-1, 1), torch.remainder(ids, TILE).reshape(-1, 1)
    at = (tile * quads + torch.arange(quads).reshape(1, -1)) * TILE + row
    return torch.nn.functional.embedding(at, tiled.reshape(-1, 4)).reshape(-1, quads * 4)
