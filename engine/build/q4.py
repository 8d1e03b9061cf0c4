"""4-bit weights (`--dtype q4`): groups of Q4_GROUP weights along a row, each an unsigned 4-bit code with a
float16 scale and offset (w = code * scale + offset), GGUF's Q4_1 (needs torch). float16, as in Q4_1: a Q4_1
GGUF's numbers come back exactly, and decode reads 0.625 bytes a weight instead of float32's 0.75, which its
memory-bound product turns into speed (docs/BENCHMARKS.md).

The matrix product is one custom op, written as MLIR (engine/build/kernels.py): the packed bytes are bitcast to i4
and dequantised inside the op's dispatch, so a product reads the 4-bit codes (plus two float32 numbers per group)
and never a widened matrix. A torch formulation cannot get there: torch has no 4-bit type, and unpacking nibbles
with shifts and masks makes the dequantisation a separate dispatch that writes the whole float32 matrix on every
call.

Layouts. `quantise_q4` gives rows: codes [out, in/2] (two to a byte, low nibble first: IREE's i4 layout), scales
and offsets [out, in/Q4_GROUP]; an embedding, which is looked up by row, stays so. A matrix that is multiplied is
stored tiled (`tile_q4`), in tiles of Q4_TILE_ROWS (16) rows: codes [out/16, groups, 256], and per group of a tile
four blocks of 64 bytes, block h's byte 4r + j holding row r's codes at positions 4h + j (low nibble) and
4h + 16 + j (high nibble); scales and offsets [out/16, groups, 16]. That is the shape of the x86 integer dot
products (`vpdpbusd`: 16 rows x 4 positions a register) that the hand-written products take (decode's,
engine/build/dot_products.py, and prefill's, prefill_products.py): one load and two masks feed two of them. The
generic forms (other devices and CPUs) index the same bytes through a 6-d view.

Bytes are stored in int8 tensors: the bytes are what matter, and int8 is the byte type turbine's parameters carry
unchanged.
"""
from __future__ import annotations

import torch

from ..config import Q4_GROUP, Q4_TILE_ROWS as TILE
from .kernels import tile_rows, untile_rows


def packable(in_features: int, out_features: int | None = None) -> bool:
    """Whether a matrix can be stored in q4: whole groups along its rows (and, if it is multiplied, so tiled,
    whole tiles of rows: `out_features`)."""
    return in_features % Q4_GROUP == 0 and (out_features is None or out_features % TILE == 0)


def quantise_q4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"weight": int8 [out, in/2], "scale", "offset": float16 [out, in/Q4_GROUP]} for a float matrix [out, in].

    Each group's minimum maps to code 0 and its maximum to 15, as llama.cpp's Q4_1 quantiser does, and the codes
    are taken against the scale and offset as float16 stores them: a Q4_1 GGUF's dequantised weights come back as
    its very codes and numbers."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // Q4_GROUP, Q4_GROUP)
    low = groups.amin(-1).to(torch.float16)
    # The smallest normal float16 step: a constant group (scale 0) keeps its codes at 0 and its value in the offset.
    scale = ((groups.amax(-1) - low.float()) / 15).clamp_min(6.2e-5).to(torch.float16)
    codes = torch.round((groups - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp(0, 15)
    return {"weight": pack_q4(codes.to(torch.uint8).reshape(rows, cols)), "scale": scale.contiguous(),
            "offset": low.contiguous()}


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., n] -> int8 [..., n/2], two to a byte, low nibble first."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., n/2] of packed codes -> uint8 [..., n] codes 0..15 (a byte a code: tile_q4 moves an 8B model's
    largest matrix, whose codes in int64 would add ~2 GB to the build's peak)."""
    low, high = packed & 15, (packed >> 4) & 15
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1).to(torch.uint8)


def tile_q4(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows layout (quantise_q4) -> the tiled one: codes int8 [out/16, groups, 256] in blocks, scale and offset
    float16 [out/16, groups, 16]. The same codes and numbers, moved."""
    codes = unpack_q4(rows["weight"])
    out, cols = codes.shape
    # [tile, row, group, nibble, block, position in block] -> [tile, group, block, row, position, nibble]
    blocks = codes.reshape(out // TILE, TILE, cols // Q4_GROUP, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    return {"weight": pack_q4(blocks.reshape(out // TILE, cols // Q4_GROUP, -1)),
            "scale": tile_rows(rows["scale"], TILE), "offset": tile_rows(rows["offset"], TILE)}


def pair_q4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., n] -> int8 [..., n/2] in ggml's pairing: in each group of 32, byte p holds code p (low
    nibble) and code p + 16 (high). The tiled layout pairs codes so too, so from these bytes tiling is a move of
    whole bytes (tile_paired); a GGUF's Q4_0 and Q4_1 blocks are these bytes as stored."""
    g = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2, 16)
    return (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1).view(torch.int8)


def unpair_q4(paired: torch.Tensor) -> torch.Tensor:
    """pair_q4's inverse: int8 [..., n/2] -> uint8 codes [..., n]."""
    b = paired.view(torch.uint8).reshape(*paired.shape[:-1], -1, 16)
    return torch.stack([b & 15, b >> 4], dim=-2).reshape(*paired.shape[:-1], -1)


def tile_paired(paired: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"weight": int8 [out, in/2] in pair_q4's bytes, "scale", "offset"} -> the tiled layout (tile_q4's), by
    moving bytes: tile t, group g, block h's byte 4r + j is row 16t + r's byte 4h + j of group g."""
    w = paired["weight"]
    out, groups = w.shape[0], w.shape[1] // 16
    tiles = w.reshape(out // TILE, TILE, groups, 4, 4).permute(0, 2, 3, 1, 4).reshape(out // TILE, groups, 256)
    return {"weight": tiles.contiguous(), "scale": tile_rows(paired["scale"], TILE),
            "offset": tile_rows(paired["offset"], TILE)}


def untile_q4(tiled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiled layout -> the rows layout (tile_q4's inverse)."""
    codes = unpack_q4(tiled["weight"])
    tiles, groups, _ = codes.shape
    rows = codes.reshape(tiles, groups, 4, TILE, 4, 2).permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE, -1)
    return {"weight": pack_q4(rows), "scale": untile_rows(tiled["scale"]), "offset": untile_rows(tiled["offset"])}


def dequantise_q4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 rows [..., in] from their packed codes and group scales/offsets [..., in/Q4_GROUP] (rows layout)."""
    codes = unpack_q4(packed).float().reshape(*scale.shape, Q4_GROUP)
    return (codes * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)).reshape(*packed.shape[:-1], -1)
