"""A weight matrix in the build's type (f32, f16, bf16, q8 or q4) as the exported model holds it (Linear), and
its conversion from checkpoint tensors (stored_matrix; Piece, the unit of conversion, into a model in memory or
straight into the weights file). Export-side only (needs torch)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Q4_TILE_ROWS, TILE_ROWS, super_groups
from .kernels import (f16_linear, i8_linear, i8_linear_scaled, q4_linear, q4_linear_parts, tile_q8, tileable,
                      tiled_rows)
from .q4 import Q4_GROUP, dequantise_q4, pack_q4, packable, quantise_q4, tile_paired, unpair_q4

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def fixed_rows(x: torch.Tensor) -> bool:
    """Whether x [rows, in] is a call's fixed many rows: a prefill of a build of fixed shapes (a GPU's; a CPU's rows
    are dynamic, and decode's are one)."""
    return x.dim() == 2 and isinstance(x.shape[0], int) and x.shape[0] > 1


class Linear(nn.Module):
    """A weight matrix [out, in] stored in the build's type: f32, f16, bf16, q8 (int8 with a per-row scale) or q4
    (4-bit codes in groups with a scale and an offset each: engine/exporter/q4.py).

    Stored weights are widened inside the graph: IREE fuses the widening into the matrix-vector products, so
    decode reads 2 (16-bit), 1 (q8) or about 0.59 (q4: half a byte, 2 bytes per 32 and 6 per 256) bytes per weight while
    activations and accumulation stay float32. A quantised matrix that is multiplied is stored in tiles of rows
    and multiplied by a custom op (engine/exporter/kernels/) whose decode form keeps a row per vector lane. The
    parameters have their stored type from the start, so a skeleton that never receives its weights
    (StreamingLlama.skeleton) exports exactly as one holding them. `matrix_units`: a float16 matrix multiplies a
    call's fixed many rows in 16 bits (kernels.f16_linear: the device's Device.matrix_units).
    """

    def __init__(self, out_features: int, in_features: int, dtype: str, bias: bool = False,
                 lookup: bool = False, matrix_units: bool = False) -> None:
        super().__init__()
        # One only looked up by row (an untied embedding) keeps its rows whole.
        self.tiled = not lookup
        self.dtype = dtype = matrix_dtype(dtype, in_features, None if lookup else out_features)
        self.matrix_units = matrix_units and dtype == "f16"
        self.in_tiles = in_tiles(dtype, out_features, in_features, self.tiled)
        self.offset = self.units = None
        if dtype == "q4":
            groups = in_features // Q4_GROUP
            if lookup:
                self.weight = _frozen(torch.empty(out_features, in_features // 2, dtype=torch.int8))
                self.scale = _frozen(torch.empty(out_features, groups, dtype=torch.float16))
                self.offset = _frozen(torch.empty(out_features, groups, dtype=torch.float16))
            else:
                # Two-level group numbers (engine/exporter/q4.py, split_numbers): 8-bit factors, float16 units.
                tiles, supers = out_features // Q4_TILE_ROWS, groups // super_groups(groups)
                self.weight = _frozen(torch.empty(tiles, groups, Q4_TILE_ROWS * Q4_GROUP // 2, dtype=torch.int8))
                self.scale = _frozen(torch.empty(tiles, groups, Q4_TILE_ROWS, dtype=torch.int8))
                self.offset = _frozen(torch.empty(tiles, groups, Q4_TILE_ROWS, dtype=torch.int8))
                self.units = _frozen(torch.empty(tiles, supers, 3, Q4_TILE_ROWS, dtype=torch.float16))
        else:
            stored = torch.int8 if dtype == "q8" else TORCH_DTYPES[dtype]
            tiles = (out_features // TILE_ROWS, in_features // 4, TILE_ROWS * 4)
            self.weight = _frozen(torch.empty(tiles if self.in_tiles else (out_features, in_features), dtype=stored))
            # Per row, in row order whatever the layout (a tile's rows are consecutive).
            self.scale = _frozen(torch.empty(out_features)) if dtype == "q8" else None
        # float32 whatever the weights' type: it is tiny.
        self.bias = _frozen(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == "q4":
            y = q4_linear(x, *self.q4_tensors())
        elif self.rounds_x(x):
            y = f16_linear(x, self.weight)
        elif self.in_tiles and self.scale is not None and fixed_rows(x):  # a GPU build's prefill: one dispatch
            y = i8_linear_scaled(x, self.weight, self.scale)
        else:
            y = i8_linear(x, self.weight) if self.in_tiles else F.linear(x, self.weight.float())
            y = y if self.scale is None else y * self.scale
        return y if self.bias is None else y + self.bias

    def rounds_x(self, x: torch.Tensor) -> bool:
        """Whether forward(x) multiplies x rounded to float16 (matrix units, a call's fixed many rows): x may come in
        float16 already."""
        return self.matrix_units and fixed_rows(x)

    def parts(self, x: torch.Tensor, first: int, second: int, many: bool) -> tuple[torch.Tensor, ...]:
        """forward's output [rows, out] as three tensors: the first `first` columns, the next `second`, the rest.
        A q4 matrix multiplying `many` rows (prefill) writes them as three outputs of one product; otherwise they
        are slices of its output."""
        if self.dtype != "q4" or not many:
            y = self(x)
            return y[:, :first], y[:, first:first + second], y[:, first + second:]
        ys = q4_linear_parts(x, *self.q4_tensors(), first, second)
        if self.bias is None:
            return ys
        b = self.bias
        return ys[0] + b[:first], ys[1] + b[first:first + second], ys[2] + b[first + second:]

    def q4_tensors(self) -> tuple[torch.Tensor, ...]:
        """A tiled q4 matrix's parameters in the products' argument order: codes, then q4.Q4_NUMBERS."""
        return self.weight, self.scale, self.offset, self.units

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows as float32 (the embedding lookup of a tied matrix)."""
        if self.dtype == "q4":
            assert not self.tiled, "a tiled q4 matrix has no whole rows to look up"
            return dequantise_q4(*(F.embedding(ids, t) for t in (self.weight, self.scale, self.offset)))
        r = (tiled_rows(self.weight, ids) if self.in_tiles else F.embedding(ids, self.weight)).float()
        return r if self.scale is None else r * F.embedding(ids, self.scale.unsqueeze(1))


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def matrix_dtype(dtype: str, in_features: int, out_features: int | None = None) -> str:
    """The type a matrix is stored in: the build's, except that q4 needs whole groups along a row (and, for a
    matrix that is multiplied, `out_features` in whole tiles of rows), and a matrix without them (no family Eddy
    knows has one) is stored in q8 instead."""
    return "q8" if dtype == "q4" and not packable(in_features, out_features) else dtype


def in_tiles(dtype: str, out_features: int, in_features: int, multiplied: bool) -> bool:
    """Whether a matrix (of its stored type) is stored in tiles of rows: a quantised one that is multiplied, if
    it makes whole tiles (q4's always do: matrix_dtype)."""
    return multiplied and (dtype == "q4" or dtype == "q8" and tileable(out_features, in_features))


# Rows converted at a time by stored_matrix: its float32 temporaries stay a few MB whatever the matrix (a
# 128k-row embedding is 1-2 GB in float32, and q8 would otherwise hold three copies of it at once).
CONVERT_ROWS = 4096


def stored_matrix(w: torch.Tensor, dtype: str, tiled: bool = False) -> dict[str, torch.Tensor]:
    """A weight matrix as Linear stores it: {"weight"} in the build's type, plus a per-row float32 {"scale"} for q8
    (symmetric: the row's largest magnitude maps to 127), or the packed codes with group {"scale", "offset"} for
    q4 (engine/exporter/q4.py). `w` is float32, or the checkpoint's own 16-bit type, or a GGUF's rows read when
    sliced (checkpoint.gguf.GGUFRows: converted without ever being whole in float32).

    `tiled`: a multiplied matrix, whose q4 and q8 are stored in tiles of rows (in_tiles)."""
    dtype = matrix_dtype(dtype, w.shape[1], w.shape[0] if tiled else None)
    if dtype in TORCH_DTYPES and w.dtype == TORCH_DTYPES[dtype]:
        return {"weight": w.contiguous()}
    tiles = in_tiles(dtype, w.shape[0], w.shape[1], tiled)
    out = converted_rows(w, dtype, paired=tiles and dtype == "q4")
    if not tiles:
        return out
    return tile_paired(out) if dtype == "q4" else {**out, "weight": tile_q8(out["weight"])}


def converted_rows(w: torch.Tensor, dtype: str, paired: bool = False) -> dict[str, torch.Tensor]:
    """stored_matrix's rows before any tiling; q4's codes in pair_q4's bytes with `paired`.

    Each block of rows is widened to float32 and converted on its own: a 16-bit matrix is never widened whole,
    and since rows are independent (and widening 16-bit floats is exact) the bytes are those of converting the
    float32 matrix at once."""
    out: dict[str, torch.Tensor] = {}
    for start in range(0, w.shape[0], CONVERT_ROWS):
        block = _convert_rows(w[start:start + CONVERT_ROWS].float(), dtype, paired)
        for name, t in block.items():
            if name not in out:  # allocated once: a second copy of a 1 GB embedding is what this avoids
                out[name] = torch.empty((w.shape[0], *t.shape[1:]), dtype=t.dtype)
            out[name][start:start + len(t)] = t
    return out


def _convert_rows(block: torch.Tensor, dtype: str, paired: bool) -> dict[str, torch.Tensor]:
    if dtype == "q4":
        return quantise_q4(block, paired)
    if dtype != "q8":
        return {"weight": block.to(TORCH_DTYPES[dtype])}
    s = (block.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return {"weight": torch.round(block / s.unsqueeze(1)).clamp(-127, 127).to(torch.int8), "scale": s}


@dataclass(frozen=True)
class Piece:
    """One module's parameters and the checkpoint tensors (Hugging Face names) they are made from: the unit
    in which weights are converted, into a model in memory (StreamingLlama.load_hf) or straight into the .irpa
    (engine/exporter/weights_file.py)."""
    module: str  # its name in the model, e.g. "layers.0.attention.wqkv"
    sources: tuple[str, ...]  # concatenated along the rows (q|k|v, gate|up)
    kind: str  # "matrix": a Linear's weight (and scale); "bias" or "norm": one float32 vector
    dtype: str = "f32"  # a matrix's stored type (its Linear's)
    tiled: bool = False  # a matrix that is multiplied (its Linear's `tiled`)

    def convert(self, tensors: list[torch.Tensor | dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The module's parameters by full name, from its source tensors (in `sources` order; float32, or the
        checkpoint's own floating type, which converts to the same bytes; for a q4 matrix, also q4 rows as a
        GGUF's 4-bit blocks give them, CheckpointTensors.read_q4; for a quantised matrix of one source, also rows
        read when sliced, CheckpointTensors.read_rows)."""
        if any(isinstance(t, dict) for t in tensors):
            # A GGUF's 4-bit blocks in pair_q4's bytes (CheckpointTensors.read_q4), beside any float source of
            # the same piece: all taken to those bytes, joined by rows, then tiled by moving bytes.
            assert self.kind == "matrix" and self.dtype == "q4", f"{self.module}: q4 codes for a {self.dtype} piece"
            parts = [t if isinstance(t, dict) else converted_rows(t, "q4", paired=True) for t in tensors]
            joined = {k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}
            if self.tiled:
                made = tile_paired(joined)
            else:
                made = {**joined, "weight": pack_q4(unpair_q4(joined["weight"]))}
            return {f"{self.module}.{name}": t for name, t in made.items()}
        w = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        if self.kind == "matrix":
            return {f"{self.module}.{name}": t for name, t in stored_matrix(w, self.dtype, self.tiled).items()}
        return {f"{self.module}.{'bias' if self.kind == 'bias' else 'weight'}": w.float().contiguous()}
