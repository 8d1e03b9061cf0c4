"""Whether the disk has room for a build, asked before it starts (torch-free: the config is enough).

A build that runs out of disk fails late (weights.irpa is sized up front, sparse, so the shortage shows only
as its tensors are written, minutes in) and leaves the user no wiser. The estimate errs on the large side:
the weights' exact bytes for the build's dtype, the module (its MLIR, then the .vmfb beside it) and a margin
for the tokenizer files and compiler scratch."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..arch import family
from ..config import Q4_GROUP, BuildSettings, ModelConfig
from ..errors import DiskSpaceError
from .progress import megabytes

WEIGHT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8": 1}
NORM_BYTES = 4  # norms and biases stay float32 whatever the dtype
# SmolLM2-135M's module.vmfb (30 layers) is 0.8 MB, its MLIR (weights external, cache a zero splat) of the
# same order: a generous share per layer, with a floor.
MODULE_BYTES_PER_LAYER = 160_000
MODULE_BYTES_BASE = 4_000_000
SCRATCH_BYTES = 64_000_000  # tokenizer files (a few MB), iree-compile's temporaries, the child's log
SCRATCH_SHARE = 0.05  # of the weights: alignment padding, and room left for the rest of the system


@dataclass(frozen=True)
class BuildSize:
    weights: int
    module: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.module + self.scratch


def matrix_bytes(rows: int, cols: int, dtype: str) -> int:
    """One matrix as engine/exporter/model.py stores it (mirrored here without torch): q8 adds a float32 scale per
    row; q4 is half a byte per weight plus a float16 scale and offset per group of 32, and a matrix whose rows
    are not whole groups falls back to q8."""
    if dtype == "q4":
        if cols % Q4_GROUP:
            return matrix_bytes(rows, cols, "q8")
        return rows * cols // 2 + rows * (cols // Q4_GROUP) * 4
    return rows * cols * WEIGHT_BYTES[dtype] + (rows * 4 if dtype == "q8" else 0)


def weights_bytes(cfg: ModelConfig, settings: BuildSettings) -> int:
    """Bytes of weights.irpa's tensors: each matrix in the build's dtype (the LM head of a q4 build in q8, and in q4
    too where decode reads a 4-bit copy of it: ModelConfig.coarse_head), norms and biases in float32."""
    dtype = settings.dtype
    head = "q8" if dtype == "q4" else dtype

    def matrix(rows: int, cols: int) -> int:
        return matrix_bytes(rows, cols, dtype)

    fam = family(cfg.arch)
    qkv_rows = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    layer = (matrix(qkv_rows, cfg.dim) + matrix(cfg.dim, cfg.n_heads * cfg.head_dim)
             + matrix(2 * cfg.intermediate, cfg.dim) + matrix(cfg.dim, cfg.intermediate)
             + len(fam.norms) * cfg.dim * NORM_BYTES)
    if fam.qkv_bias:
        layer += qkv_rows * NORM_BYTES
    if fam.qk_norm:
        layer += 2 * cfg.head_dim * NORM_BYTES
    embeddings = matrix_bytes(cfg.vocab_size, cfg.dim, head) + (
        0 if cfg.tie_embeddings else matrix(cfg.vocab_size, cfg.dim)) + (
        matrix(cfg.vocab_size, cfg.dim) if cfg.coarse_head(settings) else 0)
    return embeddings + cfg.dim * NORM_BYTES + cfg.n_layers * layer


def build_size(cfg: ModelConfig, settings: BuildSettings) -> BuildSize:
    weights = weights_bytes(cfg, settings)
    return BuildSize(weights, MODULE_BYTES_BASE + MODULE_BYTES_PER_LAYER * cfg.n_layers,
                     SCRATCH_BYTES + int(SCRATCH_SHARE * weights))


def _existing(folder: Path) -> Path:
    """The folder, or its nearest ancestor that exists (disk_usage needs a real path)."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return candidate
    return folder


def check_room(folder: Path, cfg: ModelConfig, settings: BuildSettings, model: str) -> BuildSize:
    """Raises DiskSpaceError, naming the folder, the bytes needed and the bytes free, if `folder` lacks room
    for the build; else returns the estimate."""
    need = build_size(cfg, settings)
    free = shutil.disk_usage(_existing(folder)).free
    if free < need.total:
        raise DiskSpaceError(
            f"Not enough disk space to build {model}: it needs about {megabytes(need.total)} "
            f"({need.total:,} bytes: {megabytes(need.weights)} of weights in {settings.dtype}, the compiled module "
            f"and room to compile) in {folder}, and only {megabytes(free)} ({free:,} bytes) is free there. Free "
            f"some space (eddy cache list shows the compiled models kept; eddy cache rm deletes them), choose a "
            f"smaller weight type, or set EDDY_CACHE_DIR to a folder on a larger disk.")
    return need
