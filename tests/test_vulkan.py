"""The vulkan device, run where there is one: Mesa's lavapipe (a Vulkan device on the CPU) in CI and here, a GPU
elsewhere. A vulkan build of tiny-random gives the CPU build's logits (f32, 1e-4) through prefill, decode and a
window that slides; `eddy chat --device vulkan` answers; a build's Vulkan target comes from the device's name.

Without a Vulkan device (no loader, or no driver) the build-and-run tests say how to get lavapipe: `.ci/run`
installs it where it can.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TINY_SETTINGS
from fixed_shapes import same_calls

from engine.config import BuildSettings
from engine.devices import VULKAN_PORTABLE, VULKAN_TARGETS, compile_flags, vulkan_target_for
from engine.gpu import device_choices, resolve_target, vulkan_probe

LAVAPIPE = "apt-get install mesa-vulkan-drivers libvulkan1"


def _need_a_vulkan_device() -> None:
    if not vulkan_probe()[0]:
        pytest.skip(f"no Vulkan device here ({vulkan_probe()[1]}); Mesa's lavapipe is one: {LAVAPIPE}")


def test_a_vulkan_target_comes_from_the_devices_name():
    assert vulkan_target_for("llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe Mesa 22.3.6 (LLVM 15.0.6))") == "llvmpipe"
    assert vulkan_target_for("NVIDIA GeForce RTX 4090") == "ada"
    assert vulkan_target_for("NVIDIA GeForce RTX 3060") == "ampere"
    assert vulkan_target_for("Tesla T4") == "turing" and vulkan_target_for("NVIDIA H200") == "ada"
    assert vulkan_target_for("AMD Radeon RX 7900 XTX (RADV NAVI31)") == "rdna3"
    assert vulkan_target_for("Intel(R) Arc(tm) A770 Graphics (DG2)") == VULKAN_PORTABLE
    assert compile_flags("vulkan", "rdna3")[-1] == "--iree-vulkan-target=rdna3"
    with pytest.raises(ValueError, match="--gpu-target"):
        compile_flags("vulkan")
    with pytest.raises(ValueError, match="vulkan GPU target must be one of"):
        BuildSettings(device="vulkan", gpu_target="sm_89")
    with pytest.raises(ValueError, match="is for a GPU device"):
        BuildSettings(gpu_target="rdna3")


def test_every_listed_vulkan_target_is_one_iree_compile_knows(tmp_path):
    from iree.compiler.tools.binaries import find_tool

    src = tmp_path / "add.mlir"
    src.write_text("func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
                   "  %0 = arith.addf %a, %a : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}\n")
    for target in VULKAN_TARGETS:
        proc = subprocess.run([find_tool("iree-compile"), str(src), "-o", str(tmp_path / f"{target}.vmfb"),
                               *compile_flags("vulkan", target)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (target, proc.stderr[-500:])


def test_settings_offer_vulkan_where_there_is_a_device():
    gpus, why = vulkan_probe()
    vulkan = next(c for c in device_choices() if c[0] == "vulkan")
    assert vulkan[2] == bool(gpus)
    assert (gpus[0].name.split(" (")[0] in vulkan[1]) if gpus else ("no Vulkan device" in vulkan[1] and why)


@pytest.fixture(scope="module")
def vulkan_tiny():
    _need_a_vulkan_device()
    from engine.loader import open_model

    settings = resolve_target(replace(TINY_SETTINGS, device="vulkan"))
    return open_model("tiny-random", settings)


def test_the_vulkan_build_gives_the_cpu_builds_logits(vulkan_tiny, tiny):
    """Prefill in chunks, decode, a second turn, and past the window (capacity 64): every logit within 1e-4."""
    assert vulkan_tiny.engine.settings.gpu_target == vulkan_target_for(vulkan_probe()[0][0].name)
    ids = [int(i) for i in np.random.RandomState(7).randint(0, 49152, 90)]
    got, want = [], []
    for eng, out in ((vulkan_tiny.engine, got), (tiny.engine, want)):
        eng.reset()
        out.append(eng.prefill(ids[:40]))
        out += [eng.decode(t) for t in ids[40:50]]
        out.append(eng.prefill(ids[50:90]))  # past capacity: the window has slid
        out.append(eng.decode(ids[0]))
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.abs(g - w).max() < 1e-4, (i, float(np.abs(g - w).max()))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_fixed_shape_module_pads_and_buckets_to_the_cpu_builds_logits(family, vulkan_tiny, tiny):
    """A GPU build holds a program per chunk size and attended-slot bucket (engine/shapes.py): every program, every
    padded length, a sliding window, scoring, a snapshot and a rewind give the CPU build's numbers
    (tests/fixed_shapes.py). Gemma 3's local layers keep their own ring, where padded tokens have a spare slot."""
    from engine.loader import open_model

    if family == "llama":
        gpu, cpu = vulkan_tiny.engine, tiny.engine
    else:
        name = f"tiny-random-{family}"
        gpu = open_model(name, resolve_target(replace(TINY_SETTINGS, device="vulkan"))).engine
        cpu = open_model(name, TINY_SETTINGS).engine
    same_calls(gpu, cpu)


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_the_vulkan_quantised_build_gives_the_cpus_generic_products(dtype, vulkan_tiny):
    """q8 (a folder's default) and q4 (a 4-bit GGUF's): the GPU's products are the generic ones, which a CPU build
    for x86-64-v2 also takes (no hand-written integer form there): the same arithmetic, within 1e-4. q4's decode
    product reads the codes a byte at a time off the CPU (kernels/q4_products.py, _MV_Q4_BYTES): the CPU's form, which takes each
    code's shift from the loop's indices, did not compile for SPIR-V."""
    from engine.loader import open_model

    quantised = replace(TINY_SETTINGS, dtype=dtype)
    gpu = open_model("tiny-random", resolve_target(replace(quantised, device="vulkan"))).engine
    cpu = open_model("tiny-random", replace(quantised, target_cpu="x86-64-v2")).engine
    ids = [int(i) for i in np.random.RandomState(8).randint(0, 49152, 30)]
    for eng in (gpu, cpu):
        eng.reset()
    assert np.abs(gpu.prefill(ids[:20]) - cpu.prefill(ids[:20])).max() < 1e-4
    for t in ids[20:]:
        assert np.abs(gpu.decode(t) - cpu.decode(t)).max() < 1e-4


