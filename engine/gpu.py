"""Which GPUs this machine has: NVIDIA ones asked of the CUDA driver library itself, Vulkan devices of IREE's
Vulkan driver. Torch-free, Qt-free.

The build takes its CUDA or Vulkan target from here when none is given (`--gpu-target`), and the runtime checks
that a module built for a GPU has one to run on before IREE is asked, so a missing GPU gets a sentence, not IREE's
status code. libcuda ships with the driver: where it cannot be loaded there is no usable GPU either.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, replace
from functools import lru_cache

from .config import BuildSettings
from .devices import DEVICES, GPU_TARGETS, VULKAN_PORTABLE, cuda_target_for, vulkan_target_for
from .errors import DeviceError

_CC_MAJOR, _CC_MINOR = 75, 76  # CUdevice_attribute: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR/_MINOR


@dataclass(frozen=True)
class Gpu:
    name: str
    major: int  # compute capability
    minor: int
    memory: int  # bytes

    @property
    def compute_capability(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def target(self) -> str:
        """The iree-compile CUDA target its code is built for."""
        return cuda_target_for(self.major, self.minor)


@lru_cache(maxsize=1)
def probe() -> tuple[tuple[Gpu, ...], str]:
    """The GPUs, and why there are none when there are none. Asked once per process: cuInit is not free."""
    names = ["libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda") or ""]
    lib = None
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return (), "the NVIDIA driver library (libcuda) is not installed"
    count, device = ctypes.c_int(), ctypes.c_int()
    status = lib.cuInit(0)
    if status != 0:
        return (), f"the NVIDIA driver found no usable GPU (cuInit: error {status})"
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return (), "the NVIDIA driver reports no GPU"
    gpus = []
    for index in range(count.value):
        name, major, minor, memory = ctypes.create_string_buffer(256), ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
        if lib.cuDeviceGet(ctypes.byref(device), index) != 0:
            continue
        lib.cuDeviceGetName(name, len(name), device)
        lib.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, device)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, device)
        lib.cuDeviceTotalMem_v2(ctypes.byref(memory), device)
        gpus.append(Gpu(name.value.decode(errors="replace"), major.value, minor.value, memory.value))
    return tuple(gpus), "" if gpus else "the NVIDIA driver reports no GPU"


def cuda_gpus() -> tuple[Gpu, ...]:
    return probe()[0]


@dataclass(frozen=True)
class VulkanGpu:
    name: str  # as the Vulkan driver reports it, e.g. "llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe Mesa 22.3.6 ...)"

    @property
    def target(self) -> str:
        """The iree-compile Vulkan target its code is built for."""
        return vulkan_target_for(self.name)


@lru_cache(maxsize=1)
def vulkan_probe() -> tuple[tuple[VulkanGpu, ...], str]:
    """The Vulkan devices IREE's driver sees, and why there are none when there are none. Asked once per process."""
    try:
        import iree.runtime as rt

        found = rt.get_driver("vulkan").query_available_devices()
    except (RuntimeError, ValueError, OSError) as e:  # no Vulkan loader, or no driver (ICD) it can start
        return (), f"no Vulkan driver could start ({e})"
    gpus = tuple(VulkanGpu(str(d.get("name", "?"))) for d in found)
    return gpus, "" if gpus else "the Vulkan driver reports no device (Mesa's lavapipe is one on the CPU)"


def gpus_of(device: str) -> tuple[tuple[Gpu, ...] | tuple[VulkanGpu, ...], str]:
    """This machine's GPUs for a GPU device, and why there are none when there are none."""
    return probe() if device == "cuda" else vulkan_probe()


# How to build for a GPU on another machine, by device: a target to name.
_NAME_A_TARGET = {"cuda": "e.g. --gpu-target sm_89 (Ada and Hopper GPUs) or sm_80 (Ampere)",
                  "vulkan": f"e.g. --gpu-target rdna3 (AMD RX 7000), ada (NVIDIA RTX 40) or {VULKAN_PORTABLE} "
                            "(any Vulkan 1.1 device)"}


