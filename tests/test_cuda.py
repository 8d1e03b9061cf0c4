"""The cuda device on a machine without one: a build cross-compiles for a named CUDA target, a missing GPU is a
sentence (at build time without a target, at run time always), and the app falls back to the CPU and says so.

Where this machine has an NVIDIA GPU the same tests check the other side instead: the target is taken from it
and the module runs there with the CPU module's logits. On the lent GPU machine, bench/gpu_check.py does the rest.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from conftest import ROOT, TINY_SETTINGS

from engine.config import BuildSettings
from engine.devices import CUDA_TARGETS, compile_flags, cuda_target_for
from engine.errors import DeviceError
from engine.gpu import cuda_gpus, device_choices, probe, resolve_target, runnable

CUDA_TINY = replace(TINY_SETTINGS, device="cuda", gpu_target="sm_89")
ADD = """func.func @f(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.addf %a, %b : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def _iree_compile(tmp_path, target: str) -> subprocess.CompletedProcess:
    from iree.compiler.tools.binaries import find_tool

    src = tmp_path / "add.mlir"
    src.write_text(ADD)
    return subprocess.run([find_tool("iree-compile"), str(src), "-o", str(tmp_path / f"{target}.vmfb"),
                           *compile_flags("cuda", target)], capture_output=True, text=True, timeout=120)


def test_every_listed_cuda_target_is_one_iree_compile_knows(tmp_path):
    for target in CUDA_TARGETS:
        proc = _iree_compile(tmp_path, target)
        assert proc.returncode == 0, (target, proc.stderr[-500:])
    # Why Hopper is built for sm_89: this compiler has no sm_90 of its own. If that changes, sm_90 belongs
    # in CUDA_TARGETS.
    assert _iree_compile(tmp_path, "sm_90").returncode != 0


def test_a_gpu_gets_the_newest_target_not_newer_than_itself():
    assert cuda_target_for(9, 0) == "sm_89"  # H100, H200
    assert cuda_target_for(8, 6) == "sm_86"
    assert cuda_target_for(8, 9) == "sm_89"
    assert cuda_target_for(10, 0) == "sm_89"  # B200: PTX runs forward
    assert cuda_target_for(12, 0) == "sm_120"
    with pytest.raises(ValueError, match="5.2"):
        cuda_target_for(5, 2)


def test_gpu_target_is_a_checked_build_setting_in_the_key():
    from engine.artefacts.store import artefact_key
    from engine.checkpoint import resolve_model

    with pytest.raises(ValueError, match="sm_89 code"):
        BuildSettings(device="cuda", gpu_target="sm_90")
    with pytest.raises(ValueError, match="is for a GPU device"):
        BuildSettings(gpu_target="sm_89")
    source = resolve_model("tiny-random")
    keys = {artefact_key(source, BuildSettings(device="cuda", gpu_target=t)) for t in ("sm_80", "sm_89")}
    assert len(keys) == 2 and artefact_key(source, BuildSettings()) not in keys
    assert compile_flags("cuda", "sm_80")[-1] == "--iree-cuda-target=sm_80"
    with pytest.raises(ValueError, match="--gpu-target"):
        compile_flags("cuda")
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "compile", "--device", "cuda", "--gpu-target", "sm_90"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--gpu-target" in proc.stderr


def test_a_cuda_build_without_a_target_takes_this_machines_gpu_or_says_how_to_name_one():
    gpus, why = probe()
    settings = BuildSettings(device="cuda")
    if gpus:
        assert resolve_target(settings).gpu_target == gpus[0].target
        assert runnable(settings) == (settings, "")
        return
    assert why
    with pytest.raises(DeviceError, match="--gpu-target sm_89"):
        resolve_target(settings)
    assert runnable(settings) == (BuildSettings(), f"cuda chosen, but {why}")
    from engine.gpu import vulkan_probe

    assert [(name, available) for name, _, available in device_choices()] == [
        ("cpu", True), ("vulkan", bool(vulkan_probe()[0])), ("cuda", False)]
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "compile", "--model", "tiny-random", "--device", "cuda"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--gpu-target" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def cuda_tiny_folder():
    from engine.artefacts.store import ensure_artefacts
    from engine.checkpoint import resolve_model

    return ensure_artefacts(resolve_model("tiny-random"), CUDA_TINY)


def test_the_cuda_build_cross_compiles_for_the_named_target(cuda_tiny_folder):
    from engine.artefacts.store import read_manifest

    manifest = read_manifest(cuda_tiny_folder, full=True)
    assert manifest["settings"]["device"] == "cuda" and manifest["settings"]["gpu_target"] == "sm_89"
    vmfb = (cuda_tiny_folder / "module.vmfb").read_bytes()
    assert b".target sm_89" in vmfb  # the PTX the driver compiles for the GPU at load
    assert b"embedded-elf" not in vmfb  # and no CPU code beside it


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-gemma3"])
def test_the_cuda_programs_compiled_for_the_cpu_give_the_cpu_builds_logits(name, tmp_path):
    """What a cuda build computes, checked without a GPU: its export (fixed call shapes, padding, IREE's fused
    attention op a layer, decode's split over blocks of slots and joined) compiled for this CPU instead, run through
    the same host code, against the CPU build (tests/fixed_shapes.py). Only the CUDA code generation itself is left
    to a device (bench/gpu_check.py)."""
    import shutil

    from engine.artefacts.store import ensure_artefacts, read_manifest
    from engine.checkpoint import resolve_model
    from engine.exporter.export import compile_mlir, kept_export
    from engine.config import ModelConfig
    from engine.loader import open_model
    from engine.run.runtime import CompiledModule, StreamingEngine
    from fixed_shapes import same_calls

    source = resolve_model(name)
    settings = CUDA_TINY.for_source(source)
    folder = ensure_artefacts(source, settings)
    cfg = ModelConfig(**read_manifest(folder)["config"])
    mlir = kept_export(cfg, settings)
    assert b"torch.aten.scaled_dot_product_attention" in mlir.read_bytes()  # IREE's fused op, one a layer
    assert b"iree_linalg_ext.online_attention" in mlir.read_bytes()  # its partial form: decode in splits
    compile_mlir(mlir, tmp_path / "module.vmfb", "cpu", lambda *_: None, lambda: False, 60, "host")
    shutil.copyfile(folder / "weights.irpa", tmp_path / "weights.irpa")
    gpu = StreamingEngine(CompiledModule(tmp_path, replace(settings, device="cpu", gpu_target="")), cfg, settings)
    same_calls(gpu, open_model(name, TINY_SETTINGS).engine)


def test_the_cuda_q4_programs_compiled_for_the_cpu_give_the_cpus_generic_products(tmp_path):
    """q4 on cuda: prefill's product widens the codes to float16 inside its own dispatch and multiplies them with x
    rounded to float16 (Device.q4_rows_fused, matrix_units: the tensor cores), a form no other device takes. Its
    export compiled for this CPU gives, in every program, the logits of the generic float32 products (a CPU build
    for x86-64-v2, which has no hand-written integer form) within 1e-3: float16's rounding of x and of the weights
    (measured 2.6e-4; the product alone is held to its exact meaning in tests/test_q4.py)."""
    import shutil

    from engine.artefacts.store import ensure_artefacts, read_manifest
    from engine.checkpoint import resolve_model
    from engine.config import ModelConfig
    from engine.exporter.export import compile_mlir, kept_export
    from engine.loader import open_model
    from engine.run.runtime import CompiledModule, StreamingEngine
    from fixed_shapes import same_calls

    source = resolve_model("tiny-random")
    settings = replace(CUDA_TINY, dtype="q4").for_source(source)
    folder = ensure_artefacts(source, settings)
    cfg = ModelConfig(**read_manifest(folder)["config"])
    mlir = kept_export(cfg, settings)
    assert b"_one_h(" in mlir.read_bytes()  # the fused form, in float16 (kernels/q4_products.py, _MM_Q4_ONE)
    compile_mlir(mlir, tmp_path / "module.vmfb", "cpu", lambda *_: None, lambda: False, 60, "host")
    shutil.copyfile(folder / "weights.irpa", tmp_path / "weights.irpa")
    gpu = StreamingEngine(CompiledModule(tmp_path, replace(settings, device="cpu", gpu_target="")), cfg, settings)
    same_calls(gpu, open_model("tiny-random", replace(TINY_SETTINGS, dtype="q4", target_cpu="x86-64-v2")).engine, 1e-3)


def test_the_cuda_module_runs_only_where_there_is_a_gpu(cuda_tiny_folder, tiny):
    from engine.loader import open_folder

    if not cuda_gpus():
        with pytest.raises(DeviceError, match="built for an NVIDIA GPU .* --device cpu"):
            open_folder(cuda_tiny_folder)
        return
    gpu_model = open_folder(cuda_tiny_folder)
    ids = list(range(3, 19))
    tiny.engine.reset()
    np.testing.assert_allclose(gpu_model.engine.prefill(ids), tiny.engine.prefill(ids), atol=1e-4)


def test_a_child_eddy_gets_the_same_build_from_its_flags():
    """`eddy bench`'s cold start runs `eddy chat` with the build's own flags (a cuda build's target among them)."""
    from engine.build_flags import build_arguments, settings_from
    from engine.cli import parser

    for settings in (BuildSettings(), BuildSettings(sinks=2, window=100, dtype="f16", kv_dtype="f16", device="cuda",
                                                    gpu_target="sm_80", max_sinks=32, max_chunk=512),
                     BuildSettings(target_cpu="x86-64-v3")):
        assert settings_from(parser().parse_args(["chat", *build_arguments(settings)])) == settings
