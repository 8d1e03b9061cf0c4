"""Checkpoint → StreamingLlama → iree-turbine export → IREE compile → .vmfb + .irpa (needs torch)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

import iree.turbine.aot as aot

from .config import BuildSettings, ModelConfig
from .model import StreamingLlama

if TYPE_CHECKING:
    from .checkpoint import ModelSource

Progress = Callable[[str, float], None]

COMPILE_FLAGS = {
    "cpu": [
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=host",
        # The llvm-cpu defaults prefill ~8x slower: data tiling with microkernels is what makes it fast
        # (data tiling without microkernels is slower than the defaults).
        "--iree-opt-level=O3",
        "--iree-opt-data-tiling",
        "--iree-llvmcpu-enable-ukernels=all",
    ],
    "vulkan": ["--iree-hal-target-device=vulkan", "--iree-vulkan-target=host"],
    # iree-compile 3.13 does not know sm_90 by name; sm_89 code runs on Hopper too.
    "cuda": ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_89"],
}


def build_model(cfg: ModelConfig, settings: BuildSettings, state: dict[str, torch.Tensor]) -> StreamingLlama:
    model = StreamingLlama(cfg, settings)
    model.load_hf(state)
    return model.eval()


def example_args(cfg: ModelConfig, settings: BuildSettings, n: int) -> tuple[torch.Tensor, ...]:
    """(tokens, slots, rope, slot_pos, token_pos) for n new tokens."""
    return (
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        torch.zeros(4, n, cfg.head_dim // 2),
        torch.zeros(settings.capacity, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
    )


def export_module(model: StreamingLlama) -> "aot.ExportOutput":
    cfg, settings = model.cfg, model.settings
    # Bounds are not checked at run time (a longer call silently computes garbage); the runtime chunks.
    n = torch.export.Dim("n", min=1, max=settings.chunk)
    dyn = {"tokens": {0: n}, "slots": {0: n}, "rope": {1: n}, "slot_pos": None, "token_pos": {0: n}}
    fxb = aot.FxProgramsBuilder(model)
    example = example_args(cfg, settings, 2)

    @fxb.export_program(name="prefill", args=example, dynamic_shapes=dyn, strict=False)
    def prefill(m, tokens, slots, rope, slot_pos, token_pos):
        return m.prefill(tokens, slots, rope, slot_pos, token_pos)

    @fxb.export_program(name="decode", args=example_args(cfg, settings, 1), strict=False)
    def decode(m, tokens, slots, rope, slot_pos, token_pos):
        return m.decode(tokens, slots, rope, slot_pos, token_pos)

    @fxb.export_program(
        name="score",
        args=(example[0], example[0].clone(), *example[1:]),
        dynamic_shapes={"targets": {0: n}, **dyn},
        strict=False,
    )
    def score(m, tokens, targets, slots, rope, slot_pos, token_pos):
        return m.score(tokens, targets, slots, rope, slot_pos, token_pos)

    @fxb.export_program(name="reset", args=(), strict=False)
    def reset(m):
        return m.reset()

    return aot.export(fxb)


def build(source: "ModelSource", cfg: ModelConfig, settings: BuildSettings, out_dir: Path,
          progress: Progress | None = None) -> dict[str, float]:
    """Writes module.vmfb and weights.irpa into out_dir; returns seconds per stage."""
    report = progress or (lambda stage, fraction: None)
    times: dict[str, float] = {}
    t = time.perf_counter()
    report("loading weights", 0.0)
    from .checkpoint import load_state_dict

    model = build_model(cfg, settings, load_state_dict(source))
    times["load"] = time.perf_counter() - t
    report("exporting", 0.15)
    t = time.perf_counter()
    aot.externalize_module_parameters(model)
    output = export_module(model)
    times["export"] = time.perf_counter() - t
    report("saving weights", 0.5)
    t = time.perf_counter()
    aot.save_module_parameters(str(out_dir / "weights.irpa"), model)
    times["save"] = time.perf_counter() - t
    report("compiling", 0.55)
    t = time.perf_counter()
    output.session.set_flags(*COMPILE_FLAGS[settings.device])
    output.compile(save_to=str(out_dir / "module.vmfb"))
    times["compile"] = time.perf_counter() - t
    report("done", 1.0)
    return times
