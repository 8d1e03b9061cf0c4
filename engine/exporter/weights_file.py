"""weights.irpa straight from the checkpoint, one module's parameters at a time (needs torch).

For each Piece of the model (engine/exporter/linear.py) the checkpoint tensors it is made from are read, converted
to the build's type (q|k|v and gate|up concatenated, cast or quantised to q8) and written into the archive at
once, then dropped: the build holds about one tensor, however large the model. The names, types, shapes and
metadata are the skeleton's parameters', so the file is the one turbine's save_module_parameters writes for a
model loaded in memory (StreamingLlama.load_hf), byte for byte.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

# turbine's own metadata for each entry (dtype and shape as JSON), so the file matches what it would write.
from iree.turbine.aot.params import _make_tensor_metadata

from .irpa import ArchiveWriter, Entry
from .model import StreamingLlama

if TYPE_CHECKING:
    from ..checkpoint import CheckpointTensors
    from .linear import Piece


def archive_entries(model: StreamingLlama) -> list[Entry]:
    """The archive's entries in turbine's order (the model's parameters; its buffers are all non-persistent)."""
    assert not model.state_dict().keys() - dict(model.named_parameters()).keys(), "persistent buffers are not written"
    return [Entry(name, p.numel() * p.element_size(), _make_tensor_metadata(p).encode())
            for name, p in model.named_parameters()]


def _source(tensors: "CheckpointTensors", name: str, piece: "Piece"):
    """A piece's source tensor: for a q4 matrix a GGUF's 4-bit codes as they are, where the file has them; for a
    quantised matrix of one source, its rows read a block at a time as stored_matrix converts them
    (CheckpointTensors.read_rows), where the file can; else the whole tensor."""
    kept = tensors.read_q4(name) if piece.dtype == "q4" else None
    if kept is None and piece.kind == "matrix" and piece.dtype in ("q4", "q8") and len(piece.sources) == 1:
        kept = tensors.read_rows(name)
    return kept if kept is not None else tensors.read_stored(name)


def write_weights(model: StreamingLlama, tensors: "CheckpointTensors", path: Path,
                  progress: Callable[[int, int], None] | None = None) -> None:
    """Writes the model's parameters, made from `tensors`, to path; progress(pieces done, pieces) after each.

    `model` may be a skeleton: only its parameters' names, types and shapes are read."""
    params = dict(model.named_parameters())
    pieces = model.pieces()
    with ArchiveWriter(path, archive_entries(model)) as archive, torch.no_grad():
        for done, piece in enumerate(pieces, 1):
            made = piece.convert([_source(tensors, name, piece) for name in piece.sources])
            for name, t in made.items():
                want = params[name]
                if t.dtype != want.dtype or t.shape != want.shape:
                    raise AssertionError(f"{name}: made {t.dtype} {tuple(t.shape)}, the model holds "
                                         f"{want.dtype} {tuple(want.shape)}")
                archive.write(name, t.contiguous().reshape(-1).view(torch.uint8).numpy())
            del made
            if progress is not None:
                progress(done, len(pieces))