def test_the_vulkan_f16_build_gives_the_cpu_builds_logits(vulkan_tiny):
    """float16 weights and a float16 cache, which vulkan's attention kernel reads as stored (gpu_attention.py): prefill,
    decode and prefill again within 1e-4 of the CPU build's logits."""
    from engine.loader import open_model

    half = replace(TINY_SETTINGS, dtype="f16")
    gpu = open_model("tiny-random", resolve_target(replace(half, device="vulkan"))).engine
    cpu = open_model("tiny-random", half).engine
    assert gpu.settings.kv_dtype == cpu.settings.kv_dtype == "f16"
    ids = [int(i) for i in np.random.RandomState(6).randint(0, 49152, 50)]
    for eng in (gpu, cpu):
        eng.reset()
    calls = [lambda e: e.prefill(ids[:20]), *(lambda e, t=t: e.decode(t) for t in ids[20:26]),
             lambda e: e.prefill(ids[26:50])]
    for call in calls:
        got, want = call(gpu), call(cpu)
        assert np.abs(got - want).max() < 1e-4, float(np.abs(got - want).max())


# (query rows, kv heads, query heads per kv head, head_dim, the layer's slots, slots attended, cache type, soft cap):
# decode over a full cache and over slots that end mid-tile (both split over the slots: gpu_attention.splits), prefill
# rows under a causal mask (one split, and 4 rows of 8 heads: split), the head sizes of real checkpoints (Phi-3's 96,
# Qwen3's 128, Gemma's 256) and Gemma 2's cap.
ATTENTION_CASES = [(1, 3, 3, 64, 1025, 1024, "f16", None), (1, 2, 4, 128, 301, 290, "f32", 50.0),
                   (8, 2, 4, 128, 129, 112, "f32", None), (4, 2, 2, 96, 65, 48, "f16", 50.0),
                   (4, 2, 4, 64, 257, 250, "f16", None), (3, 1, 4, 256, 33, 32, "f16", None)]