def resolve_target(settings: BuildSettings) -> BuildSettings:
    """The settings with the GPU target filled in from this machine's first GPU when the user gave none.

    The artefact key covers the target, so it must be known before a build is looked up."""
    if settings.device not in GPU_TARGETS or settings.gpu_target:
        return settings
    gpus, why = gpus_of(settings.device)
    if not gpus:
        raise DeviceError(f"Cannot build for the {settings.device} device: {why}. To build for a GPU on another "
                          f"machine, name its target, {_NAME_A_TARGET[settings.device]}.")
    return replace(settings, gpu_target=gpus[0].target)


def check_runnable(settings: BuildSettings) -> Gpu | VulkanGpu:
    """The GPU a cuda or vulkan build will run on; DeviceError saying what is missing when it cannot run here."""
    gpus, why = gpus_of(settings.device)
    if not gpus:
        kind = "a Vulkan GPU (vulkan" if settings.device == "vulkan" else "an NVIDIA GPU (cuda"
        raise DeviceError(f"This model was built for {kind}, {settings.gpu_target or 'no target'}), and this machine "
                          f"cannot run it: {why}. Choose the cpu device in Settings (or --device cpu) to run it on "
                          f"the processor.")
    gpu = gpus[0]
    if isinstance(gpu, VulkanGpu):
        # Code for another Vulkan target may use what this device lacks; the portable profile runs anywhere.
        if settings.gpu_target not in (gpu.target, VULKAN_PORTABLE):
            raise DeviceError(f"This model was built for {settings.gpu_target} Vulkan GPUs, and this one is "
                              f"{gpu.name}. Rebuild it with --gpu-target {gpu.target}.")
        return gpu
    built_for = int(settings.gpu_target[3:]) if settings.gpu_target.startswith("sm_") else 0
    if built_for > gpu.major * 10 + gpu.minor:
        raise DeviceError(f"This model was built for {settings.gpu_target} GPUs, newer than this {gpu.name} "
                          f"(compute capability {gpu.compute_capability}). Rebuild it with --gpu-target {gpu.target}.")
    return gpu


def device_name(settings: BuildSettings) -> str:
    """What the status bar calls the device a model runs on: "cpu", "cuda · NVIDIA H200" or "vulkan · llvmpipe"."""
    if settings.device not in GPU_TARGETS:
        return settings.device
    gpus, _ = gpus_of(settings.device)
    return f"{settings.device} · {short_name(gpus[0].name)}" if gpus else settings.device


def short_name(name: str) -> str:
    """A device's name without the driver's details in brackets: "llvmpipe", "AMD Radeon RX 7900 XTX"."""
    return name.split(" (")[0].strip() or name


def runnable(settings: BuildSettings) -> tuple[BuildSettings, str]:
    """The settings a chat app runs with here: a GPU choice falls back to the CPU on a machine without that GPU
    (the choice stays in Settings for when one is there), with the reason to show; other choices are kept."""
    if settings.device not in GPU_TARGETS:
        return settings, ""
    gpus, why = gpus_of(settings.device)
    if gpus:
        return settings, ""
    return replace(settings, device="cpu", gpu_target=""), f"{settings.device} chosen, but {why}"


def device_choices() -> list[tuple[str, str, bool]]:
    """(device, label, available) for a Settings list: the GPU named where there is one."""
    out = []
    for name in DEVICES:
        if name not in GPU_TARGETS:
            out.append((name, name, True))
            continue
        gpus, _ = gpus_of(name)
        missing = "no NVIDIA GPU here" if name == "cuda" else "no Vulkan device here"
        out.append((name, f"{name} · {short_name(gpus[0].name)}" if gpus else f"{name} ({missing})", bool(gpus)))
    return out
