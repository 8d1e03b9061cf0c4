"""What an export and a compiled module depend on: the sources that decide what an export (and so a build) holds and
their hash, part of every artefact's key; the keys of the kept exports and of the modules a build can take from an
earlier one (engine/exporter/export.py). Torch-free: a warm start computes the hash, the build's parent the keys."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from ..config import QUANTISED, BuildSettings, ModelConfig
from ..devices import compile_flags, dot_form, fixed_shapes, host_cpu_flags

# Source files (under engine/) whose content decides what gets compiled: editing them invalidates every entry.
# devices.py holds the iree-compile flags, arch.py the families the model is built from, irpa.py and
# weights_file.py how the weights file is laid out and filled.
# What an export's result depends on: every source of the build (a kernel generator missing from a hand-kept list
# once left its changes out of the key), the devices' flags, the families, the constants and the call shapes.
EXPORT_SOURCES = ("exporter", "checkpoint", "artefacts", "devices.py", "arch.py", "config.py", "shapes.py")


def export_sources() -> list[Path]:
    """The files EXPORT_SOURCES names (a folder: its Python files)."""
    here = Path(__file__).parents[1]
    return [p for name in EXPORT_SOURCES
            for p in (sorted((here / name).rglob("*.py")) if (here / name).is_dir() else [here / name])]


def export_code_hash() -> str:
    here = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in export_sources():
        h.update(str(path.relative_to(here)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def export_key(cfg: ModelConfig, settings: BuildSettings) -> str:
    """What the exported MLIR depends on: the model's shape and the build settings, but neither its weights (they
    are external parameters) nor the CPU or GPU it is then compiled for (only iree-compile sees those), but for
    the instructions the quantised types' hand-written decode products are written with and whether a GPU target
    takes fixed shapes. Builds that differ in just those share one export: the package's two CPU levels, a test
    suite's models of one shape."""
    from ..checkpoint.source import dist_version

    parts = {"config": cfg.to_dict(), "settings": replace(settings, target_cpu="host", gpu_target="").to_dict(),
             # q4's and q8's decode products are written for the target's instructions: CPUs that differ in them
             # differ here.
             "dot_form": dot_form(settings.device, settings.target_cpu) if settings.dtype in QUANTISED else None,
             # Most GPU targets take programs of fixed shapes, a few dynamic ones (devices.DYNAMIC_TARGETS).
             "fixed_shapes": fixed_shapes(settings.device, settings.target),
             "export": export_code_hash(),
             "versions": [dist_version(d) for d in ("torch", "iree-turbine", "iree-base-compiler")]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def module_key(cfg: ModelConfig, settings: BuildSettings) -> str:
    """What the compiled module depends on: its export (export_key) and what iree-compile is told, the device and
    its target, which for a "host" CPU is this CPU's features. Not the weights: a fine-tune, or another file of a
    model already built here, takes the module of that build (store.built_module) and writes only its weights."""
    from ..checkpoint.source import dist_version

    host = settings.device == "cpu" and settings.target_cpu == "host"
    parts = {"export": export_key(cfg, settings), "flags": compile_flags(settings.device, settings.target),
             "host": sorted(host_cpu_flags()) if host else None, "compiler": dist_version("iree-base-compiler")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