def test_a_decode_splits_its_slots_and_a_prefill_of_many_rows_does_not():
    """gpu_attention.splits: the default model's 9 heads over 1024 slots in 16 splits of a tile, an 8B's 32 heads of
    128 in 8; 63 rows of 9 heads have workgroups enough (one split); the last split never empty."""
    from engine.exporter.kernels.gpu_attention import splits

    assert splits(1, 9, 1024, 64) == (16, 64)
    assert splits(1, 32, 1024, 128) == (8, 128)
    assert splits(63, 9, 1024, 64) == (1, 1024)
    count, per = splits(1, 9, 8188, 64)
    assert per % 64 == 0 and (count - 1) * per < 8188 <= count * per


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"d{c[3]}-{c[6]}-n{c[0]}-c{c[5]}")
def test_vulkans_attention_kernel_computes_its_meaning(case, tmp_path):
    """kernels.attend_one_dispatch (gpu_attention.py), vulkan's attention in one dispatch a layer (two where it splits
    the slots), alone on lavapipe against its torch meaning (within 1e-5): slots masked one by one, a tile's worth
    across two tiles and a whole tile (a split of its own in a decode), padding slots past those attended that it must
    not read."""
    _need_a_vulkan_device()
    import iree.turbine.aot as aot
    import torch
    from iree.compiler.tools.binaries import find_tool

    from engine.exporter.kernels import attend_one_dispatch

    n, kvh, rep, d, size, c, e, cap = case
    g = torch.Generator().manual_seed(4)
    q = torch.randn(n, kvh, rep, d, generator=g) / d ** 0.5
    keys, values = (torch.randn(kvh, size, d, generator=g).to(getattr(torch, {"f16": "float16"}.get(e, "float32")))
                    for _ in range(2))
    keys[:, c:], values[:, c:] = float("nan"), float("nan")  # not attended: never read
    mask = torch.zeros(n, c)
    mask[:, 5] = float("-inf")
    mask[:, 8:8 + d] = float("-inf")  # a tile's worth of slots masked
    mask[:, 2 * d:3 * d] = float("-inf")  # the third tile, whole
    for i in range(n):
        mask[i, c - n + i + 1:] = float("-inf")

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, m):
            return attend_one_dispatch(q, k, v, m, cap)

    src = tmp_path / "a.mlir"
    src.write_text(str(aot.export(Attend(), args=(q, keys, values, mask), strict_export=False).mlir_module))
    subprocess.run([find_tool("iree-compile"), str(src), "-o", str(tmp_path / "a.vmfb"),
                    *compile_flags("vulkan", "llvmpipe")], check=True, capture_output=True, timeout=300)
    for name, t in zip("qkvm", (q, keys, values, mask)):
        np.save(tmp_path / f"{name}.npy", t.numpy())
    subprocess.run([str(Path(sys.executable).with_name("iree-run-module")), "--device=vulkan",
                    f"--module={tmp_path / 'a.vmfb'}", "--function=main",
                    *(f"--input=@{tmp_path / name}.npy" for name in "qkvm"), f"--output=@{tmp_path / 'o.npy'}"],
                   check=True, capture_output=True, timeout=300)
    got = np.load(tmp_path / "o.npy")
    scores = torch.einsum("nhrd,hcd->nhrc", q, keys[:, :c].float())
    if cap:
        scores = torch.tanh(scores / cap) * cap
    meant = torch.einsum("nhrc,hcd->nhrd", torch.softmax(scores + mask[:, None, None], -1), values[:, :c].float())
    np.testing.assert_allclose(got, meant.numpy(), atol=1e-5, rtol=1e-5)


def test_eddy_chat_answers_on_vulkan():
    _need_a_vulkan_device()
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--model", "tiny-random", "--device", "vulkan",
                           "--dtype", "f32", "--prompt", "hello", "--max-new-tokens", "4", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert next(e for e in events if e.get("event") == "done")["tokens"] == 4


def test_without_a_vulkan_device_a_build_names_a_target_and_a_built_one_says_what_is_missing(tmp_path):
    """A machine whose Vulkan loader finds no driver (VK_ICD_FILENAMES pointing at nothing: a real loader, no
    device): `--device vulkan` alone is refused in a sentence that says how to name a target; with a target named
    the build is made (for a GPU elsewhere), and opening it here says what is missing. The app falls back to the CPU."""
    import os

    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "none.json")}
    # f32: the portable profile promises no 64-bit integers and 16 kB of workgroup memory, which q8's decode passes.
    base = [sys.executable, "-m", "engine.cli", "compile", "--model", "tiny-random", "--device", "vulkan",
            "--dtype", "f32"]
    refused = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "--gpu-target" in refused.stderr and "Traceback" not in refused.stderr
    built = subprocess.run([*base, "--gpu-target", VULKAN_PORTABLE], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    opened = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path\n"
                             "from engine.loader import open_folder\nopen_folder(Path(sys.argv[1]))",
                             built.stdout.strip().splitlines()[-1]], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert opened.returncode != 0 and "DeviceError" in opened.stderr and "--device cpu" in opened.stderr
    fallback = subprocess.run([sys.executable, "-c", "from engine.gpu import runnable\n"
                               "from engine.config import BuildSettings\n"
                               "s, why = runnable(BuildSettings(device='vulkan')); print(s.device, '|', why)"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    device, why = fallback.stdout.strip().split(" | ", 1)
    assert device == "cpu" and why.startswith("vulkan chosen, but")
