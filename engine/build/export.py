"""Checkpoint → StreamingLlama → iree-turbine export → IREE compile → .vmfb + .irpa (needs torch)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

import iree.turbine.aot as aot

from ..config import ATTEND_STEP, QUANTISED, BuildSettings, ModelConfig
from ..devices import compile_flags, dot_form
from ..errors import ArtefactError, BuildCancelled
from ..paths import cache_dir
from . import kernels
from .model import StreamingLlama
from .process import tied_to_me

if TYPE_CHECKING:
    from .checkpoint import ModelSource

Progress = Callable[[str, float], None]

def build_model(cfg: ModelConfig, settings: BuildSettings, state: dict[str, torch.Tensor]) -> StreamingLlama:
    """The model with its weights in memory: what the build exported before it streamed the weights, kept as
    the reference the streamed .irpa is tested against (tests/test_streamed_weights.py) and for torch-side
    experiments. The build itself exports StreamingLlama.skeleton."""
    cfg.check_build(settings)
    model = StreamingLlama(cfg, settings)
    model.load_hf(state)
    return model.eval()


def example_args(cfg: ModelConfig, settings: BuildSettings, n: int) -> tuple[torch.Tensor, ...]:
    """(tokens, slots, rope, shift, slot_pos, token_pos) for n new tokens."""
    tables, half = cfg.rope_tables, cfg.head_dim // 2
    return (
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        torch.zeros(tables, 2, n, half),
        torch.zeros(tables, 2, half),
        torch.zeros(settings.slots + cfg.local_ring(settings), dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
    )


def export_module(model: StreamingLlama) -> "aot.ExportOutput":
    cfg, settings = model.cfg, model.settings
    # Bounds are not checked at run time (a longer call silently computes garbage); the runtime chunks.
    n = torch.export.Dim("n", min=1, max=cfg.prefill_bound(settings))
    # The cache's slots a call attends to (model.py: StreamingLlama.hidden), then the local ring's, if any.
    # At least 2 blocks: torch.export takes a dynamic size to be neither 0 nor 1 (and fixes one whose range then
    # holds a single value), so a cache of 1 or 2 blocks is read whole (StreamingEngine.attended).
    blocks, ring = settings.slots // ATTEND_STEP, cfg.local_ring(settings)
    slot_pos = None
    if blocks > 2:
        attended = ATTEND_STEP * torch.export.Dim("blocks", min=2, max=blocks)
        slot_pos = {0: attended + ring if ring else attended}
    dyn = {"tokens": {0: n}, "slots": {0: n}, "rope": {2: n}, "shift": None, "slot_pos": slot_pos, "token_pos": {0: n}}
    fxb = aot.FxProgramsBuilder(model)
    example = example_args(cfg, settings, 2)

    @fxb.export_program(name="prefill", args=example, dynamic_shapes=dyn, strict=False)
    def prefill(m, tokens, slots, rope, shift, slot_pos, token_pos):
        return m.prefill(tokens, slots, rope, shift, slot_pos, token_pos)

    one = {name: None if name != "slot_pos" else slot_pos for name in dyn}

    @fxb.export_program(name="decode", args=example_args(cfg, settings, 1), dynamic_shapes=one, strict=False)
    def decode(m, tokens, slots, rope, shift, slot_pos, token_pos):
        return m.decode(tokens, slots, rope, shift, slot_pos, token_pos)

    @fxb.export_program(
        name="score",
        args=(example[0], example[0].clone(), *example[1:]),
        dynamic_shapes={"targets": {0: n}, **dyn},
        strict=False,
    )
    def score(m, tokens, targets, slots, rope, shift, slot_pos, token_pos):
        return m.score(tokens, targets, slots, rope, shift, slot_pos, token_pos)

    @fxb.export_program(name="reset", args=(), strict=False)
    def reset(m):
        return m.reset()

    @fxb.export_program(name="snapshot", args=(), strict=False)
    def snapshot(m):
        return m.snapshot()

    @fxb.export_program(name="restore", args=tuple(torch.zeros_like(b) for b in model.state()), strict=False)
    def restore(m, *saved):
        return m.restore(*saved)

    # The custom ops are expanded as the programs are imported.
    with kernels.lowering_for(settings.device, dot_form(settings.device, settings.target_cpu)):
        return aot.export(fxb)


def zero_init_cache(mlir: str) -> str:
    """Replaces the cache global's inlined initial value (a dense blob as big as the cache) by a zero splat.

    turbine inlines non-persistent buffers into the MLIR: tens of MB of zeros that make export, the file and
    compilation slow. The blobs live in the trailing `{-# dialect_resources #-}` section, which holds nothing
    else here (the weights are external parameters).
    """
    body = mlir.split("\n{-#", 1)[0]

    def zero(m: re.Match) -> str:  # an integer cache (bfloat16 kept as int16 bits) takes an integer zero
        integer = re.search(r"xi\d+>$", m.group(1))
        return f"dense<{'0' if integer else '0.000000e+00'}> : {m.group(1)}"

    return re.sub(r"dense_resource<__auto\.constant[^>]*> : (tensor<[^>]*>)", zero, body)


# Bytes of exports kept for reuse, the least recently used dropped first: by size, not count, so the test suite's
# many tiny models (kB each) do not push out the default model's (4 MB; the weights are external parameters).
EXPORTS_KEPT_BYTES = 64 << 20


def export_key(cfg: ModelConfig, settings: BuildSettings) -> str:
    """What the exported MLIR depends on: the model's shape and the build settings, but neither its weights (they
    are external parameters) nor the CPU or GPU it is then compiled for (only iree-compile sees those), but for
    the instructions the quantised types' hand-written decode products are written with. Builds that differ in
    just those share one export: the package's two CPU levels, a test suite's models of one shape."""
    from .artefacts import export_code_hash
    from .checkpoint.source import dist_version

    parts = {"config": cfg.to_dict(), "settings": replace(settings, target_cpu="host", gpu_target="").to_dict(),
             # q4's and q8's decode products are written for the target's instructions: CPUs that differ in them
             # differ here.
             "dot_form": dot_form(settings.device, settings.target_cpu) if settings.dtype in QUANTISED else None,
             "export": export_code_hash(),
             "versions": [dist_version(d) for d in ("torch", "iree-turbine", "iree-base-compiler")]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def kept_export(cfg: ModelConfig, settings: BuildSettings) -> Path:
    """Where the export for this shape and these settings is kept (it may not be there yet)."""
    return cache_dir() / "exports" / f"{export_key(cfg, settings)}.mlir"


def write_export(model: StreamingLlama, path: Path, kept: Path) -> None:
    """Writes the model's module as MLIR to `path`: a copy of `kept` if it is there, else a new export, which is
    then kept (written under a temporary name and renamed, so a reader never sees half a file)."""
    if kept.is_file():
        shutil.copyfile(kept, path)
        os.utime(kept)  # recently used: pruned last
        return
    aot.externalize_module_parameters(model)
    output = export_module(model)
    path.write_text(zero_init_cache(str(output.mlir_module)))
    del output
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        part = kept.with_name(f"{kept.name}.{os.getpid()}.part")
        shutil.copyfile(path, part)
        part.replace(kept)
        total = 0
        for f in sorted(kept.parent.glob("*.mlir"), key=lambda f: f.stat().st_mtime, reverse=True):
            total += f.stat().st_size
            if total > EXPORTS_KEPT_BYTES and f != kept:
                f.unlink(missing_ok=True)
    except OSError:
        pass  # a cache that cannot be written costs the next build its export, nothing else


def compile_mlir(mlir_path: Path, vmfb_path: Path, device: str, progress: Progress,
                 should_cancel: Callable[[], bool], expected_s: float, target: str = "") -> None:
    """Runs iree-compile in a subprocess: it can be cancelled, and a crash cannot take the app down."""
    from iree.compiler.tools.binaries import find_tool

    cmd = [find_tool("iree-compile"), str(mlir_path), "-o", str(vmfb_path), *compile_flags(device, target)]
    with tempfile.TemporaryFile() as log:
        # The kernel ends the compiler with whoever started it (see engine/build/process.py): a build child that
        # is killed outright cannot run the code that would end its compiler.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=tied_to_me())
        start = time.perf_counter()
        while proc.poll() is None:
            if should_cancel():
                proc.kill()
                proc.wait()
                raise BuildCancelled("compilation cancelled")
            elapsed = time.perf_counter() - start
            progress("compiling", 0.6 + 0.39 * min(1.0, elapsed / expected_s))
            time.sleep(0.1)
        if proc.returncode:
            log.seek(0)
            lines = log.read().decode(errors="replace").splitlines()
            errors = [line[:400] for line in lines if "error:" in line][:5]
            raise ArtefactError(f"iree-compile failed (exit {proc.returncode}):\n" + "\n".join(errors or lines[-20:]))


def build(source: "ModelSource", cfg: ModelConfig, settings: BuildSettings, out_dir: Path,
          progress: Callable[..., None] | None = None, should_cancel: Callable[[], bool] | None = None) -> dict[str, float]:
    """Writes module.vmfb and weights.irpa into out_dir; returns seconds per stage.

    Memory follows the largest tensor, not the model: the export traces a skeleton whose weights are never
    written (they are external parameters), and weights.irpa is written straight from the checkpoint one
    tensor at a time (engine/build/weights_file.py). progress is an engine.build.progress.Progress."""
    from .checkpoint import open_tensors
    from .progress import REUSED_EXPORT, compile_detail, ignore, weights_detail
    from .weights_file import write_weights

    report = progress or ignore
    cancelled = should_cancel or (lambda: False)
    times: dict[str, float] = {}

    def stage(name: str, fraction: float, detail: str = "") -> float:
        if cancelled():
            raise BuildCancelled(f"cancelled before {name}")
        report(name, fraction, detail)
        return time.perf_counter()

    # "loading weights" now checks the checkpoint's tensors against its config (headers only), so a bad
    # checkpoint fails before the export rather than after it.
    t = stage("loading weights", 0.0)
    cfg.check_build(settings)
    tensors = open_tensors(source)
    model = StreamingLlama.skeleton(cfg, settings)
    times["load"] = time.perf_counter() - t
    kept = kept_export(cfg, settings)
    t = stage("exporting", 0.1, REUSED_EXPORT if kept.is_file() else f"tracing {cfg.n_layers} layers")
    mlir_path = out_dir / "module.mlir"
    write_export(model, mlir_path, kept)
    times["export"] = time.perf_counter() - t

    # Bytes per piece, from the skeleton's parameters (a piece makes its module's weight and q8 scale, or its
    # bias): the embedding alone can be a tenth of a model, so counting pieces alone would stall on it.
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    pieces = model.pieces()
    piece_bytes = [sum(n for name, n in sizes.items() if name.startswith(piece.module + ".")
                       and name.endswith(".bias") == (piece.kind == "bias")) for piece in pieces]
    total_bytes = sum(piece_bytes) if sum(piece_bytes) == sum(sizes.values()) else 0  # else count pieces only
    t = stage("saving weights", 0.5, weights_detail(0, len(pieces), 0, total_bytes))
    written_bytes = 0

    def written(done: int, total: int) -> None:
        nonlocal written_bytes
        if cancelled():
            raise BuildCancelled("cancelled while saving weights")
        if total_bytes and total == len(pieces):
            written_bytes += piece_bytes[done - 1]
            share = written_bytes / total_bytes
        else:
            share = done / total
        report("saving weights", 0.5 + 0.1 * share, weights_detail(done, total, written_bytes, total_bytes))

    write_weights(model, tensors, out_dir / "weights.irpa", written)
    del model, tensors
    times["save"] = time.perf_counter() - t
    # Rough compile time: grows with layers; only drives the progress bar.
    expected = 5.0 + 1.5 * cfg.n_layers
    t = stage("compiling", 0.6, compile_detail(0.0, expected))

    def compiling(name: str, fraction: float) -> None:
        report(name, fraction, compile_detail(time.perf_counter() - t, expected))

    compile_mlir(mlir_path, out_dir / "module.vmfb", settings.device, compiling, cancelled, expected,
                 settings.target)
    mlir_path.unlink()
    times["compile"] = time.perf_counter() - t
    report("done", 1.0, "")
    return times
