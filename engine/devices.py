"""The devices Eddy can build for and run on: one row each, read by the runtime, the export and the CLI.

Torch-free: the runtime picks its IREE driver here and the export its iree-compile flags, so a device is
added (or a flag changed) in one place.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    driver: str  # iree.runtime driver that runs the module
    flags: tuple[str, ...]  # iree-compile flags that target it
    target_flag: str = ""  # the flag that names the chip, its value the build's target (BuildSettings.target)
    default_target: str = ""  # "": a build must name one
    auto_kv: str = ""  # the KV cache type "auto" gives here; "": the weight type's (config.AUTO_KV_DTYPE)
    fixed_shapes: bool = False  # programs of fixed call shapes, calls padded to them (engine/shapes.py)
    # How attention is computed (engine/exporter/model.py, Attention): "ops", by the custom ops of
    # engine/exporter/kernels/attention.py (decode's keys read as blocks; prefill's scores, softmax and output by
    # hand, or all in one op); "fused", IREE's own attention op, one a layer; "own", a kernel of Eddy's, one dispatch
    # a layer (engine/exporter/kernels/gpu_attention.py); "generic", torch's matmuls and softmax as IREE compiles them.
    attention: str = "generic"
    # The custom ops carry llvm-cpu's lowering attributes (engine/exporter/kernels/plan.py); elsewhere IREE chooses.
    llvm_cpu: bool = False
    # The first layer's norms (those that read the embedding lookup) sum their squares per group of this many first
    # (engine/exporter/model.py, RMSNorm; 0: in one reduction); a grouped norm is IREE's to form, never one dispatch.
    norm_groups: int = 0
    # Each dispatch is a kernel launch (a few us on a GPU, where a decode step's own work per layer is tens of us):
    # the model takes its forms of fewer dispatches (engine/exporter/model.py: q's and k's rotation as one op, the
    # cache written by one flat index a row computed once a call, and, in a build of fixed shapes, each norm as one
    # kernel where IREE makes two: kernels.rms_norm_one_dispatch).
    launch_bound: bool = False
    # float16 weights multiply a call's many rows in 16 bits, summing in float32 (kernels.f16_linear), which IREE
    # gives the GPU's matrix units (cuda: tensor cores); one row (decode) keeps float32 products.
    matrix_units: bool = False
    # q4's product of many rows widens its matrix inside its own dispatch (kernels/q4_products.py, _MM_Q4_ONE), where
    # IREE would write the widened matrix out in float32 every call (a dispatch of its own); a device of fixed shapes.
    q4_rows_fused: bool = False


# The CUDA targets iree-compile 3.13 knows by name: it has no sm_90 or sm_100 (their names give "missing GPU
# target"). A GPU gets the newest one not newer than itself; its PTX is compiled for the GPU by the driver at
# load, so Hopper (9.0) runs sm_89 code.
CUDA_TARGETS = ("sm_60", "sm_61", "sm_62", "sm_70", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89",
                "sm_120", "sm_121")


def cuda_target_for(major: int, minor: int) -> str:
    """The CUDA target to build for a GPU of compute capability major.minor."""
    fits = [t for t in CUDA_TARGETS if int(t[3:]) <= major * 10 + minor]
    if not fits:
        raise ValueError(f"GPUs of compute capability {major}.{minor} are older than any CUDA target IREE builds for")
    return fits[-1]


# Vulkan: the targets iree-compile 3.13 knows by name that a device's name leads to (VULKAN_BY_NAME), the first
# fragment found in the lower-cased name deciding; a device none names gets the portable profile, which assumes
# only what every Vulkan 1.1 device has. "llvmpipe" is Mesa's Vulkan device on the CPU (lavapipe): the tests run there.
VULKAN_PORTABLE = "vp_android_baseline_2022"
VULKAN_BY_NAME = (
    ("llvmpipe", "llvmpipe"),
    ("rtx 50", "ada"), ("rtx 40", "ada"), ("nvidia h100", "ada"), ("nvidia h200", "ada"), ("nvidia l4", "ada"),
    ("rtx 30", "ampere"), ("nvidia a100", "ampere"), ("nvidia a40", "ampere"), ("nvidia a10", "ampere"),
    ("rtx 20", "turing"), ("gtx 16", "turing"), ("tesla t4", "turing"), ("v100", "volta"), ("nvidia", "pascal"),
    ("rx 9", "rdna4"), ("rx 7", "rdna3"), ("rx 6", "rdna2"), ("rx 5", "rdna1"), ("radeon", "rdna2"),
    ("mali-g", "valhall"), ("adreno", "adreno"),
)
VULKAN_TARGETS = tuple(dict.fromkeys(t for _, t in VULKAN_BY_NAME)) + (VULKAN_PORTABLE,)


def vulkan_target_for(device_name: str) -> str:
    """The iree-compile Vulkan target for a device of this name (as the Vulkan driver reports it)."""
    name = device_name.lower()
    return next((target for fragment, target in VULKAN_BY_NAME if fragment in name), VULKAN_PORTABLE)


# The targets a build for each GPU device may name (BuildSettings.gpu_target).
GPU_TARGETS = {"cuda": CUDA_TARGETS, "vulkan": VULKAN_TARGETS}


TABLE: dict[str, Device] = {d.name: d for d in (
    Device("cpu", "local-task", (
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        # The llvm-cpu defaults prefill ~8x slower: data tiling with microkernels is what makes it fast
        # (data tiling without microkernels is slower than the defaults).
        "--iree-opt-level=O3",
        "--iree-opt-data-tiling",
        "--iree-llvmcpu-enable-ukernels=all",
    ), "--iree-llvmcpu-target-cpu=", "host", attention="ops", llvm_cpu=True),
    # No matrix units: for `ada`, the cooperative-matrix pipeline failed on the first layer's output product, into
    # whose dispatch IREE fuses the residual add and the widening of the 16-bit embedding row ("unhandled multiple
    # matmul/generic cases"; the default model, Qwen3 0.6B).
    # Weights' transforms are left in each call, not hoisted into the module's initialiser: hoisted, the decode's
    # transformed matrices came out wrong on Mesa's lavapipe (the tiny model's decode logits off by 1e-2 to NaN
    # while prefill, which reads the weights as stored, matched the CPU to 2e-7; with this flag both match).
    # The first layer's norms sum their squares per 32 first (and so are not one dispatch): IREE fused a q4
    # embedding's lookup (its group index from linalg.index) into a one-reduction norm 4096 wide (an 8B's) and its
    # SPIR-V lowering then kept index values in workgroup memory (`memref<2048xindex>`), which failed. As one formed
    # dispatch, two 8B layers compiled, but the device check's whole 8B build failed so again: grouped it built.
    Device("vulkan", "vulkan", ("--iree-hal-target-device=vulkan", "--iree-opt-const-expr-hoisting=false"),
           "--iree-vulkan-target=", fixed_shapes=True, attention="own", norm_groups=32, launch_bound=True,
           q4_rows_fused=True),
    # A float32 cache on the GPU: IREE's GPU code widening a 16-bit one cost a decode step at 1000 tokens 7.7 ms
    # against 4.6 (H200, docs/GPU.md), and a GPU has the memory (the default model's cache is 47 MB in float32).
    # IREE's attention op compiles for cuda, not for vulkan (its SPIR-V pipeline fails to bufferize the op).
    Device("cuda", "cuda", ("--iree-hal-target-device=cuda",), "--iree-cuda-target=", auto_kv="f32", fixed_shapes=True,
           attention="fused", launch_bound=True, matrix_units=True, q4_rows_fused=True),
)}
DEVICES = tuple(TABLE)


# The form of the hand-written decode products (engine/exporter/kernels/dot_products.py: q4's and q8's) each
# llvm-cpu target guarantees the instructions for: "vnni" needs AVX-512 VNNI (and BW), "avx2" AVX2; None: the
# generic forms. x86-64-v4 is AVX-512 F/BW/CD/DQ/VL, without VNNI. "host" takes the first row of HOST_DOT_FORMS
# whose flags this CPU lists.
DOT_FORMS: dict[str, str | None] = {"x86-64-v4": "avx2", "x86-64-v3": "avx2", "x86-64-v2": None, "x86-64": None}
HOST_DOT_FORMS = ((("avx512_vnni", "avx512bw"), "vnni"), (("avx2",), "avx2"))


def dot_form(device: str, target_cpu: str) -> str | None:
    """The form of the hand-written decode products a build for `device` and `target_cpu` takes (None: the
    generic ones)."""
    if device != "cpu":
        return None
    if target_cpu != "host":
        return DOT_FORMS[target_cpu]
    return next(iter(host_dot_forms()), None)


def host_dot_forms() -> list[str]:
    """The hand-written forms this CPU runs, the best first."""
    flags = host_cpu_flags()
    return [form for needs, form in HOST_DOT_FORMS if flags.issuperset(needs)]


def host_cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty elsewhere, or on a CPU that is not x86: the generic
    forms)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


# Targets whose builds keep dynamic shapes on a device of fixed ones: the portable Vulkan profile promises no 64-bit
# integers, which IREE emulates for scalar code but not for the vectors fixed shapes make of the positions' compares
# (iree-compile: "failed to legalize operation 'vector.broadcast'" of an i64).
DYNAMIC_TARGETS = (VULKAN_PORTABLE,)


def fixed_shapes(device: str, target: str) -> bool:
    """Whether a build for `device` and its `target` holds programs of fixed call shapes (engine/shapes.py)."""
    return TABLE[device].fixed_shapes and target not in DYNAMIC_TARGETS


def driver(device: str) -> str:
    """The iree.runtime driver name for a device."""
    return TABLE[device].driver


def compile_flags(device: str, target: str = "") -> list[str]:
    """iree-compile flags for a device and its target: a CPU ("host", "x86-64-v3"), a CUDA target ("sm_89") or a
    Vulkan one ("rdna3", "llvmpipe")."""
    row = TABLE[device]
    if not row.target_flag:
        return list(row.flags)
    target = target or row.default_target
    if not target:
        raise ValueError(f"a {device} build needs a target (--gpu-target)")
    return [*row.flags, row.target_flag + target]
