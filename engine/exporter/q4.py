"""4-bit weights (`--dtype q4`): groups of Q4_GROUP weights along a row, each an unsigned 4-bit code with a
scale and offset (w = code * scale + offset), GGUF's Q4_1 (needs torch): float16 numbers in the rows layout (a
Q4_1 GGUF's come back exactly), two-level ones in a multiplied matrix's tiles (below).

The matrix product is one custom op, written as MLIR (engine/exporter/kernels/q4_products.py): the packed bytes are bitcast to i4
and dequantised inside the op's dispatch, so a product reads the 4-bit codes (plus a group's numbers) and never a
widened matrix. A torch formulation cannot get there: torch has no 4-bit type, and unpacking nibbles
with shifts and masks makes the dequantisation a separate dispatch that writes the whole float32 matrix on every
call.

Layouts. `quantise_q4` gives rows: codes [out, in/2] (two to a byte, low nibble first: IREE's i4 layout), scales
and offsets [out, in/Q4_GROUP]; an embedding, which is looked up by row, stays so. A matrix that is multiplied is
stored tiled (`tile_q4`), in tiles of Q4_TILE_ROWS (16) rows: codes [out/16, groups, 256], and per group of a tile
four blocks of 64 bytes, block h's byte 4r + j holding row r's codes at positions 4h + j (low nibble) and
4h + 16 + j (high nibble). That is the shape of the x86 integer dot products (`vpdpbusd`: 16 rows x 4 positions a
register) that the hand-written products take (decode's, engine/exporter/kernels/dot_products.py, and prefill's,
prefill_products.py): one load and two masks feed two of them. The generic forms (other devices and CPUs) index
the same bytes through a view.

A tiled matrix's group numbers are two-level, as Q4_K's are (`split_numbers`): per group an 8-bit factor of its
scale and one of its offset, and per super-block of groups along a row three float16 numbers (scale = unit x factor,
offset = base + unit x factor). A super-block is of up to 8 groups (Q4_K's 256 weights) in a row narrower than 2048,
of up to 32 from there (config.super_groups): 2 bytes a group and 6 a super-block instead of 4 a group, 4.69 or 4.55
bits a weight instead of 5. Decode at 1B-8B reads its weights at the memory's bandwidth (docs/BENCHMARKS.md), so
fewer bytes are about as much time. The codes are kept as they are: on the default model's Q4_1 file the numbers'
rounding adds 0.08 % to the variance of the codes' own error (0.14 % with blocks of 32). Factors [out/16, groups, 16]
(int8 tensors holding unsigned bytes), units [out/16, supers, 3, 16] (float16).

Bytes are stored in int8 tensors: the bytes are what matter, and int8 is the byte type turbine's parameters carry
unchanged.
"""
from __future__ import annotations

import torch

from ..config import Q4_GROUP, super_groups
from ..config import Q4_TILE_ROWS as TILE

# A tiled matrix's parameters beside its codes ("weight"), in the products' argument order.
Q4_NUMBERS = ("scale", "offset", "units")


def tile_rows(w: torch.Tensor, tile: int) -> torch.Tensor:
    """[out, in] -> [out/T, in, T]: the rows of each tile interleaved at each input position (q4's scales)."""
    out, cols = w.shape
    return w.reshape(out // tile, tile, cols).transpose(1, 2).contiguous()


def untile_rows(t: torch.Tensor) -> torch.Tensor:
    """tile_rows' inverse."""
    return t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous()


def packable(in_features: int, out_features: int | None = None) -> bool:
    """Whether a matrix can be stored in q4: whole groups along its rows (and, if it is multiplied, so tiled,
    whole tiles of rows: `out_features`)."""
    return in_features % Q4_GROUP == 0 and (out_features is None or out_features % TILE == 0)


def quantise_q4(w: torch.Tensor, paired: bool = False) -> dict[str, torch.Tensor]:
    """{"weight": int8 [out, in/2], "scale", "offset": float16 [out, in/Q4_GROUP]} for a float matrix [out, in]:
    the codes in pack_q4's bytes, or with `paired` in pair_q4's (the bytes a tiled matrix is made from by moving
    whole bytes: tile_paired).

    Each group's minimum maps to code 0 and its maximum to 15, as llama.cpp's Q4_1 quantiser does, and the codes
    are taken against the scale and offset as float16 stores them: a Q4_1 GGUF's dequantised weights come back as
    its very codes and numbers."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // Q4_GROUP, Q4_GROUP)
    low = groups.amin(-1).to(torch.float16)
    # The smallest normal float16 step: a constant group (scale 0) keeps its codes at 0 and its value in the offset.
    scale = ((groups.amax(-1) - low.float()) / 15).clamp_min(6.2e-5).to(torch.float16)
    # In place on one float32 temporary, where the division, rounding and clamp each made another.
    codes = groups - low.float().unsqueeze(-1)
    codes.div_(scale.float().unsqueeze(-1)).round_().clamp_(0, 15)
    codes = codes.to(torch.uint8).reshape(rows, cols)
    return {"weight": pair_q4(codes) if paired else pack_q4(codes), "scale": scale.contiguous(),
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


def split_numbers(scale: torch.Tensor, offset: torch.Tensor) -> dict[str, torch.Tensor]:
    """Group scales (>= 0) and offsets [out, groups] -> {"scale", "offset": unsigned 8-bit factors [out, groups]
    (their bytes in int8), "units": float16 [out, supers, 3]}, where per super-block units = (scale unit, offset
    unit, offset base): scale = scale unit x factor, offset = offset base + offset unit x factor. The scale unit is
    the block's largest scale / 255; the offsets span their block's least to largest over 255 steps. An offset
    first takes up 7.5 times its scale's rounding (a group's mean code, about): the weights move by the rounding
    times the code's distance from 7.5 rather than times the code."""
    out, groups = scale.shape
    per = super_groups(groups)
    s, o = scale.float().reshape(out, -1, per), offset.float().reshape(out, -1, per)
    s_unit = (s.amax(-1) / 255).to(torch.float16)
    s_factor = _factors(s, s_unit.float(), 0)
    o = o + 7.5 * (s - s_factor * s_unit.float().unsqueeze(-1))
    o_base = o.amin(-1).to(torch.float16)
    o_unit = ((o.amax(-1) - o_base.float()) / 255).to(torch.float16)
    o_factor = _factors(o, o_unit.float(), o_base.float())
    return {"scale": _bytes(s_factor, out, groups), "offset": _bytes(o_factor, out, groups),
            "units": torch.stack([s_unit, o_unit, o_base], dim=-1)}


