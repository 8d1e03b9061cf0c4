"""6-bit weights: a q4 build's LM head on a CPU with hand-written products (needs torch).

GGUF's Q6_K, as llama.cpp's 4-bit files keep their output matrix: per row, a 6-bit code per weight (w = d x s x
(code - 32)), an 8-bit factor s per 16 weights and a float16 unit d per 256, 6.56 bits a weight where q8 takes
8.02. Decode at 1B-8B reads its weights at the memory's bandwidth and a 1B's LM head is a third of its bytes
(docs/BENCHMARKS.md), so the head in 6 bits is decode's time less that share. A Q6_K head's codes, factors and
units are kept as the file has them (q8 rounded the file's values again, to a scale per row); any other source is
quantised as below.

Rows (`quantise_q6`; engine/checkpoint/gguf_q6.py from a GGUF's blocks): codes uint8 [out, in] (0-63), factors int8 [out, in/16],
units float16 [out, in/256]. A multiplied matrix is stored tiled (`tile_q6`), tiles of Q4_TILE_ROWS (16) rows as q4's
codes are, so that the product (engine/exporter/kernels/dot_products.py, q6_executable) feeds `vpdpbusd` the same
way: per group of 32 positions of a tile, six blocks of 64 bytes. Blocks 0-3 are q4's: block h's byte 4r + j holds
the low 4 bits of row r's codes at positions 4h + j (low nibble) and 4h + 16 + j (high nibble). Blocks 4 and 5 hold
the codes' top 2 bits: bits 2h and 2h + 1 of byte 4r + j are those of position 4h + j (block 4) or 4h + 16 + j
(block 5). A group's two factors [out/16, groups, 2, 16] (positions 0-15, then 16-31), a super-block's units
[out/16, in/256, 16].
"""
from __future__ import annotations

import torch

from ..config import Q4_GROUP, Q6_GROUP_BYTES, Q6_SUB, Q6_SUPER
from ..config import Q4_TILE_ROWS as TILE

# A tiled matrix's parameters beside its codes ("weight"), in the product's argument order.
Q6_NUMBERS = ("scale", "units")


def packable_q6(in_features: int, out_features: int) -> bool:
    """Whether a multiplied matrix can be stored in q6: whole super-blocks along its rows, whole tiles of rows."""
    return in_features % Q6_SUPER == 0 and out_features % TILE == 0


