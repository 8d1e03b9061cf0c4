"""Checkpoint → StreamingLlama → iree-turbine export → IREE compile → .vmfb + .irpa (needs torch)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

import iree.turbine.aot as aot
from iree.turbine.aot.compiled_module import ExportTargetDef

from ..config import ATTEND_STEP, REFINED_ROWS, BuildSettings, ModelConfig
from ..devices import TABLE, compile_flags, dot_form
from ..errors import ArtefactError, BuildCancelled
from ..paths import artefacts_root, cache_dir
from ..shapes import score_name
from . import kernels
from .kernels import prefill_products
from ..artefacts.export_code import export_key
from .layers import export_repeated, probe
from .model import StreamingLlama
from .child import tied_to_me

if TYPE_CHECKING:
    from ..checkpoint import ModelSource
    from ..artefacts.progress import BuildClock

Progress = Callable[[str, float], None]

def build_model(cfg: ModelConfig, settings: BuildSettings, state: dict[str, torch.Tensor]) -> StreamingLlama:
    """The model with its weights in memory: what the build exported before it streamed the weights, kept as
    the reference the streamed .irpa is tested against (tests/test_streamed_weights.py) and for torch-side
    experiments. The build itself exports StreamingLlama.skeleton."""
    cfg.check_build(settings)
    model = StreamingLlama(cfg, settings)
    model.load_hf(state)
    return model.eval()


def example_args(cfg: ModelConfig, settings: BuildSettings, n: int, attended: int = 0) -> tuple[torch.Tensor, ...]:
    """(tokens, slots, rope, shift, slot_pos, token_pos) for n new tokens attending to `attended` slots (0: all)."""
    tables, half = cfg.rope_tables, cfg.head_dim // 2
    return (
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        torch.zeros(tables, 2, n, half),
        torch.zeros(tables, 2, half),
        torch.zeros((attended or settings.slots) + cfg.local_ring(settings), dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
    )


class _Entry(torch.nn.Module):
    """One entry point of the module: the model under the name `root`, as turbine's FxProgramsBuilder holds it, so
    every program reads the same parameters and buffers (one global each in the MLIR)."""

    def __init__(self, root: StreamingLlama) -> None:
        super().__init__()
        self.root = root


class _Prefill(_Entry):
    def forward(self, tokens, slots, rope, shift, slot_pos, token_pos):
        return self.root.prefill(tokens, slots, rope, shift, slot_pos, token_pos)


class _Decode(_Entry):
    def forward(self, tokens, slots, rope, shift, slot_pos, token_pos):
        return self.root.decode(tokens, slots, rope, shift, slot_pos, token_pos)


class _Score(_Entry):
    def forward(self, targets):
        return self.root.score(targets)


class _Refine(_Entry):
    def forward(self, ids):
        return self.root.refine(ids)


class _Reset(_Entry):
    def forward(self):
        return self.root.reset()


class _Snapshot(_Entry):
    def forward(self):
        return self.root.snapshot()


class _Restore(_Entry):
    def forward(self, *saved):
        return self.root.restore(*saved)


def _trace(fxb: "aot.FxProgramsBuilder", name: str, entry: _Entry, args: tuple, dynamic_shapes: dict | None = None,
           one_pass: bool = True, layers: str = "repeat") -> None:
    """Traces one entry point to functional ATen. turbine's export_program runs torch.export.export (pre-dispatch
    ATen, not yet functional) and then run_decompositions, which traces the whole model a second time: a third
    of a 1B model's build. `one_pass` goes straight there (torch's own former default, kept as
    `_export(pre_dispatch=False)`; torch is pinned): the same program with some ops left whole (full for empty +
    fill, _to_copy for convert_element_type), which the CPU lowers alike and the parity tests hold to the same
    logits. IREE's GPU pipeline failed on the one-pass decode's attention (a reduction over dynamic slots with
    a negative read range), so GPU builds of dynamic shapes keep the two passes."""
    def run() -> torch.export.ExportedProgram:
        if one_pass:
            from torch.export._trace import _export

            return _export(entry, args, None, dynamic_shapes or None, strict=False, pre_dispatch=False)
        from iree.turbine.aot.decompositions import current_aot_decompositions

        program = torch.export.export(entry, args, dynamic_shapes=dynamic_shapes or None, strict=False)
        return program.run_decompositions(current_aot_decompositions())

    # Through a few layers, the rest copied (engine/exporter/layers.py; LAYERS).
    program = run() if layers == "all" else export_repeated(entry.root, run, strict=layers == "must-repeat")
    fxb.programs[name] = ExportTargetDef(program)


# How an export traces the layers: "repeat" a few traced, the rest copied (or all traced where the copy does not
# match), "all" traced, or "must-repeat": copied, or the export fails (tests/test_repeated_layers.py).
LAYERS = ("repeat", "all", "must-repeat")


def export_module(model: StreamingLlama, layers: str = "repeat") -> "aot.ExportOutput":
    assert layers in LAYERS, layers
    with _no_stack_traces():
        return _export_module(model, functools.partial(_trace, layers=layers))


def _export_module(model: StreamingLlama, trace: Callable[..., None]) -> "aot.ExportOutput":
    cfg, settings = model.cfg, model.settings
    fxb = aot.FxProgramsBuilder(model)
    # One pass where it serves (_trace): not for IREE's fused attention, which it decomposes into matmuls (it keeps
    # scaled_dot_product_attention only through the second pass's decompositions), nor for a GPU's dynamic shapes.
    one_pass = settings.device == "cpu" or (model.shapes is not None and TABLE[settings.device].attention != "fused")
    if model.shapes:  # a program per call shape (engine/shapes.py)
        for name, n, attended in model.shapes.programs():
            entry = (_Decode if name.startswith("decode") else _Prefill)(model)
            trace(fxb, name, entry, example_args(cfg, settings, n, attended), one_pass=one_pass)
        for n in model.shapes.chunks:
            trace(fxb, score_name(n), _Score(model), (torch.zeros(n, dtype=torch.int64),), one_pass=one_pass)
    else:
        _trace_dynamic(fxb, model, trace)
    if model.coarse_head is not None:
        trace(fxb, "refine", _Refine(model), (torch.zeros(REFINED_ROWS, dtype=torch.int64),), one_pass=one_pass)
    trace(fxb, "reset", _Reset(model), (), one_pass=one_pass)
    trace(fxb, "snapshot", _Snapshot(model), (), one_pass=one_pass)
    trace(fxb, "restore", _Restore(model), tuple(torch.zeros_like(b) for b in model.state()), one_pass=one_pass)

    # The custom ops are expanded as the programs are imported.
    plan = kernels.KernelPlan.of(settings.device, dot_form(settings.device, settings.target_cpu),
                                 prefill_products.x_steps(cfg.dim))
    _remember_missing_dialects()
    with kernels.lowering(plan):
        return aot.export(fxb)


def _remember_missing_dialects() -> None:
    """MLIR's Python bindings look for a module of each op's dialect every time they wrap one, and do not remember a
    miss: the torch dialects have none in iree.compiler, and a 1B export tried to import them 40,000 times (0.6 s
    of its 4). An empty module is found once and remembered; nothing else imports these names."""
    import importlib.util
    import sys
    import types

    for name in ("iree.compiler.dialects.torch", "iree.compiler.dialects.torch_c"):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """FX records the Python stack of every node it traces (a quarter of a 1B's trace: 3.5 s of 15); the MLIR
    turbine writes is the same without them."""
    import torch.fx.config

    was = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = was


def _trace_dynamic(fxb: "aot.FxProgramsBuilder", model: StreamingLlama, trace: Callable[..., None]) -> None:
    """prefill and decode, each one program of dynamic shapes: any token count up to the prefill bound, any
    whole number of blocks of attended slots."""
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
    one = {name: None if name != "slot_pos" else slot_pos for name in dyn}
    cpu = settings.device == "cpu"
    trace(fxb, "prefill", _Prefill(model), example_args(cfg, settings, 2), dyn, one_pass=cpu)
    trace(fxb, "decode", _Decode(model), example_args(cfg, settings, 1), one, one_pass=cpu)
    trace(fxb, "score", _Score(model), (torch.zeros(2, dtype=torch.int64),), {"targets": {0: n}}, one_pass=cpu)


def export_text(output: "aot.ExportOutput") -> str:
    """The export as MLIR text, its cache's initial value a zero splat (zero_init_cache). Printed whole, the
    inlined buffers' zeros (the cache, the sinks, the rows `score` reads: 38 MB at 1B) came as 77 MB of hex that
    zero_init_cache then cut away; printed elided, the text is the same without them (0.06 s instead of 0.22)."""
    return zero_init_cache(output.mlir_module.operation.get_asm(large_resource_limit=64))


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
    path.write_text(export_text(output))
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
        # The kernel ends the compiler with whoever started it (see engine/exporter/process.py): a build child that
        # is killed outright cannot run the code that would end its compiler.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=tied_to_me())
        start = time.perf_counter()
        try:
            while proc.poll() is None:
                if should_cancel():
                    raise BuildCancelled("compilation cancelled")
                elapsed = time.perf_counter() - start
                progress("compiling", 0.6 + 0.39 * min(1.0, elapsed / expected_s))  # may raise: the build failed
                time.sleep(0.1)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode:
            log.seek(0)
            lines = log.read().decode(errors="replace").splitlines()
            errors = [line[:400] for line in lines if "error:" in line][:5]
            raise ArtefactError(f"iree-compile failed (exit {proc.returncode}):\n" + "\n".join(errors or lines[-20:]))


def expected_times(cfg: ModelConfig, settings: BuildSettings, weights_bytes: int,
                   reused_export: bool, reused_module: bool = False) -> dict[str, float]:
    """What each part of this build should take here, from the builds this machine has made."""
    from ..artefacts.progress import Expected, traced_layers

    manifests = []
    for f in artefacts_root().glob("*/manifest.json"):
        try:
            manifests.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return Expected.from_manifests(manifests).seconds(traced_layers(cfg.to_dict(), settings.to_dict()),
                                                      weights_bytes, reused_export, reused_module)


def _take_module(built: Path, out: Path) -> None:
    """The module of an earlier build as `out`: a hard link where the file system has them (no second copy on
    disk; deleting either entry leaves the other's), else a copy."""
    try:
        os.link(built, out)
    except OSError:
        shutil.copyfile(built, out)


class _SideJob:
    """engine/exporter/side_job.py seen from the build child: its answers read on a thread into the clock and the
    stage reports. An error there is raised here as the same class at the next check: after the export at the
    latest (which nothing interrupts; the weights used to start only after it), while compiling at once."""

    def __init__(self, proc: subprocess.Popen, clock: "BuildClock", say: Callable[[str, str], None]) -> None:
        self.clock, self._say = clock, say
        self.result: dict | None = None
        self.error: Exception | None = None
        self._proc = proc
        self._reader = threading.Thread(target=self._read, name="side-job", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        from .child import error_from
        from ..artefacts.progress import finished, weights_detail

        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if "weights" in msg:
                done, pieces, written, total = msg["weights"]
                self.clock.share("save", written / total if total else done / max(1, pieces))
                self._say("saving weights", weights_detail(done, pieces, written, total))
                if done == pieces:
                    self._say("saving weights", finished(self.clock.end("save")))
                    self.clock.begin("tokenizer")
            elif "done" in msg:
                self.clock.end("tokenizer")
                self.result = msg["done"]
            elif "error" in msg:
                self.error = error_from(msg["error"], "writing the weights failed")
                return
        if self._proc.wait() and self.error is None:
            self.error = ArtefactError(f"writing the weights file failed (exit {self._proc.returncode})")

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self, should_cancel: Callable[[], bool]) -> dict:
        while self._reader.is_alive():
            if should_cancel():
                raise BuildCancelled("cancelled while saving weights")
            self._reader.join(0.1)
        self.check()
        assert self.result is not None
        return self.result

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reader.join(timeout=5)


def _export_and_compile(model: StreamingLlama, settings: BuildSettings, out_dir: Path, kept: Path,
                        clock: "BuildClock", half: _SideJob, say: Callable[[str, str], None],
                        cancelled: Callable[[], bool]) -> dict[str, float]:
    """The export (or the kept one) and iree-compile, into out_dir / "module.vmfb": their seconds."""
    from ..artefacts.progress import compile_detail, finished

    times = {}
    mlir_path = out_dir / "module.mlir"
    write_export(model, mlir_path, kept)
    times["export"] = clock.end("export")
    say("exporting", finished(times["export"]))
    half.check()
    if cancelled():
        raise BuildCancelled("cancelled before compiling")
    clock.begin("compile")
    t = time.perf_counter()
    expected = clock.expected("compile")

    def compiling(name: str, fraction: float) -> None:
        half.check()
        say("compiling", compile_detail(time.perf_counter() - t, expected))

    compile_mlir(mlir_path, out_dir / "module.vmfb", settings.device, compiling, cancelled, expected, settings.target)
    mlir_path.unlink()
    times["compile"] = clock.end("compile")
    say("compiling", finished(times["compile"]))
    return times


def build(source: "ModelSource", cfg: ModelConfig, settings: BuildSettings, out_dir: Path,
          progress: Callable[..., None] | None = None, should_cancel: Callable[[], bool] | None = None,
          side: subprocess.Popen | None = None, module: Path | None = None) -> dict[str, float]:
    """Writes module.vmfb, weights.irpa and the tokenizer files into out_dir; returns seconds per stage.

    The export and then iree-compile run here while a second process (engine/exporter/side_job.py) writes the
    weights file and the tokenizer: the two halves share nothing but the checkpoint's shape, and on two cores
    the build takes the longer of the two rather than their sum.

    Memory follows the largest tensor, not the model: the export traces a skeleton whose weights are never
    written (they are external parameters), and weights.irpa is written straight from the checkpoint one
    tensor at a time (engine/exporter/weights_file.py). progress is an engine.artefacts.progress.Progress; `side`, the
    side job already started for this build (engine/exporter/process.py starts it before importing torch); `module`,
    a module.vmfb built before from the same export and compiler flags (store.built_module, which the parent looks
    up), taken instead of an export and a compile."""
    from . import side_job
    from ..checkpoint import open_tensors
    from ..artefacts.progress import REUSED_EXPORT, REUSED_MODULE, BuildClock, finished, ignore

    report = progress or ignore
    cancelled = should_cancel or (lambda: False)
    times: dict[str, float] = {}
    lock = threading.Lock()
    if side is None:
        side = side_job.start({"source": {"name": source.name, "kind": source.kind,
                                          "path": str(source.path) if source.path else None},
                               "settings": settings.to_dict(), "out": str(out_dir),
                               "module": str(module) if module else None})
    try:
        # "loading weights" checks the checkpoint's tensors against its config (headers only), so a bad
        # checkpoint fails before anything else is spent on it.
        if cancelled():
            raise BuildCancelled("cancelled before loading weights")
        report("loading weights", 0.0, "")
        t = time.perf_counter()
        cfg.check_build(settings)
        open_tensors(source)
        model = StreamingLlama.skeleton(cfg, settings)
        times["load"] = time.perf_counter() - t
    except BaseException:
        side.kill()
        side.wait()
        raise
    kept = kept_export(cfg, settings)
    clock = BuildClock(expected_times(cfg, settings, side_job.piece_bytes(model)[1], kept.is_file(),
                                      module is not None))

    def say(stage: str, detail: str) -> None:
        with lock:
            report(stage, clock.fraction(), detail)

    # Said before the side job's answers are read: the stages start in STAGES' order, whichever runs faster.
    clock.begin("export")
    traced = len(probe(model)[1])
    say("exporting", REUSED_MODULE if module else REUSED_EXPORT if kept.is_file()
        else f"tracing {traced} of {cfg.n_layers} layers" if traced < cfg.n_layers else f"tracing {traced} layers")
    half = _SideJob(side, clock, say)
    try:
        if module is not None:
            # Only the weights and the tokenizer are this model's own: no export, no compiler. Times without a
            # "compile" say so to the next build's estimate (progress.Expected).
            _take_module(module, out_dir / "module.vmfb")
            times["export"] = clock.end("export")
            clock.end("compile")
            say("exporting", finished(times["export"]))
            say("compiling", finished(0.0))
        else:
            times.update(_export_and_compile(model, settings, out_dir, kept, clock, half, say, cancelled))
        del model
        times.update(half.wait(cancelled))
    except BaseException:
        half.stop()
        raise
    half.stop()
    report("done", 1.0, "")
    return times