def _factors(v: torch.Tensor, unit: torch.Tensor, base: torch.Tensor | int) -> torch.Tensor:
    """round((v - base) / unit) in 0..255 per super-block ([out, supers, per]; 0 where the unit is 0)."""
    u = unit.unsqueeze(-1)
    b = base.unsqueeze(-1) if isinstance(base, torch.Tensor) else base
    return torch.where(u > 0, torch.round((v - b) / torch.where(u > 0, u, 1)), 0).clamp(0, 255)


def _bytes(factors: torch.Tensor, out: int, groups: int) -> torch.Tensor:
    return factors.to(torch.uint8).view(torch.int8).reshape(out, groups)


def join_numbers(numbers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """split_numbers' numbers -> the float32 scales and offsets [out, groups] they stand for, computed in float32
    as the products compute them (a scale one multiply, an offset one fused multiply-add)."""
    units = numbers["units"].float()
    out, supers, _ = units.shape
    s_factor, o_factor = (numbers[n].view(torch.uint8).float().reshape(out, supers, -1) for n in ("scale", "offset"))
    scale = s_factor * units[..., 0:1]
    offset = (o_factor.double() * units[..., 1:2].double() + units[..., 2:3].double()).float()
    return scale.reshape(out, -1), offset.reshape(out, -1)


def _nonnegative(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights with every group's scale >= 0 (split_numbers' factors are unsigned): a group with a
    negative one (Q4_0's d may be) takes 15 - code, -scale and offset + 15 scale. A group's 16 bytes hold its own
    codes only, in pack_q4's order as in pair_q4's, so the flip is a xor of whole bytes."""
    scale, offset = rows["scale"].float(), rows["offset"].float()
    negative = scale < 0
    if not bool(negative.any()):
        return rows
    out, groups = scale.shape
    flip = torch.where(negative, -1, 0).to(torch.int8).unsqueeze(-1)
    weight = (rows["weight"].reshape(out, groups, -1) ^ flip).reshape(out, -1)
    return {"weight": weight, "scale": scale.abs(), "offset": torch.where(negative, offset + 15 * scale, offset)}


def _tiled_numbers(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """split_numbers' numbers tiled: factors [out/16, groups, 16], units [out/16, supers, 3, 16]."""
    split = split_numbers(rows["scale"], rows["offset"])
    units = split["units"]
    out, supers, _ = units.shape
    return {"scale": tile_rows(split["scale"], TILE), "offset": tile_rows(split["offset"], TILE),
            "units": units.reshape(out // TILE, TILE, supers, 3).permute(0, 2, 3, 1).contiguous()}


def _untiled_numbers(tiled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tiles, supers, _, _ = tiled["units"].shape
    units = tiled["units"].permute(0, 3, 1, 2).reshape(tiles * TILE, supers, 3)
    return {"scale": untile_rows(tiled["scale"]), "offset": untile_rows(tiled["offset"]), "units": units}


def tile_q4(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows layout (quantise_q4) -> the tiled one: codes int8 [out/16, groups, 256] in blocks, the group
    numbers split (split_numbers) and tiled: factors [out/16, groups, 16], units [out/16, supers, 3, 16]."""
    rows = _nonnegative(rows)
    codes = unpack_q4(rows["weight"])
    out, cols = codes.shape
    # [tile, row, group, nibble, block, position in block] -> [tile, group, block, row, position, nibble]
    blocks = codes.reshape(out // TILE, TILE, cols // Q4_GROUP, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    return {"weight": pack_q4(blocks.reshape(out // TILE, cols // Q4_GROUP, -1)), **_tiled_numbers(rows)}


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
    paired = _nonnegative(paired)
    w = paired["weight"]
    out, groups = w.shape[0], w.shape[1] // 16
    # Runs of 4 bytes move together, as int32: a copy of a quarter as many elements (an 8B's byte-wise moves
    # were 5 s of its build).
    words = w.contiguous().view(torch.int32).reshape(out // TILE, TILE, groups, 4).permute(0, 2, 3, 1)
    return {"weight": words.contiguous().view(torch.int8).reshape(out // TILE, groups, 256),
            **_tiled_numbers(paired)}


def untile_q4(tiled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiled layout -> the rows layout, its numbers joined into float32 (what the products multiply by)."""
    codes = unpack_q4(tiled["weight"])
    tiles, groups, _ = codes.shape
    rows = codes.reshape(tiles, groups, 4, TILE, 4, 2).permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE, -1)
    scale, offset = join_numbers(_untiled_numbers(tiled))
    return {"weight": pack_q4(rows), "scale": scale, "offset": offset}


def dequantise_q4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 rows [..., in] from their packed codes and group scales/offsets [..., in/Q4_GROUP] (rows layout)."""
    codes = unpack_q4(packed).float().reshape(*scale.shape, Q4_GROUP)
    return (codes * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)).reshape(*packed.shape[:-1], -1)