def quantise_q6(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows {"weight": codes uint8 [out, in], "scale": factors int8 [out, in/16], "units": float16 [out, in/256]}
    for a float matrix [out, in]. Each 16's largest magnitude maps to at most 31 steps of its scale; the factors
    are that scale in steps of the super-block's unit (its largest scale / 127), and the codes are taken against
    the scale as stored (unit in float16 times factor)."""
    rows, cols = w.shape
    subs = w.float().reshape(rows, cols // Q6_SUPER, Q6_SUPER // Q6_SUB, Q6_SUB)
    scale = subs.abs().amax(-1) / 31  # [rows, supers, 16]
    # Rounded up, the unit and then each factor: a 16's step is never under its scale, so no code is clipped.
    units = (scale.amax(-1) / 127 * (1 + 2 ** -10)).to(torch.float16)
    u = units.float().unsqueeze(-1)
    factors = torch.where(u > 0, torch.ceil(scale / torch.where(u > 0, u, 1)), 0).clamp(0, 127)
    step = (u * factors).unsqueeze(-1)
    codes = torch.where(step > 0, torch.round(subs / torch.where(step > 0, step, 1)), 0).clamp(-32, 31) + 32
    return {"weight": codes.to(torch.uint8).reshape(rows, cols),
            "scale": factors.to(torch.int8).reshape(rows, cols // Q6_SUB), "units": units.contiguous()}


def dequantise_q6(weight: torch.Tensor, scale: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Rows (quantise_q6's) as float32 [out, in]."""
    rows, cols = weight.shape
    codes = weight.to(torch.int32).float().reshape(rows, cols // Q6_SUB, Q6_SUB) - 32
    step = scale.float().reshape(rows, -1, Q6_SUPER // Q6_SUB) * units.float().unsqueeze(-1)
    return (codes * step.reshape(rows, -1, 1)).reshape(rows, cols)


# Rows tiled at a time: the bit moves' temporaries stay tens of MB (a 1B's head whole took 0.7 GB more).
TILE_ROWS_AT_ONCE = 4096


def tile_q6(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rows (quantise_q6's or a GGUF's, gguf_q6.q6_rows) in the tiled layout (the module's docstring), by moving
    bits: the codes are the rows' own."""
    codes, factors, units = rows["weight"], rows["scale"], rows["units"]
    out, cols = codes.shape
    groups = cols // Q4_GROUP
    blocks = torch.empty(out // TILE, groups, 6, TILE, 4, dtype=torch.uint8)
    for start in range(0, out, TILE_ROWS_AT_ONCE):
        part = codes[start:start + TILE_ROWS_AT_ONCE].to(torch.uint8)
        # [tile, r, group, nibble (positions 0-15 or 16-31), h, j] -> [tile, group, h, r, j, nibble]
        c = part.reshape(-1, TILE, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        low, top = c & 15, c >> 4
        into = blocks[start // TILE:(start + len(part)) // TILE]
        into[:, :, :4] = low[..., 0] | (low[..., 1] << 4)
        for half in range(2):
            t = top[..., half]
            into[:, :, 4 + half] = t[:, :, 0] | (t[:, :, 1] << 2) | (t[:, :, 2] << 4) | (t[:, :, 3] << 6)
    tiled_factors = factors.reshape(out // TILE, TILE, groups, 2).permute(0, 2, 3, 1)
    tiled_units = units.reshape(out // TILE, TILE, -1).transpose(1, 2)
    return {"weight": blocks.reshape(out // TILE, groups, Q6_GROUP_BYTES).view(torch.int8),
            "scale": tiled_factors.contiguous(), "units": tiled_units.contiguous()}


def _codes(b: torch.Tensor) -> torch.Tensor:
    """The codes of blocks [..., 6, 4] (a row's bytes of a tile's group, as int32 0-255) in position order
    [..., 32]: block h's byte j holds positions 4h + j and 16 + 4h + j."""
    low = torch.stack([b[..., :4, :] & 15, b[..., :4, :] >> 4], dim=-1)  # [..., h, j, nibble]
    # Shifts by a number, each h its own: IREE's torch lowering has no shift by a tensor.
    top = torch.stack([torch.stack([(b[..., block, :] >> (2 * h)) & 3 for h in range(4)], dim=-2)
                       for block in (4, 5)], dim=-1)
    codes = low | (top << 4)
    return codes.transpose(-1, -3).transpose(-1, -2).reshape(*b.shape[:-2], Q4_GROUP)  # [..., nibble, h, j]


def _byte_of(top: bool) -> torch.Tensor:
    """For each (row r, position p) of a tile's group, r-major [16 x 32]: the byte of the group that holds its low
    4 bits (q4's blocks) or, with `top`, its top 2 bits (blocks 4 and 5)."""
    r = torch.arange(TILE).view(-1, 1)
    p = torch.arange(Q4_GROUP).view(1, -1)
    h, j, high = (p % 16) // 4, p % 4, p // 16
    return ((256 + 64 * high if top else 64 * h) + 4 * r + j).reshape(-1)


def untile_q6(weight: torch.Tensor, scale: torch.Tensor, units: torch.Tensor) -> dict[str, torch.Tensor]:
    """tile_q6's inverse: the rows of tiles [tiles, groups, 384]. Each code's two bytes are gathered by a constant
    index and its bits taken with shifts by numbers and selects: elementwise work IREE fuses into one dispatch
    (stacks of the bit fields were several dispatches that took iree-compile 6 s longer for a 1B's head)."""
    groups = weight.shape[1]
    # Bytes widened and masked rather than viewed as uint8: the same in torch, and plain integer ops in an export.
    low = weight.index_select(2, _byte_of(False)).to(torch.int32) & 255  # [tile, group, r x p]
    top = weight.index_select(2, _byte_of(True)).to(torch.int32) & 255
    p = torch.arange(Q4_GROUP).repeat(TILE)
    low = torch.where(p >= 16, low >> 4, low) & 15
    h = (p % 16) // 4
    top = torch.where(h == 0, top, torch.where(h == 1, top >> 2, torch.where(h == 2, top >> 4, top >> 6))) & 3
    codes = (low | (top << 4)).reshape(-1, groups, TILE, Q4_GROUP).transpose(1, 2)
    return {"weight": codes.reshape(-1, groups * Q4_GROUP),
            "scale": scale.permute(0, 3, 1, 2).reshape(-1, groups * 2),
            "units": units.transpose(1, 2).reshape(-1, units.shape[1])}


def dequantise_tiled_q6(weight: torch.Tensor, scale: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """A tiled matrix as float32 rows (perplexity's product of many rows)."""
    return dequantise_q6(*untile_q6(weight, scale, units).values())


def tiled_rows_q6(weight: torch.Tensor, scale: torch.Tensor, units: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a tiled matrix as float32 [len(ids), in] (a tied embedding's lookup): each row's own bytes
    taken from its tile, then unpacked."""
    tiles, r = ids // TILE, (ids % TILE).view(-1, 1, 1, 1)
    groups, supers = weight.shape[1], units.shape[1]
    b = (weight[tiles].to(torch.int32) & 255).reshape(-1, groups, 6, TILE, 4)
    row = b.gather(3, r.view(-1, 1, 1, 1, 1).expand(-1, groups, 6, 1, 4)).squeeze(3)  # [n, groups, 6, 4]
    factors = scale[tiles].gather(3, r.expand(-1, groups, 2, 1)).reshape(-1, groups * 2)
    unit = units[tiles].gather(2, r.view(-1, 1, 1).expand(-1, supers, 1)).reshape(-1, supers)
    return dequantise_q6(_codes(row).reshape(-1, groups * Q4_GROUP), factors, unit)
